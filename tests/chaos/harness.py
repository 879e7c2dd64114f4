"""Chaos harness for the protocol core: one producer rank and one consumer rank, each its own OS
process over real NIXL (UCX, 127.0.0.1), driven through a seeded schedule of faults.

The driver plays both engines.  It allocates blocks from a free list on each side, frees a
consumer's blocks when its `Received` comes (poisoning them, as a reusing engine would overwrite
them), and frees a producer's blocks on `Release`.  After every run `check()` asserts:

- every request ended on the consumer side (ok or not) within `bound_s` of its start, and on the
  producer side (a `Release`) within the producer's own bound, unless the process that held it died;
- no byte landed in a freed block: every block on the free list still holds the poison byte, checked
  before each reuse and at the end;
- the free-block counts on both sides are back to their baseline and the endpoints hold nothing
  (no live key, no in-flight transfer, nothing undrained);
- every request that ended ok holds exactly the producer's KV (digest of the logical view);
- after a restart, the process rejoins and the next requests succeed (`clean_batch`).
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field

from kvpush_common.testing.procs import PeerProcess
from kvpush_common.testing.vllm_cluster import free_port

POISON = 0xAB
GEO = dict(num_layers=2, head_dim=8, dtype="bfloat16", dtype_size=2, block_size=16, order="HND")
# Short timeouts so that the documented consumer bound (transfer_timeout_s + fence_wait_s, with
# fence_wait_s = reg_ttl_s + write_timeout_s + fence_grace_s) fits in lease_s + 5 s.
FAST = dict(lease_s=6.0, reg_ttl_s=2.0, heartbeat_s=0.5, write_timeout_s=1.5, fence_grace_s=2.0,
            transfer_timeout_s=4.0, handshake_timeout_s=1.5, peer_idle_s=30.0)


def consumer_bound(cfg: dict) -> float:
    return cfg["transfer_timeout_s"] + cfg["reg_ttl_s"] + cfg["write_timeout_s"] + cfg["fence_grace_s"]


def producer_bound(cfg: dict) -> float:
    """Ready KV is held at most while the consumer heartbeats (its transfer timeout), then a lease,
    then a WRITE still in flight."""
    return cfg["transfer_timeout_s"] + cfg["lease_s"] + cfg["write_timeout_s"]


@dataclass
class Req:
    tid: str
    attempt: int
    n: int
    p_blocks: list[int]
    d_blocks: list[int]
    t_start: float
    p_gen: int  # producer incarnation whose blocks it holds
    d_gen: int
    p_digest: str | None = None
    d_end: float | None = None  # consumer Received time (monotonic, comparable across processes)
    ok: bool | None = None
    reason: str = ""
    p_end: float | None = None
    p_outcome: str | None = None
    orphaned_p: bool = False  # its producer process died: its blocks went with it
    orphaned_d: bool = False
    ready_sent: bool = False
    expect_sent: bool = False
    intact: bool | None = None
    t_ready: float = 0.0


class Side:
    """One endpoint process plus the engine's view of its blocks."""

    def __init__(self, name: str, role: str, cfg: dict, faults: dict | None, num_blocks: int):
        self.name, self.role, self.cfg, self.faults, self.num_blocks = name, role, cfg, faults, num_blocks
        self.proc: PeerProcess | None = None
        self.gen = -1
        self.free: list[int] = []
        self.stopped = False

    def start(self, port: int | None = None) -> None:
        self.gen += 1
        self.proc = PeerProcess(f"{self.name}{self.gen}")
        cfg = dict(engine_id=self.name, rank=0, tp_size=1, total_kv_heads=2, **self.cfg)
        if port:
            cfg["base_port"] = port
        faults = dict(self.faults, seed=self.faults.get("seed", 0) + self.gen) if self.faults else None
        self.proc.call("start", role=self.role, cfg=cfg, faults=faults,
                       backend=dict(kind="host", num_heads=2, head_offset=0, num_blocks=self.num_blocks, **GEO))
        if self.role == "producer":
            self.proc.call("fill", seed=100)  # the same KV in every incarnation
        else:
            self.proc.call("poison", byte=POISON)
        self.free = list(range(self.num_blocks))
        self.stopped = False

    def kill(self) -> None:
        if self.stopped:
            self.cont()
        self.proc.proc.kill()
        self.proc.proc.wait()
        self.proc.close()

    def stop(self) -> None:
        os.kill(self.proc.proc.pid, signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        os.kill(self.proc.proc.pid, signal.SIGCONT)
        self.stopped = False

    def alloc(self, rng: random.Random, count: int) -> list[int]:
        if len(self.free) < count:
            raise RuntimeError(f"{self.name}: out of blocks ({len(self.free)} free, {count} wanted)")
        picked = rng.sample(self.free, count)
        for b in picked:
            self.free.remove(b)
        return picked


@dataclass
class Log:
    rows: list[str] = field(default_factory=list)

    def __call__(self, msg: str) -> None:
        self.rows.append(f"{time.monotonic():.3f} {msg}")


class Chaos:
    def __init__(self, seed: int, *, p_cfg: dict | None = None, d_cfg: dict | None = None,
                 p_faults: dict | None = None, d_faults: dict | None = None, num_blocks: int = 96):
        self.rng = random.Random(seed)
        self.seed = seed
        self.p_cfg = {**FAST, **(p_cfg or {})}
        self.d_cfg = {**FAST, **(d_cfg or {})}
        self.port = free_port()
        self.P = Side("P", "producer", self.p_cfg, p_faults, num_blocks)
        self.D = Side("D", "consumer", self.d_cfg, d_faults, num_blocks)
        self.reqs: dict[tuple[str, int], Req] = {}
        self.log = Log()
        self.next_id = 0
        self.bound_s = consumer_bound(self.d_cfg)
        self.p_bound_s = producer_bound(self.p_cfg)

    # ---- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> "Chaos":
        self.P.start(self.port)
        self.D.start()
        return self

    def __exit__(self, *exc) -> None:
        for side in (self.P, self.D):
            if side.proc is not None:
                if side.stopped:
                    side.cont()
                side.proc.close()

    def restart(self, side: Side) -> None:
        self.collect()
        side.kill()
        for r in self.reqs.values():  # the dead process's blocks went with it
            if side is self.P and r.p_gen == side.gen and r.p_end is None and r.ready_sent:
                r.orphaned_p = True
            if side is self.D and r.d_gen == side.gen and r.d_end is None:
                r.orphaned_d = True
        self.log(f"restart {side.name} gen {side.gen}")
        side.start(self.port if side is self.P else None)

    @property
    def producer_ref(self) -> dict:
        return dict(engine_id="P", host="127.0.0.1", port=self.port, tp_size=1)

    # ---- requests -----------------------------------------------------------------------------
    def new_request(self, *, n: int | None = None, attempt: int = 0, tid: str | None = None) -> Req:
        n = n or self.rng.randint(1, 80)
        nb = -(-n // GEO["block_size"])
        tid = tid or f"s{self.seed}-{self.next_id}"
        self.next_id += 1
        self.check_free_blocks_clean()
        r = Req(tid, attempt, n, self.P.alloc(self.rng, nb), self.D.alloc(self.rng, nb), time.monotonic(), self.P.gen,
                self.D.gen)
        self.reqs[(tid, attempt)] = r
        return r

    def expect(self, r: Req) -> None:
        r.t_start = time.monotonic()
        r.expect_sent = True
        self.D.proc.call("expect", tid=r.tid, attempt=r.attempt, producer=self.producer_ref, blocks=r.d_blocks,
                         num_tokens=r.n)

    def ready(self, r: Req) -> None:
        if r.p_gen != self.P.gen:  # allocated before a producer restart: take blocks of this incarnation
            r.p_blocks, r.p_gen = self.P.alloc(self.rng, len(r.p_blocks)), self.P.gen
        if r.p_digest is None:
            r.p_digest = self.P.proc.call("logical_digest", blocks=r.p_blocks, num_tokens=r.n)["sha256"]
        r.ready_sent = True
        r.t_ready = time.monotonic()
        self.P.proc.call("ready", tid=r.tid, attempt=r.attempt, blocks=r.p_blocks, num_tokens=r.n)

    def abort(self, r: Req, reason: str = "chaos abort") -> None:
        self.D.proc.call("abort", tid=r.tid, attempt=r.attempt, reason=reason)

    def pair(self, r: Req) -> None:
        """Both legs, in a seeded order."""
        if self.rng.random() < 0.5:
            self.expect(r)
            self.ready(r)
        else:
            self.ready(r)
            self.expect(r)

    # ---- results ------------------------------------------------------------------------------
    def _new_results(self, side, prefix: str):
        """(request, result, end time) for results of `side`'s live incarnation not yet taken (prefix
        "p" or "d" names the request's fields for that side)."""
        if side.stopped or side.proc is None:  # paused, or killed and not started again
            return
        got = side.proc.call("results")
        times = {(t, a): s for t, a, s in got["times"]}
        for res in got["results"]:
            r = self.reqs.get((res["tid"], res["attempt"]))
            if r is None or getattr(r, prefix + "_end") is not None or getattr(r, prefix + "_gen") != side.gen:
                continue
            yield r, res, times[(r.tid, r.attempt)]

    def collect(self) -> None:
        """Take both sides' results; free blocks as an engine would."""
        for r, res, t in self._new_results(self.D, "d"):
            r.d_end, r.ok, r.reason = t, res["ok"], res["reason"]
            if r.ok:
                d = self.D.proc.call("logical_digest", blocks=r.d_blocks, num_tokens=r.n)["sha256"]
                r.intact = d == r.p_digest
            # the engine reuses the blocks now: overwrite them, as new KV would
            self.D.proc.call("poison", byte=POISON, blocks=r.d_blocks)
            self.D.free += r.d_blocks
        for r, res, t in self._new_results(self.P, "p"):
            r.p_end, r.p_outcome = t, res["outcome"]
            self.P.free += r.p_blocks
        # blocks of requests whose process died are back with that process's fresh incarnation
        for r in self.reqs.values():
            if r.orphaned_p and r.p_end is None:
                r.p_end, r.p_outcome = -1.0, "died"
            if r.orphaned_d and r.d_end is None:
                r.d_end, r.ok, r.reason = -1.0, None, "consumer died"

    def settle(self, timeout: float | None = None) -> None:
        """Wait until every request ended on both sides (or the bound is clearly exceeded)."""
        deadline = time.monotonic() + (timeout or (max(self.bound_s, self.p_bound_s) + 5))
        while time.monotonic() < deadline:
            self.collect()
            if all(self._ended(r) for r in self.reqs.values()):
                return
            time.sleep(0.1)
        self.collect()

    def _ended(self, r: Req) -> bool:
        d_done = r.d_end is not None or not r.expect_sent
        p_done = r.p_end is not None or not r.ready_sent
        return d_done and p_done

    def check_free_blocks_clean(self) -> None:
        if self.D.stopped:
            return
        dirty = set(self.D.proc.call("dirty_blocks", poison=POISON)["blocks"])
        landed = dirty & set(self.D.free)
        assert not landed, f"bytes landed in freed consumer blocks {sorted(landed)}\n" + "\n".join(self.log.rows[-30:])

    # ---- invariants ---------------------------------------------------------------------------
    def check(self, *, allow_failures: bool = True) -> dict:
        self.settle()
        time.sleep(0.3)  # a straggling WRITE would land now
        self.collect()
        summary = {"requests": len(self.reqs), "ok": 0, "failed": 0, "died": 0, "max_end_s": 0.0,
                   "max_release_s": 0.0}
        problems = []
        for r in self.reqs.values():
            if not r.expect_sent:  # no decode leg: its consumer blocks were never registered
                if r.d_gen == self.D.gen and r.d_end is None:
                    self.D.free += r.d_blocks
                    r.d_end, r.d_gen, r.reason = -1.0, -1, "no decode leg"
            elif r.d_end is None:
                problems.append(f"{r.tid}/{r.attempt}: consumer never ended")
            elif r.d_end >= 0:
                took = r.d_end - r.t_start
                summary["max_end_s"] = max(summary["max_end_s"], took)
                if took > self.bound_s + 1.0:
                    problems.append(f"{r.tid}/{r.attempt}: consumer ended after {took:.1f} s > {self.bound_s:.1f} s")
            if not r.expect_sent:
                pass
            elif r.ok:
                summary["ok"] += 1
                if not r.intact:
                    problems.append(f"{r.tid}/{r.attempt}: ended ok but its bytes differ from the producer's")
            elif r.ok is False:
                summary["failed"] += 1
            else:
                summary["died"] += 1
            if r.ready_sent and r.p_end is None:
                problems.append(f"{r.tid}/{r.attempt}: producer never released its blocks")
            elif r.ready_sent and r.p_end and r.p_end > 0:
                took = r.p_end - r.t_ready
                summary["max_release_s"] = max(summary["max_release_s"], took)
                if took > self.p_bound_s + 1.0:
                    problems.append(f"{r.tid}/{r.attempt}: producer released after {took:.1f} s > {self.p_bound_s:.1f} s")
        self.check_free_blocks_clean()
        if len(self.D.free) != self.D.num_blocks:
            problems.append(f"consumer free blocks {len(self.D.free)} != baseline {self.D.num_blocks}")
        for r in self.reqs.values():  # prefill legs that never ran give their blocks back
            if not r.ready_sent and r.p_gen == self.P.gen:
                self.P.free += r.p_blocks
                r.p_gen = -1
        if len(self.P.free) != self.P.num_blocks:
            problems.append(f"producer free blocks {len(self.P.free)} != baseline {self.P.num_blocks}")
        for side in (self.P, self.D):
            st = side.proc.call("state")
            if st["live"] or st["inflight"] or st["outbox"]:
                problems.append(f"{side.name} still holds {st}")
        if not allow_failures and summary["failed"]:
            problems.append(f"{summary['failed']} requests failed in a run without faults")
        assert not problems, "\n".join(problems) + "\n--- log:\n" + "\n".join(self.log.rows[-40:])
        return summary

    def clean_batch(self, count: int = 3) -> None:
        """After the faults: the (restarted) processes serve the next requests correctly."""
        batch = [self.new_request() for _ in range(count)]
        for r in batch:
            self.pair(r)
        deadline = time.monotonic() + self.bound_s + 5
        while time.monotonic() < deadline and any(r.d_end is None or (r.p_end is None) for r in batch):
            self.collect()
            time.sleep(0.05)
        bad = [(r.tid, r.ok, r.reason) for r in batch if not (r.ok and r.intact)]
        assert not bad, f"requests after the faults did not succeed: {bad}\n" + "\n".join(self.log.rows[-30:])
