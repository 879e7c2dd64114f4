"""Consumer, staged push: lend each producer rank a partition of our staging pool, and scatter the chunks it
WRITEs there into the request's blocks.

A producer rank that stages (`producer_staged.py`) gathers the blocks into chunks, WRITEs each into a slot of the
partition we lent it in our Hello, and tells us with a ChunkWritten; we scatter the chunk, then give the slot back
(SlotFree).  The rank is done once every chunk index of the key has been scattered.  Its own module so the core
(`consumer.py`) reads as the whole-push path.  Mixed into `ConsumerEndpoint`: its code runs on the consumer's
worker thread, except `_lend_partition`, which the handshake pool threads call (under `_partition_lock`).
"""

from __future__ import annotations

import logging

import numpy as np

from kvpush_common.endpoint.base import Peer
from kvpush_common.plan.staging import unit_bytes
from kvpush_common.protocol.identity import TransferKey
from kvpush_common.protocol.wire import ChunkWritten, SlotFree, Staging

log = logging.getLogger("kvpush_common.endpoint.consumer")

MAX_CHUNKS_REMEMBERED = 1 << 16  # chunk notifications remembered to drop repeats (a few MB at most)


class StagedChunks:
    def _lend_partition(self, prod: tuple[str, int]) -> Staging | None:
        """Pool thread: the part of our staging pool this producer rank may WRITE chunks into."""
        if self.staging is None:
            return None
        per_part = self._slots_per_partition()
        with self._partition_lock:
            idx = self._partitions.get(prod)
            if idx is None:
                if len(self._partitions) >= self.cfg.staging_partitions or per_part == 0:
                    return None  # direct transfers only for this producer rank
                idx = self._partitions[prod] = len(self._partitions)
        part = per_part * self.staging.chunk_bytes
        return Staging(self.staging.addr + idx * part, part, self.staging.device_id, self.staging.chunk_bytes)

    def _slots_per_partition(self) -> int:
        """Staging slots (chunks) lent to each producer rank: the pool split evenly, remainder unused."""
        return self.staging.size // self.cfg.staging_partitions if self.staging is not None else 0

    def _on_chunk(self, peer: Peer, key: TransferKey, prod, msg: ChunkWritten, now: float) -> list:
        """A chunk landed in a slot we lent: scatter it if the key still wants it, then free the slot."""
        part = self._partitions.get(prod)
        unit = len(self.layout.regions) * unit_bytes(self.layout)
        slots = self._slots_per_partition()
        if (part is None or msg.slot >= slots or msg.count * unit > self.staging.chunk_bytes
                or not 0 <= msg.chunk < msg.chunks):
            self.stats.rejected_msgs.labels(reason="bad_chunk").inc()
            log.warning("dropped ChunkWritten from %s: chunk %d/%d, slot %d, %d blocks outside what we lent",
                        peer.agent, msg.chunk, msg.chunks, msg.slot, msg.count)
            return []
        seen = (key, prod, msg.chunk)
        if seen in self._chunks_seen:
            self.stats.rejected_msgs.labels(reason="duplicate_chunk").inc()
            log.warning("dropped a repeated ChunkWritten %s chunk %d from %s", key, msg.chunk, peer.agent)
            return []
        self._chunks_seen[seen] = None
        while len(self._chunks_seen) > MAX_CHUNKS_REMEMBERED:
            self._chunks_seen.popitem(last=False)
        out: list = []
        e = self._expects.get(key)
        if e is not None and self.completion.wants_registration(key):
            if msg.first + msg.count > len(e.block_ids):
                out = self.completion.on_failed(key, prod, "staged chunk beyond the registered blocks", now)
            else:
                addr = self.staging.addr + (part * slots + msg.slot) * self.staging.chunk_bytes
                try:
                    self.backend.scatter(np.asarray(e.block_ids[msg.first:msg.first + msg.count]), addr)
                except Exception as err:  # the blocks may be half written: the key fails, nothing is usable
                    out = self.completion.on_failed(key, prod, f"scatter failed: {err}", now)
                else:
                    done = self._chunks.setdefault((key, prod), set())
                    done.add(msg.chunk)
                    if len(done) == msg.chunks:  # every chunk index of this producer rank scattered
                        del self._chunks[(key, prod)]
                        out = self.completion.on_done(key, prod, now)
        self._send(peer, SlotFree(consumer_engine=self.cfg.engine_id, consumer_rank=self.cfg.rank, slot=msg.slot,
                                  use=msg.use))
        return out

    def _forget_chunks(self, key: TransferKey) -> None:
        """The key ended: drop its count of scattered chunks (its repeats stay remembered in `_chunks_seen`)."""
        for k in [k for k in self._chunks if k[0] == key]:
            del self._chunks[k]
