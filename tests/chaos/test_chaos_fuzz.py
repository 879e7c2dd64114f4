"""Fuzzing every decoder that reads from a socket (wire frames, the handshake, the router's inputs)
and the producer's registration handling, with hypothesis.  CI runs a small budget; the long run
(`scripts/chaos/chaos.sh`) uses atheris (tests/chaos/fuzz_atheris.py) for >= 100k inputs per target, or
these tests with KVPUSH_FUZZ_EXAMPLES when atheris is missing.

Also: forged, oversized, out-of-range, foreign, version- and mode-mismatched inputs are refused
before any descriptor is built, each with a clear error.
"""

from __future__ import annotations

import os
import resource

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuzz_targets as ft
from kvpush_common.protocol.wire import (MAX_BLOCK_IDS, PROTOCOL_VERSION, BadSignature, Codec, Heartbeat, KeyRef, MalformedMessage,
                                MessageTooLarge, Register, UnsupportedVersion, WriteDone)

EXAMPLES = int(os.environ.get("KVPUSH_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


def _valid_frames() -> list[bytes]:
    reg = Register(transfer_id="t", attempt=0, consumer_engine="D", consumer_rank=0, consumer_tp=1,
                   block_ids=[0, 1], first_token=0, num_tokens=8, ttl_ms=1000)
    hb = Heartbeat(consumer_engine="D", consumer_rank=0, keys=[KeyRef("t", 0)])
    done = WriteDone(transfer_id="t", attempt=0, producer_engine="P", producer_rank=0, nbytes=8, num_descs=1)
    return [c.encode(m) for m in (reg, hb, done) for c in (ft.NOTIF, ft.SIGNED)]


VALID = _valid_frames()


@st.composite
def mutated(draw):
    """A valid frame with bytes flipped, cut, inserted or spliced."""
    data = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.integers(0, 3))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if op == 0 and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == 1:
            data = data[:i]
        elif op == 2:
            data[i:i] = draw(st.binary(max_size=16))
        else:
            data += draw(st.sampled_from(VALID))[i:]
    return bytes(data)


inputs = st.one_of(st.binary(max_size=512), mutated())


@FUZZ
@given(inputs)
def test_fuzz_wire_frames(data):
    ft.wire(data)


@FUZZ
@given(inputs)
def test_fuzz_handshake(data):
    ft.handshake(data)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=12)


@FUZZ
@given(st.one_of(st.binary(max_size=256),
                 st.dictionaries(st.sampled_from(["stream", "model", "prompt", "kv_transfer_params", "x"]), json_values)
                 .map(msgspec.json.encode),
                 st.fixed_dictionaries({"kv_transfer_params": st.dictionaries(
                     st.sampled_from(["kvpush", "transfer_id", "attempt", "producer"]), json_values)})
                 .map(msgspec.json.encode)))
def test_fuzz_router_inputs(data):
    ft.router(data)


@st.composite
def register_bodies(draw):
    """Register messages with hostile field values, as msgpack: block ids out of range or negative,
    oversized lists, foreign engines and ranks, token counts that do not match."""
    big = draw(st.booleans()) and draw(st.integers(0, 3)) == 0
    ids = draw(st.lists(st.integers(-3, 40), max_size=12)) if not big else list(range(MAX_BLOCK_IDS + 1))
    body = {"t": "reg", "transfer_id": "t", "attempt": draw(st.integers(-1, 2)),
            "consumer_engine": draw(st.sampled_from(["D", "X", ""])), "consumer_rank": draw(st.integers(-1, 2)),
            "consumer_tp": draw(st.integers(0, 2)), "block_ids": ids,
            "first_token": draw(st.integers(-1, 40)), "num_tokens": draw(st.integers(-1, 40)),
            "ttl_ms": draw(st.integers(0, 5000))}
    return msgspec.msgpack.encode(body)


@FUZZ
@given(st.one_of(inputs, register_bodies()))
def test_fuzz_registrations_never_build_an_out_of_range_descriptor(data):
    ft.registrations(data)


def test_fuzzing_keeps_memory_bounded():
    """Thousands of inputs through every target leave the resident set where it was (within noise)."""
    import random

    rng = random.Random(0)
    for name, fn in ft.TARGETS.items():
        fn(b"warm")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for i in range(2000):
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300))) if i % 2 else rng.choice(VALID)
        for name, fn in ft.TARGETS.items():
            if name != "registrations" or i % 10 == 0:
                fn(data)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 * 1024, f"max RSS grew by {grown_kib} KiB"


# ---- targeted refusals, each with its error ---------------------------------------------------------------

def test_forged_message_is_refused():
    frame = bytearray(VALID[1])  # signed registration
    frame[-40] ^= 1
    with pytest.raises(BadSignature, match="MAC"):
        ft.SIGNED.decode(bytes(frame))
    with pytest.raises(BadSignature, match="secret"):
        ft.SIGNED.decode(VALID[0])  # unsigned frame where a secret is configured


def test_version_mismatch_and_oversized_lists_are_refused():
    frame = bytearray(VALID[0])
    frame[3] = PROTOCOL_VERSION + 1
    with pytest.raises(UnsupportedVersion, match=f"v{PROTOCOL_VERSION + 1}"):
        ft.NOTIF.decode(bytes(frame))
    body = msgspec.msgpack.encode({"t": "reg", "transfer_id": "t", "attempt": 0, "consumer_engine": "D",
                                   "consumer_rank": 0, "consumer_tp": 1, "block_ids": list(range(MAX_BLOCK_IDS + 1)),
                                   "first_token": 0, "num_tokens": 1, "ttl_ms": 1})
    with pytest.raises((MalformedMessage, MessageTooLarge)):
        ft.NOTIF.decode(b"KVP" + bytes([PROTOCOL_VERSION, 0]) + body)


def test_mode_and_version_mismatch_at_handshake_are_refused_with_reasons():
    from kvpush_common.endpoint.consumer import ConsumerEndpoint
    from kvpush_common.endpoint.config import EndpointConfig
    from kvpush_common.device.host import HostBackend
    from kvpush_common.protocol.wire import HelloReject

    ft.handshake(b"")  # builds the server
    backend = HostBackend(num_layers=2, num_heads=2, head_dim=4, block_size=4, num_blocks=8)
    pull = ConsumerEndpoint(EndpointConfig(engine_id="D", total_kv_heads=2, mode="pull", secret=ft.SECRET), backend)
    reply = ft._SERVER._answer(ft.HANDSHAKE.encode(pull.local_hello()))
    assert isinstance(reply, HelloReject) and "mode mismatch" in reply.reason
    push = ConsumerEndpoint(EndpointConfig(engine_id="D", total_kv_heads=2, model="other", secret=ft.SECRET), backend)
    reply = ft._SERVER._answer(ft.HANDSHAKE.encode(push.local_hello()))
    assert isinstance(reply, HelloReject) and "compatibility hash" in reply.reason
    frame = bytearray(ft.HANDSHAKE.encode(push.local_hello()))
    frame[3] = 9
    reply = ft._SERVER._answer(bytes(frame))
    assert isinstance(reply, HelloReject) and "protocol v9" in reply.reason
    forged = Codec(b"not-the-secret", max_bytes=ft.MAX_HANDSHAKE_BYTES).encode(push.local_hello())
    reply = ft._SERVER._answer(forged)
    assert isinstance(reply, HelloReject) and "MAC" in reply.reason


def test_out_of_range_and_foreign_block_ids_are_refused_before_any_descriptor():
    def run(ids, engine="D"):
        p = ft._producer()
        d = ft.HostBackend(num_layers=2, num_heads=2, head_dim=4, block_size=4, num_blocks=8)
        p._peers[("D", 0)] = ft.Peer("D", 0, 1, "D/r0", d.layout())
        t = ft.RecordingTransport()
        p.transport = t
        reg = Register(transfer_id="t", attempt=0, consumer_engine=engine, consumer_rank=0, consumer_tp=1,
                       block_ids=ids, first_token=0, num_tokens=8, ttl_ms=5000)
        t.notifs = {"D/r0": [ft.SIGNED.encode(reg)]}
        p.kv_ready("t", 0, [0, 1], 8)
        p._step()
        p._step()
        return t, p

    t, p = run([7, 8])  # 8 is past the consumer's 8 blocks
    assert t.posts == [] and any(b"bad_registration" in m for m in t.sent)
    t, p = run([0, 1], engine="X")  # claims another engine than the handshaken agent's
    assert t.posts == [] and p.stats.rejected_msgs.labels(reason="unknown_sender")._value.get() == 1
    t, p = run([2, 3])
    assert len(t.posts) == 1  # the control: a good registration posts
