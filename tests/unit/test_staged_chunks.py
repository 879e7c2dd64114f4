"""The consumer acts on each staged chunk once: a repeated ChunkWritten is never scattered or freed again
(its slot may hold another chunk by then) and cannot count a producer rank done early."""

import numpy as np

from kvpush_common.device.host import HostBackend
from kvpush_common.endpoint.base import Peer
from kvpush_common.endpoint.config import EndpointConfig
from kvpush_common.endpoint.consumer import ConsumerEndpoint
from kvpush_common.endpoint.inbox import Expect
from kvpush_common.plan.staging import SlotPool, unit_bytes
from kvpush_common.protocol.identity import TransferKey
from kvpush_common.protocol.legs import ProducerIdentity
from kvpush_common.protocol.wire import ChunkWritten
from kvpush_common.state.completion import Received

PROD = ("P", 0)
KEY = TransferKey("t", 0)


class SentNotifs:
    def __init__(self):
        self.sent = []

    def send_notif(self, agent, payload):
        self.sent.append((agent, payload))


def consumer():
    backend = HostBackend(num_layers=2, num_heads=1, head_dim=8, block_size=2, num_blocks=8)
    ep = ConsumerEndpoint(EndpointConfig(engine_id="D", staging_bytes=1, staging_partitions=1), backend)
    chunk = 2 * len(backend.layout().regions) * unit_bytes(backend.layout())  # two blocks per chunk
    addr, _ = backend.staging_buffer(4 * chunk)
    ep.staging = SlotPool(addr, 4 * chunk, chunk)  # not started: no NIXL, the pool is set by hand
    ep.transport = SentNotifs()
    ep._partitions[PROD] = 0
    peer = ep._peers[PROD] = Peer("P", 0, 1, "P/r0", backend.layout())
    ep._on_expect(Expect(KEY, ProducerIdentity(engine_id="P", host="127.0.0.1", port=1, tp_size=1), (5, 6, 7, 1),
                         8, 0), 0.0)
    assert [m for _, m in ep.transport.sent if b"reg" in m]  # registered with the handshaken producer rank
    ep.transport.sent.clear()
    return ep, peer, backend


def chunk(i, slot, first):
    return ChunkWritten(transfer_id="t", attempt=0, producer_engine="P", producer_rank=0, chunk=i, chunks=2,
                        slot=slot, first=first, count=2)


def test_a_repeated_chunk_neither_completes_the_rank_nor_scatters_nor_frees_again():
    ep, peer, backend = consumer()
    slot0 = backend.staging[: ep.staging.chunk_bytes]
    slot0[:] = 7
    assert ep._on_chunk(peer, KEY, PROD, chunk(0, 0, 0), 1.0) == []
    assert len(ep.transport.sent) == 1  # SlotFree for slot 0
    before = backend.buffer.copy()
    slot0[:] = 9  # the producer reused slot 0 for another chunk
    assert ep._on_chunk(peer, KEY, PROD, chunk(0, 0, 0), 1.1) == []  # the same notification again
    assert np.array_equal(backend.buffer, before), "a repeated chunk was scattered again"
    assert len(ep.transport.sent) == 1, "a repeated chunk freed its slot twice"
    assert ep.stats.rejected_msgs.labels(reason="duplicate_chunk")._value.get() == 1
    out = ep._on_chunk(peer, KEY, PROD, chunk(1, 1, 2), 1.2)  # the last distinct chunk completes the rank
    assert [type(a) for a in out] == [Received] and out[0].ok


def test_chunk_indices_outside_the_count_are_dropped():
    ep, peer, _ = consumer()
    bad = ChunkWritten(transfer_id="t", attempt=0, producer_engine="P", producer_rank=0, chunk=2, chunks=2, slot=0,
                       first=0, count=2)
    assert ep._on_chunk(peer, KEY, PROD, bad, 1.0) == [] and ep.transport.sent == []
    assert ep.stats.rejected_msgs.labels(reason="bad_chunk")._value.get() == 1


def test_slot_free_echoes_the_use_of_the_chunk():
    from kvpush_common.protocol.wire import Codec, SlotFree

    ep, peer, _ = consumer()
    msg = ChunkWritten(transfer_id="t", attempt=0, producer_engine="P", producer_rank=0, chunk=0, chunks=2,
                       slot=1, first=0, count=2, use=41)
    ep._on_chunk(peer, KEY, PROD, msg, 1.0)
    [(_, raw)] = ep.transport.sent
    freed = Codec().decode(raw)
    assert isinstance(freed, SlotFree) and (freed.slot, freed.use) == (1, 41)


def test_lent_slots_refuse_a_late_free_of_an_earlier_use_and_take_back_lost_ones():
    """Issue 16 item 2: a lost SlotFree no longer leaks the slot; a late one never frees a slot in use."""
    import pytest

    from kvpush_common.plan.staging import LentSlots

    pool = LentSlots(1 << 20, 2 * 4096, 4096)
    a = pool.take()
    first_use = pool.use_of(a)
    pool.landed(a, now=10.0, hold_s=5.0)
    assert pool.reclaim(14.9) == 0 and a not in pool.free
    assert pool.reclaim(15.0) == 1 and a in pool.free  # its SlotFree was lost: taken back
    b = pool.take()
    assert b == a and pool.use_of(b) != first_use  # reused for another chunk
    with pytest.raises(ValueError, match="in use"):
        pool.give(a, first_use)  # the lost SlotFree arrives after all: refused, the slot stays taken
    assert a not in pool.free
    pool.give(b, pool.use_of(b))  # the right SlotFree frees it, and cancels its take-back
    assert a in pool.free and pool.reclaim(100.0) == 0
    c = pool.take()
    pool.give(c)  # our own failed WRITE gives it back without a use
    assert sorted(pool.free) == [0, 1]
