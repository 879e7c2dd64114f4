"""Producer, pull mode: a matched registration gets a ReadGrant, and the consumer READs.

The source blocks stay pinned (a `ReadPin` in the producer's in-flight list) until the consumer's ReadResult, or
until the grant's deadline: the consumer gives up its READ after write_timeout_s, so after that plus fence_grace_s
nothing can still read them.  Mixed into `ProducerEndpoint`; its code runs on the producer's worker thread.
"""

from __future__ import annotations

from kvpush_common.endpoint.base import Peer
from kvpush_common.endpoint.transfers import ReadPin
from kvpush_common.protocol.identity import TransferKey
from kvpush_common.protocol.wire import ReadGrant, ReadResult
from kvpush_common.state.rendezvous import Dest, StartWrite


class PullGrants:
    def _grant(self, a: StartWrite, peer: Peer, now: float) -> list:
        """Pull mode: the KV is complete; let the consumer READ it.  Pinned until its ReadResult, or
        until write_timeout_s + fence_grace_s (the consumer gives up its READ after write_timeout_s)."""
        grant = ReadGrant(transfer_id=a.key.transfer_id, attempt=a.key.attempt, producer_engine=self.cfg.engine_id,
                          producer_rank=self.cfg.rank, block_ids=list(a.ready.block_ids),
                          num_tokens=a.ready.num_tokens)
        if not self._send(peer, grant):
            return self._fail_write(a, "post_failed", "could not send the read grant", now)
        self._inflight.append(ReadPin(a, now, now + self.cfg.write_timeout_s + self.cfg.fence_grace_s))
        self.stats.writes_posted.inc()
        self.event("granted", a.key, consumer_rank=peer.rank)
        return []

    def _on_read_result(self, key: TransferKey, dest: Dest, msg: ReadResult, now: float) -> list:
        item = next((i for i in self._inflight if isinstance(i, ReadPin) and i.key == key and i.dest == dest), None)
        if item is None:
            return []  # duplicate, or after the grant's deadline (already failed)
        self._inflight.remove(item)
        self.event("read_" + ("done" if msg.ok else "failed"), key, consumer_rank=dest[1])
        if msg.ok:
            self.stats.writes_done.inc()
            self.stats.xfer_seconds.observe(now - item.posted_at)
            return self.rendezvous.on_write_result(key, dest, True, now)
        self.stats.writes_failed.labels(code="read_failed").inc()
        return self.rendezvous.on_write_result(key, dest, False, now)

    def _poll_pin(self, item: ReadPin, now: float) -> list:
        if now < item.deadline:
            return []
        self._inflight.remove(item)  # the consumer's READ bound has passed: unpin
        return self._fail_write(item.start, "read_timeout", "no ReadResult before the deadline", now)
