"""Consumer, pull mode: a registration is answered with a ReadGrant naming the source blocks, and we READ them.

The READ is planned with the producer as source (`plan_write`) and posted with its ReadResult(ok=True) riding on it
to the producer; each posted READ is a `_Read` polled until it settles, bounded by the lower of the two sides'
write_timeout_s (the producer unpins after its own bound).  A READ that cannot be posted, fails or times out sends
ReadResult(ok=False), so the producer unpins at once, and fails the key.  Its own module so the core
(`consumer.py`) reads as the whole-push path (the producer's side is `producer_pull.py`).  Mixed into
`ConsumerEndpoint`; its code runs on the consumer's worker thread (the only caller of NIXL).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush_common.endpoint.base import Peer
from kvpush_common.endpoint.transfers import Settled
from kvpush_common.plan.planner import PlanError
from kvpush_common.plan.write import plan_write
from kvpush_common.protocol.identity import TransferKey
from kvpush_common.protocol.topology import routes
from kvpush_common.protocol.wire import ReadGrant, ReadResult
from kvpush_common.transport.nixl import TransportError


@dataclass
class _Read:
    key: TransferKey
    producer: tuple[str, int]
    handle: object
    posted_at: float
    deadline: float


class PullReads:
    def _read_result(self, peer: Peer, key: TransferKey, ok: bool, reason: str = "") -> ReadResult:
        return ReadResult(transfer_id=key.transfer_id, attempt=key.attempt, consumer_engine=self.cfg.engine_id,
                          consumer_rank=self.cfg.rank, ok=ok, reason=reason[:500])

    def _on_grant(self, peer: Peer, g: ReadGrant, now: float) -> list:
        key, prod = TransferKey(g.transfer_id, g.attempt), (peer.engine_id, peer.rank)
        e = self._expects.get(key)
        if e is None or not self.completion.wants_registration(key):
            # ended or failing: unpin the producer's blocks without reading
            self._send(peer, self._read_result(peer, key, False, "request no longer wants the KV"))
            return []
        try:
            if g.num_tokens != e.num_tokens:
                raise PlanError(f"producer has {g.num_tokens} tokens, this request expects {e.num_tokens}")
            route = next(r for r in routes(self.cfg.total_kv_heads, peer.tp_size, self.cfg.tp_size)
                         if r.src_rank == peer.rank and r.dst_rank == self.cfg.rank)
            plan = plan_write(peer.layout, self.layout, route, g.block_ids, e.block_ids, num_tokens=g.num_tokens,
                              dst_first_token=e.first_token)
            notif = self.codec.encode(self._read_result(peer, key, True))
            handle = self.transport.post("READ", peer.agent, plan.dst, plan.src, self.layout.mem_type,
                                         peer.layout.mem_type, notif)
        except (PlanError, TransportError, StopIteration) as err:
            self._send(peer, self._read_result(peer, key, False, str(err)))
            return self.completion.on_failed(key, prod, f"read not posted: {err}", now)
        bound = min(self.cfg.write_timeout_s, peer.write_timeout_s)  # the producer unpins after its own bound
        self._reads.append(_Read(key, prod, handle, now, now + bound))
        self.stats.writes_posted.inc()
        self.stats.descs_posted.inc(plan.num_descs)
        self.event("read_posted", key, producer_rank=peer.rank, nbytes=plan.nbytes, descs=plan.num_descs)
        return []

    def _poll_reads(self, now: float) -> list:
        out: list = []
        for r in list(self._reads):
            state = self._settle(r.handle, now, r.deadline)
            if state is None:
                continue  # still running (and not cancellable yet): it may still write into our blocks
            self._reads.remove(r)
            peer = self._peers.get(r.producer)
            if state is Settled.DONE:  # our blocks hold the KV; its ReadResult went to the producer on the READ
                self.stats.writes_done.inc()
                self.stats.xfer_seconds.observe(now - r.posted_at)
                out += self.completion.on_done(r.key, r.producer, now)
            else:
                reason = "READ failed" if state is Settled.ERR else "READ timed out"
                if peer is not None:
                    self._send(peer, self._read_result(peer, r.key, False, reason))
                out += self.completion.on_failed(r.key, r.producer, reason, now)
        return out
