"""An endpoint drops (and counts) malformed, forged and misdirected notifications before acting."""

import pytest

from kvpush_common.endpoint.config import EndpointConfig
from kvpush_common.endpoint.consumer import ConsumerEndpoint
from kvpush_common.endpoint.base import Peer
from kvpush_common.device.host import HostBackend
from kvpush_common.protocol.wire import Codec, Register, WriteDone


@pytest.fixture
def consumer():
    backend = HostBackend(num_layers=1, num_heads=1, head_dim=4, block_size=4, num_blocks=4)
    ep = ConsumerEndpoint(EndpointConfig(engine_id="D", secret=b"k"), backend)  # not started: no NIXL needed
    ep._peers[("P", 0)] = Peer("P", 0, 1, "P/r0", backend.layout())
    return ep


def done(engine="P", rank=0):
    return WriteDone(transfer_id="t", attempt=0, producer_engine=engine, producer_rank=rank, nbytes=1, num_descs=1)


def rejected(ep, reason):
    return ep.stats.rejected_msgs.labels(reason=reason)._value.get()


def test_genuine_message_is_accepted(consumer):
    got = consumer._receive({"P/r0": [Codec(b"k").encode(done())]})
    assert [type(m).__name__ for _, m in got] == ["WriteDone"]


def test_malformed_and_badly_signed_frames_are_dropped(consumer):
    frames = [b"garbage", Codec(b"wrong").encode(done()), Codec().encode(done())]
    assert consumer._receive({"P/r0": frames}) == []
    assert rejected(consumer, "MalformedMessage") == 1 and rejected(consumer, "BadSignature") == 2


def test_sender_must_be_the_handshaken_agent_of_the_claimed_rank(consumer):
    good = Codec(b"k").encode(done())
    assert consumer._receive({"intruder/r0": [good]}) == []  # right claim, wrong delivering agent
    assert consumer._receive({"P/r0": [Codec(b"k").encode(done(rank=1))]}) == []  # unknown rank claimed
    assert rejected(consumer, "unknown_sender") == 2


def test_message_types_the_role_does_not_take_are_dropped(consumer):
    reg = Register(transfer_id="t", attempt=0, consumer_engine="P", consumer_rank=0, consumer_tp=1,
                   block_ids=[0], first_token=0, num_tokens=1, ttl_ms=10)
    assert consumer._receive({"P/r0": [Codec(b"k").encode(reg)]}) == []
    assert rejected(consumer, "unknown_sender") == 1


def test_a_replayed_signed_frame_is_dropped_and_counted(consumer):
    frame = Codec(b"k").encode(done())
    assert [type(m).__name__ for _, m in consumer._receive({"P/r0": [frame]})] == ["WriteDone"]
    assert consumer._receive({"P/r0": [frame]}) == []  # captured and sent again
    assert rejected(consumer, "ReplayedMessage") == 1
