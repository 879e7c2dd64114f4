"""The engine thread hands block ids over as they are (`tuple()` only, no per-id work in the step: 256 ids
cost ~50 us of a decode step on the H200 host); the worker converts them, and an id that is not an integer
ends that request with a clear result instead of raising in the engine."""

import numpy as np
import pytest

from kvpush_common.device.host import HostBackend
from kvpush_common.endpoint.base import Peer
from kvpush_common.endpoint.config import EndpointConfig
from kvpush_common.endpoint.consumer import ConsumerEndpoint
from kvpush_common.endpoint.inbox import block_ids_as_ints
from kvpush_common.endpoint.producer import ProducerEndpoint
from kvpush_common.protocol.identity import TransferKey
from kvpush_common.protocol.legs import ProducerIdentity
from kvpush_common.protocol.wire import Codec, Register

from test_worker_steps import Flaky


def backend():
    return HostBackend(num_layers=2, num_heads=1, head_dim=4, block_size=4, num_blocks=8)


def test_ids_are_converted_to_ints_and_non_integers_are_refused():
    assert block_ids_as_ints(np.array([3, 1], dtype=np.int32)) == (3, 1)
    assert type(block_ids_as_ints((np.int64(2),))[0]) is int
    for bad in ((1.5,), (2.0,), ("x",), (None,)):  # a float is refused even when whole
        with pytest.raises((TypeError, ValueError)):
            block_ids_as_ints(bad)


def test_the_engine_thread_hands_the_ids_over_without_converting_them():
    ids = tuple(range(256))
    ep = ConsumerEndpoint(EndpointConfig(engine_id="D"), backend())
    ref = ProducerIdentity(engine_id="P", host="127.0.0.1", port=1, tp_size=1)
    ep.expect("a", 0, ref, ids, 1024)
    assert ep._inbox.get_nowait().block_ids is ids  # the same tuple: no per-id work on the engine thread
    p = ProducerEndpoint(EndpointConfig(engine_id="P"), backend())
    p.kv_ready("a", 0, ids, 1024, written=True)
    assert p._inbox.get_nowait().ready.block_ids is ids


def test_a_consumer_request_with_bad_ids_fails_and_the_registration_carries_ints():
    ep = ConsumerEndpoint(EndpointConfig(engine_id="D", handshake_timeout_s=0.2), backend())
    ep.transport = t = Flaky()
    ep._peers[("P", 0)] = Peer("P", 0, 1, "P/r0", ep.layout)
    ref = ProducerIdentity(engine_id="P", host="127.0.0.1", port=1, tp_size=1)
    ep.expect("bad", 0, ref, [0, 1.5], 8)
    ep.expect("ok", 0, ref, np.array([2, 3]), 8)
    ep._step()
    (done,) = ep.take_finished()
    assert done.key == TransferKey("bad", 0) and not done.ok and "bad block ids" in done.reason
    (reg,) = [m for m in map(Codec().decode, t.sent) if isinstance(m, Register)]
    assert reg.block_ids == [2, 3]
    ep.close()


def test_a_producer_ready_with_bad_ids_releases_it_as_failed():
    p = ProducerEndpoint(EndpointConfig(engine_id="P"), backend())
    p.transport = t = Flaky()
    p._peers[("D", 0)] = Peer("D", 0, 1, "D/r0", backend().layout())
    reg = Register(transfer_id="bad", attempt=0, consumer_engine="D", consumer_rank=0, consumer_tp=1,
                   block_ids=[0, 1], first_token=0, num_tokens=8, ttl_ms=5000)
    t.get_notifs = lambda: {"D/r0": [Codec().encode(reg)]}  # the registration came first: it waits
    p._step()
    t.get_notifs = lambda: {}
    p.kv_ready("bad", 0, [1, "x"], 8, written=True)
    p._step()
    assert [(r.key.transfer_id, r.outcome.value) for r in p.take_finished()] == [("bad", "failed")]
    (failed,) = [m for m in map(Codec().decode, t.sent) if type(m).__name__ == "WriteFailed"]
    assert "bad block ids" in failed.reason  # the waiting consumer rank hears it at once
    p.close()
