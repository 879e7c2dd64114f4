"""Producer, staged push: gather the request's blocks into staging chunks and WRITE them into slots the consumer lent.

Used when both sides offered a staging pool, the route moves whole blocks, and a direct WRITE would post at least
staging_min_descs descriptors (fragmented blocks: one descriptor each).  Each chunk is gathered on the device, posted
with a ChunkWritten notification, and its consumer slot comes back with the consumer's SlotFree (or is reclaimed once
its deadline passes).  A staged transfer is a `StagedPush` in the producer's in-flight list.  Mixed into
`ProducerEndpoint`; its code runs on the producer's worker thread.
"""

from __future__ import annotations

import logging

import numpy as np

from kvpush_common.endpoint.base import Peer
from kvpush_common.endpoint.transfers import Settled, StagedPush
from kvpush_common.plan.blockplan import block_runs, descs_per_run
from kvpush_common.plan.planner import PlanError
from kvpush_common.plan.staging import LentSlots, StagedWrite, blocks_per_chunk, staged_pairs, unit_bytes, whole_block_units
from kvpush_common.protocol.wire import ChunkWritten, SlotFree
from kvpush_common.state.rendezvous import Dest, StartWrite

log = logging.getLogger("kvpush_common.endpoint.producer")


class StagedPushes:
    def _lend_slots(self, peer: Peer, dest: Dest) -> None:
        """The staging slots this consumer rank lends us (a restarted consumer lends new ones; chunks in flight keep theirs)."""
        self._peer_slots.pop(dest, None)
        if self.staging is not None and peer.staging is not None and peer.staging.nbytes >= peer.staging.chunk_bytes:
            self._peer_slots[dest] = LentSlots(peer.staging.addr, peer.staging.nbytes, peer.staging.chunk_bytes,
                                              peer.staging.device_id)

    def _on_slot_free(self, peer: Peer, dest: Dest, msg: SlotFree) -> list:
        slots = self._peer_slots.get(dest)
        try:
            if slots is None:
                raise ValueError("no staging slots lent by this consumer rank")
            slots.give(msg.slot, msg.use or None)
        except ValueError as e:
            self.stats.rejected_msgs.labels(reason="bad_slot").inc()
            log.warning("ignored SlotFree from %s: %s", peer.agent, e)
        return []

    def _reclaim_slots(self, now: float) -> None:
        """Slots whose SlotFree was lost come back."""
        for dest, slots in self._peer_slots.items():
            if n := slots.reclaim(now):
                self.stats.slots_reclaimed.inc(n)
                log.warning("took back %d staging slots of %s whose SlotFree never came", n, dest)

    def _start_staged(self, a: StartWrite, peer: Peer, route, t_post: float, fence_s: float, deadline: float,
                      now: float) -> list | None:
        """Start a staged push of this destination's KV, or None where the direct WRITE is the way."""
        staged = self._staged_plan(a, peer, route)
        if staged is None:
            return None
        self.stats.stage_seconds.labels(stage="fence").observe(fence_s)
        push = StagedPush(a, t_post, deadline, staged.src_blocks.size * staged.nbytes_per_block, staged)
        self._inflight.append(push)
        self.event("posted", a.key, consumer_rank=peer.rank, nbytes=push.nbytes, descs=staged.chunks, staged=True)
        self.stats.writes_posted.inc()
        self.stats.writes_staged.inc()
        return self._advance_staged(push, now)

    def _staged_plan(self, a: StartWrite, peer: Peer, route) -> StagedWrite | None:
        """A staged push when both sides offered staging, the route moves whole blocks, and the direct
        plan would post at least staging_min_descs descriptors; else None (direct)."""
        slots = self._peer_slots.get(a.dest)
        if slots is None or self.staging is None or not whole_block_units(self.layout, peer.layout, route):
            return None
        if not (slots.free and self.staging.free):  # pool exhausted: do not queue behind it, go direct
            self.stats.staging_exhausted.inc()
            return None
        try:
            s, d = staged_pairs(self.layout, peer.layout, a.ready.block_ids, a.reg.block_ids,
                                num_tokens=a.ready.num_tokens, dst_first_token=a.reg.first_token)
            order = np.argsort(s, kind="stable")
            runs = block_runs(s[order], d[order])[0].size
            if descs_per_run(self.layout, peer.layout, route) * runs < self.cfg.staging_min_descs:
                return None
            per_chunk = blocks_per_chunk(self.layout, min(self.staging.chunk_bytes, slots.chunk_bytes))
        except PlanError:
            return None  # the direct path reports the same error
        return StagedWrite(s, per_chunk, len(self.layout.regions) * unit_bytes(self.layout))

    def _advance_staged(self, item: StagedPush, now: float) -> list:
        """Poll the chunk WRITEs, gather and post the next chunks while slots are free, finish or fail."""
        st, peer, slots = item.plan, self._peers.get(item.dest), self._peer_slots.get(item.dest)
        for entry in list(st.inflight):
            handle, local, remote, pool = entry
            state = self._settle(handle, now, item.deadline)
            if state is None:
                continue  # in flight (or past its deadline but not cancellable yet)
            st.inflight.remove(entry)
            self.staging.give(local)
            if state is Settled.DONE:
                st.done_chunks += 1
                pool.landed(remote, now, self.cfg.write_timeout_s + self.cfg.fence_grace_s)
            else:  # never landed: the consumer will not free this slot, so it comes back here
                pool.give(remote)
                st.failed = st.failed or ("chunk WRITE ended in ERR" if state is Settled.ERR else "chunk WRITE timed out")
        if now >= item.deadline:
            st.failed = st.failed or "staged transfer timed out"
        if peer is None or slots is None:
            st.failed = st.failed or "consumer rank gone"
        while not st.failed and st.next_chunk < st.chunks:
            local = self.staging.take()
            remote = slots.take() if local is not None else None
            if remote is None:  # back-pressure: wait for our WRITEs or the consumer's SlotFree
                if local is not None:
                    self.staging.give(local)
                break
            first, count = st.span(st.next_chunk)
            nbytes = count * st.nbytes_per_block
            try:
                self.backend.gather(st.src_blocks[first:first + count], self.staging.slot_addr(local))
                notif = self.codec.encode(ChunkWritten(
                    transfer_id=item.key.transfer_id, attempt=item.key.attempt, producer_engine=self.cfg.engine_id,
                    producer_rank=self.cfg.rank, chunk=st.next_chunk, chunks=st.chunks, slot=remote, first=first,
                    count=count, use=slots.use_of(remote)))
                handle = self.transport.post(
                    "WRITE", peer.agent, np.array([[self.staging.slot_addr(local), nbytes, self.staging.device_id]], np.uint64),
                    np.array([[slots.slot_addr(remote), nbytes, slots.device_id]], np.uint64),
                    self.layout.mem_type, peer.layout.mem_type, notif)
            except Exception as e:  # gather or post failed: nothing of this chunk was sent
                self.staging.give(local)
                slots.give(remote)
                st.failed = f"chunk {st.next_chunk} not posted: {e}"
                break
            st.inflight.append((handle, local, remote, slots))
            st.next_chunk += 1
        if st.inflight:
            return []
        if st.failed:
            self._inflight.remove(item)
            self.event("write_failed", item.key, state="staged")
            return self._fail_write(item.start, "write_timeout" if "timed out" in st.failed else "write_error",
                                    st.failed, now)
        if st.done_chunks == st.chunks:
            self._inflight.remove(item)
            self.event("write_done", item.key, state="DONE", staged=True)
            self.stats.writes_done.inc()
            self.stats.bytes_written.inc(item.nbytes)
            self.stats.xfer_seconds.observe(now - item.posted_at)
            return self.rendezvous.on_write_result(item.key, item.dest, True, now)
        return []
