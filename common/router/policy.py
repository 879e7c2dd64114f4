"""Which prefill and decode instance serves a request (`kvpush router --policy`).

`round-robin`: in turn, skipping unhealthy instances.  `kv-aware` (default): the instance that would
compute the least, counting what it probably holds in its prefix cache (`prefix_index`) against how
busy it is -- the router's own requests in flight there, plus the queue and KV-cache use it last
reported on /metrics (scraped in the background by the health loop, never on the request path):

    cost = uncached chunks + in_flight_weight * in flight + waiting_weight * waiting
           + full_penalty * [KV cache >= 95 % used]

A chunk is ~64 tokens to compute.  A request in flight there costs little (decode batches grow cheaply);
one waiting in its queue (no KV room or batch slot) costs as much as ~500 tokens of prefill.  A decode
instance's waiting excludes this router's own requests (there they mostly wait for their KV: counted once,
as in flight).

Ties go to the instance next in round-robin order, so equal instances still share the load.  The
choice and its numbers go into the request's timeline (`route`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush_common.router.prefix_index import PrefixIndex

POLICIES = ("kv-aware", "round-robin")
KV_FULL = 0.95


@dataclass
class Instance:
    """One upstream as the policy sees it."""

    url: str
    index: PrefixIndex = field(default_factory=PrefixIndex)
    in_flight: int = 0  # this router's requests on it now (exact)
    sent: int = 0  # this router's requests sent to it, ever (which of them a scrape may count)
    waiting: float = 0.0  # vllm:num_requests_waiting, last scrape (a decode instance's: less this router's)
    running: float = 0.0  # vllm:num_requests_running, last scrape (shown in the timeline, not costed:
    # a running request is already counted in KV use and, if it is this router's, in in_flight)
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc (0-1), last scrape

    def enter(self) -> None:
        self.in_flight += 1
        self.sent += 1

    def leave(self) -> None:
        self.in_flight -= 1


@dataclass(frozen=True)
class Choice:
    instance: Instance
    why: dict  # what the timeline shows


class RoutingPolicy:
    """Picks one of `candidates` (healthy ones first; the caller never passes an empty list)."""

    name = "base"

    def __init__(self) -> None:
        self._turn = 0

    def _rotation(self, candidates: list[Instance]) -> list[Instance]:
        k = self._turn % len(candidates)
        self._turn += 1
        return candidates[k:] + candidates[:k]

    def choose(self, candidates: list[Instance], hashes: list[bytes]) -> Choice:
        raise NotImplementedError


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def choose(self, candidates: list[Instance], hashes: list[bytes]) -> Choice:
        return Choice(self._rotation(candidates)[0], {"policy": self.name})


class KVAware(RoutingPolicy):
    name = "kv-aware"

    def __init__(self, in_flight_weight: float = 1.0, waiting_weight: float = 8.0, full_penalty: float = 64.0) -> None:
        super().__init__()
        self.in_flight_weight = in_flight_weight  # chunks (~64 tokens each) one request in flight is worth
        self.waiting_weight = waiting_weight  # ... and one waiting in the instance's queue
        self.full_penalty = full_penalty

    def cost(self, inst: Instance, hashes: list[bytes]) -> tuple[float, int]:
        matched = inst.index.matched(hashes)
        cost = (len(hashes) - matched) + self.in_flight_weight * inst.in_flight + self.waiting_weight * inst.waiting
        if inst.kv_usage >= KV_FULL:
            cost += self.full_penalty
        return cost, matched

    def choose(self, candidates: list[Instance], hashes: list[bytes]) -> Choice:
        order = self._rotation(candidates)
        scored = [(self.cost(inst, hashes), i, inst) for i, inst in enumerate(order)]
        (cost, matched), _, best = min(scored, key=lambda s: (s[0][0], s[1]))
        return Choice(best, {"policy": self.name, "chunks": len(hashes), "matched_chunks": matched,
                             "cost": round(cost, 2), "in_flight": best.in_flight, "waiting": best.waiting,
                             "running": best.running,
                             "kv_usage": round(best.kv_usage, 3),
                             "others": {inst.url: round(c[0], 2) for c, _, inst in scored if inst is not best}})


def make_policy(name: str) -> RoutingPolicy:
    if name == "kv-aware":
        return KVAware()
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {name!r}")
