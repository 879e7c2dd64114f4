"""Wire codec: round trips within the declared bounds, and every way a frame can be refused.

Decoding must never raise anything but a `WireError` (the transport turns those into a dropped message
or a rejected handshake); anything else would take the receiving thread down.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import subprocess
import sys
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpush_common.protocol.layout import KVLayout, Region
from kvpush_common.protocol.wire import (
    FLAG_SIGNED,
    FRESHNESS,
    HEADER_LEN,
    MAC_LEN,
    MAGIC,
    MAX_BLOCK_IDS,
    MAX_HEARTBEAT_KEYS,
    MAX_NOTIF_BYTES,
    PROTOCOL_VERSION,
    BadSignature,
    Codec,
    Heartbeat,
    Hello,
    HelloReject,
    KeyRef,
    MalformedMessage,
    MessageTooLarge,
    Register,
    ReplayedMessage,
    Revoke,
    RevokeAck,
    Unneeded,
    UnsupportedVersion,
    WireError,
    WriteDone,
    WriteFailed,
    compat_hash,
)

SECRET = b"s3cret-shared-between-engines"

# ---- strategies (within the declared bounds) -----------------------------------------------------
ids = st.from_regex(r"[A-Za-z0-9_.:\-/]{1,128}", fullmatch=True)
attempts = st.integers(0, 2**31 - 1)
ranks = st.integers(0, 4095)
tp_sizes = st.integers(1, 4096)
reasons = st.text(max_size=512)
tokens = st.integers(0, 2**31 - 1)
u63 = st.integers(0, 2**63 - 1)

regions = st.builds(
    Region,
    base=u63,
    block_stride=st.integers(1, 2**48 - 1),
    mem_id=st.integers(0, 2**20 - 1),
    device_id=st.integers(0, 2**16 - 1),
)
layouts = st.builds(
    KVLayout,
    num_layers=st.integers(1, 2**31),
    num_heads=st.integers(1, 4096),
    head_dim=st.integers(1, 65536),
    dtype_size=st.integers(1, 16),
    dtype=st.text(max_size=32),
    block_size=st.integers(1, 65536),
    num_blocks=st.integers(1, 2**31),
    order=st.sampled_from(["NHD", "HND"]),
    regions=st.lists(regions, max_size=8),
    mem_type=st.sampled_from(["DRAM", "VRAM"]),
    head_offset=st.integers(0, 1 << 20),
)

hellos = st.builds(
    Hello,
    engine_id=ids,
    role=st.sampled_from(["producer", "consumer"]),
    rank=ranks,
    tp_size=tp_sizes,
    mode=st.sampled_from(["push", "pull"]),
    compat_hash=st.text(min_size=64, max_size=64),
    total_kv_heads=st.integers(1, 1 << 20),
    agent_name=ids,
    agent_metadata=st.binary(max_size=512),
    layout=layouts,
)
rejects = st.builds(HelloReject, reason=reasons)
registers = st.builds(
    Register,
    transfer_id=ids,
    attempt=attempts,
    consumer_engine=ids,
    consumer_rank=ranks,
    consumer_tp=tp_sizes,
    block_ids=st.lists(st.integers(0, 2**31 - 1), max_size=64),
    first_token=tokens,
    num_tokens=tokens,
    ttl_ms=st.integers(1, 3_600_000),
)
revokes = st.builds(Revoke, transfer_id=ids, attempt=attempts, consumer_engine=ids, consumer_rank=ranks, reason=reasons)
unneededs = st.builds(Unneeded, transfer_id=ids, attempt=attempts, consumer_engine=ids, consumer_rank=ranks,
                      reason=reasons)
acks = st.builds(RevokeAck, transfer_id=ids, attempt=attempts, producer_engine=ids, producer_rank=ranks)
heartbeats = st.builds(
    Heartbeat,
    consumer_engine=ids,
    consumer_rank=ranks,
    keys=st.lists(st.builds(KeyRef, transfer_id=ids, attempt=attempts), max_size=16),
)
dones = st.builds(
    WriteDone,
    transfer_id=ids,
    attempt=attempts,
    producer_engine=ids,
    producer_rank=ranks,
    nbytes=u63,
    num_descs=st.integers(0, 2**40 - 1),
)
faileds = st.builds(
    WriteFailed,
    transfer_id=ids,
    attempt=attempts,
    producer_engine=ids,
    producer_rank=ranks,
    code=st.text(max_size=64),
    reason=reasons,
)
STRATEGIES = {
    "hello": hellos,
    "reject": rejects,
    "reg": registers,
    "revoke": revokes,
    "unneeded": unneededs,
    "revoke_ack": acks,
    "hb": heartbeats,
    "done": dones,
    "failed": faileds,
}
messages = st.one_of(*STRATEGIES.values())
codecs = st.one_of(st.just(Codec()), st.binary(min_size=1, max_size=64).map(Codec))


# ---- fixed examples --------------------------------------------------------------------------------
LAYOUT = KVLayout(
    num_layers=1, num_heads=2, head_dim=4, dtype_size=2, dtype="bfloat16", block_size=16, num_blocks=8,
    order="HND", regions=[Region(0x1000, 256), Region(0x2000, 256)],
)
EXAMPLES = [
    Hello(engine_id="prefill-0", role="producer", rank=1, tp_size=2, mode="push", compat_hash="a" * 64,
          total_kv_heads=8, agent_name="agent/0", agent_metadata=b"\x00\x01meta", layout=LAYOUT),
    HelloReject(reason="compat hash differs"),
    Register(transfer_id="req-1", attempt=3, consumer_engine="decode-0", consumer_rank=1, consumer_tp=2,
             block_ids=[5, 6, 7], first_token=0, num_tokens=40, ttl_ms=30_000),
    Revoke(transfer_id="req-1", attempt=3, consumer_engine="decode-0", consumer_rank=1, reason="timeout"),
    RevokeAck(transfer_id="req-1", attempt=3, producer_engine="prefill-0", producer_rank=0),
    Heartbeat(consumer_engine="decode-0", consumer_rank=0, keys=[KeyRef("req-1", 3), KeyRef("req-2", 0)]),
    WriteDone(transfer_id="req-1", attempt=3, producer_engine="prefill-0", producer_rank=0, nbytes=4096, num_descs=4),
    WriteFailed(transfer_id="req-1", attempt=3, producer_engine="prefill-0", producer_rank=0, code="expired",
                reason="registration expired"),
    Unneeded(transfer_id="req-2", attempt=0, consumer_engine="decode-0", consumer_rank=0,
             reason="300 prompt tokens cached here, 40 computed here"),
]
EXAMPLE_IDS = [type(m).__name__ for m in EXAMPLES]


def test_examples_cover_every_message_type():
    assert {type(m) for m in EXAMPLES} == {Hello, HelloReject, Register, Revoke, Unneeded, RevokeAck, Heartbeat,
                                           WriteDone, WriteFailed}
    assert set(STRATEGIES) == {type(m).__struct_config__.tag for m in EXAMPLES}



def test_staged_transfer_messages_are_refused_by_name():
    """Protocol v4 has no staged transfers: their messages (a v3 peer's are refused by version first) and a Hello
    offering a staging pool are malformed here, the error naming the tag or the field."""
    codec = Codec()
    chunk = {"t": "chunk", "transfer_id": "r1", "attempt": 0, "producer_engine": "P", "producer_rank": 0,
             "chunk": 0, "chunks": 1, "slot": 0, "first": 0, "count": 1}
    slot_free = {"t": "slot_free", "consumer_engine": "D", "consumer_rank": 0, "slot": 0}
    for body, tag in ((chunk, "chunk"), (slot_free, "slot_free")):
        with pytest.raises(MalformedMessage, match=f"Invalid value '{tag}'"):
            codec.decode(raw_frame(msgspec.msgpack.encode(body)))
    hello = body_of(next(m for m in EXAMPLES if isinstance(m, Hello)))
    codec.decode(raw_frame(msgspec.msgpack.encode(hello)))  # as sent today: accepted
    hello["staging"] = [0, 1 << 20, 0, 1 << 16]
    with pytest.raises(MalformedMessage, match="unknown field `staging`"):
        codec.decode(raw_frame(msgspec.msgpack.encode(hello)))

def raw_frame(body: bytes, *, secret: bytes | None = None, version: int = PROTOCOL_VERSION,
              flags: int | None = None) -> bytes:
    """Build a frame by hand (bypassing the encoder), signed when `secret` is given."""
    if flags is None:
        flags = FLAG_SIGNED if secret else 0
    frame = MAGIC + bytes([version, flags])
    if secret:
        frame += FRESHNESS.pack(os.urandom(8), 0, time.time()) + body
        frame += hmac.new(secret, frame, hashlib.sha256).digest()
    else:
        frame += body
    return frame


def body_of(msg) -> dict:
    """The message as the plain msgpack map the encoder would produce (to tamper with)."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(msg))


# ---- round trips -----------------------------------------------------------------------------------
@pytest.mark.parametrize("tag", sorted(STRATEGIES))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), codec=codecs)
def test_round_trip_every_type(tag, data, codec):
    msg = data.draw(STRATEGIES[tag])
    frame = codec.encode(msg)
    assert frame[:3] == MAGIC and frame[3] == PROTOCOL_VERSION
    assert frame[4] == (FLAG_SIGNED if codec.signed else 0)
    out = codec.decode(frame)
    assert type(out) is type(msg)
    assert out == msg
    # bytes-likes decode the same (fresh frames: a signed frame is accepted once)
    assert codec.decode(bytearray(codec.encode(msg))) == msg
    assert codec.decode(memoryview(codec.encode(msg))) == msg


def test_empty_secret_means_unsigned():
    assert not Codec(b"").signed and not Codec(None).signed and Codec(b"x").signed
    assert Codec(b"").decode(Codec().encode(EXAMPLES[2])) == EXAMPLES[2]


def test_extremes_round_trip():
    big = Register(transfer_id="x" * 128, attempt=2**31 - 1, consumer_engine="E" * 128, consumer_rank=4095,
                   consumer_tp=4096, block_ids=[2**31 - 1] * MAX_BLOCK_IDS, first_token=2**31 - 1,
                   num_tokens=2**31 - 1, ttl_ms=3_600_000)
    hb = Heartbeat(consumer_engine="e", consumer_rank=0, keys=[KeyRef(f"k{i}", i) for i in range(MAX_HEARTBEAT_KEYS)])
    for codec in (Codec(), Codec(SECRET)):
        assert codec.decode(codec.encode(big)) == big
        assert codec.decode(codec.encode(hb)) == hb


def test_default_fields():
    codec = Codec()
    body = body_of(EXAMPLES[3])
    del body["reason"]
    assert codec.decode(raw_frame(msgspec.msgpack.encode(body))) == Revoke(
        transfer_id="req-1", attempt=3, consumer_engine="decode-0", consumer_rank=1)


# ---- truncation, header, flags -----------------------------------------------------------------------
@pytest.mark.parametrize("msg", EXAMPLES, ids=EXAMPLE_IDS)
@pytest.mark.parametrize("secret", [None, SECRET], ids=["unsigned", "signed"])
def test_every_prefix_is_refused(msg, secret):
    codec = Codec(secret)
    frame = codec.encode(msg)
    for n in range(len(frame)):
        with pytest.raises((MalformedMessage, BadSignature)) as ei:
            codec.decode(frame[:n])
        if secret is None or n < HEADER_LEN:
            assert isinstance(ei.value, MalformedMessage), n


@settings(max_examples=40, deadline=None)
@given(msg=messages, codec=codecs)
def test_every_prefix_is_refused_generated(msg, codec):
    frame = codec.encode(msg)
    for n in range(len(frame)):
        with pytest.raises((MalformedMessage, BadSignature)):
            codec.decode(frame[:n])


@pytest.mark.parametrize("secret", [None, SECRET])
def test_trailing_bytes_are_refused(secret):
    codec = Codec(secret)
    body = msgspec.msgpack.encode(EXAMPLES[2])
    with pytest.raises(MalformedMessage):
        codec.decode(raw_frame(body + b"\xc0", secret=secret))


@pytest.mark.parametrize("magic", [b"KVQ", b"kvp", b"\x00\x00\x00", b"PVK"])
def test_wrong_magic(magic):
    frame = Codec().encode(EXAMPLES[2])
    with pytest.raises(MalformedMessage):
        Codec().decode(magic + frame[3:])


@pytest.mark.parametrize("version", [v for v in range(256) if v != PROTOCOL_VERSION])
def test_unknown_version(version):
    for secret in (None, SECRET):
        frame = raw_frame(msgspec.msgpack.encode(EXAMPLES[2]), secret=secret, version=version)
        with pytest.raises(UnsupportedVersion, match=f"v{version}"):
            Codec(secret).decode(frame)


@pytest.mark.parametrize("flags", [f for f in range(256) if f & ~FLAG_SIGNED])
def test_unknown_flags(flags):
    for secret in (None, SECRET):
        frame = raw_frame(msgspec.msgpack.encode(EXAMPLES[2]), secret=secret, flags=flags)
        with pytest.raises(MalformedMessage, match="flags"):
            Codec(secret).decode(frame)


def test_not_bytes():
    for bad in ("KVP\x01\x00", None, 12, [1, 2]):
        with pytest.raises(MalformedMessage):
            Codec().decode(bad)


# ---- size limits -------------------------------------------------------------------------------------
@pytest.mark.parametrize("secret", [None, SECRET])
def test_oversized_encode_and_decode(secret):
    codec = Codec(secret)
    hello = msgspec.structs.replace(EXAMPLES[0], agent_metadata=b"\x00" * MAX_NOTIF_BYTES)
    with pytest.raises(MessageTooLarge):
        codec.encode(hello)
    big = Codec(secret, max_bytes=2 * MAX_NOTIF_BYTES).encode(hello)
    assert len(big) > MAX_NOTIF_BYTES
    with pytest.raises(MessageTooLarge):
        codec.decode(big)
    # the size check comes first: even garbage of that size is "too large", not "malformed"
    with pytest.raises(MessageTooLarge):
        codec.decode(b"\x00" * (MAX_NOTIF_BYTES + 1))


@pytest.mark.parametrize("secret", [None, SECRET])
def test_limit_is_inclusive_and_counts_the_mac(secret):
    frame = Codec(secret).encode(EXAMPLES[2])
    exact = Codec(secret, max_bytes=len(frame))
    assert exact.decode(frame) == EXAMPLES[2]
    assert len(exact.encode(EXAMPLES[2])) == len(frame)
    small = Codec(secret, max_bytes=len(frame) - 1)
    with pytest.raises(MessageTooLarge):
        small.encode(EXAMPLES[2])
    with pytest.raises(MessageTooLarge):
        small.decode(frame)


# ---- signatures --------------------------------------------------------------------------------------
@pytest.mark.parametrize("msg", EXAMPLES, ids=EXAMPLE_IDS)
def test_every_bit_flip_in_a_signed_frame_is_refused(msg):
    codec = Codec(SECRET)
    frame = codec.encode(msg)
    for i in range(len(frame)):
        for bit in range(8):
            bad = bytearray(frame)
            bad[i] ^= 1 << bit
            try:
                out = codec.decode(bytes(bad))
            except (BadSignature, MalformedMessage):
                continue
            except UnsupportedVersion:
                assert i == 3, f"byte {i} bit {bit}"  # the version byte is checked before the MAC
                continue
            pytest.fail(f"flipping byte {i} bit {bit} decoded to {out!r}")


@settings(max_examples=80, deadline=None)
@given(msg=messages, secret=st.binary(min_size=1, max_size=64), data=st.data())
def test_tampered_signed_frames_never_decode(msg, secret, data):
    codec = Codec(secret)
    frame = bytearray(codec.encode(msg))
    i = data.draw(st.integers(HEADER_LEN, len(frame) - 1), label="byte")
    frame[i] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises((BadSignature, MalformedMessage)):
        codec.decode(bytes(frame))


@pytest.mark.parametrize("msg", EXAMPLES, ids=EXAMPLE_IDS)
def test_signature_mismatches(msg):
    signed, unsigned = Codec(SECRET), Codec()
    with pytest.raises(BadSignature):
        unsigned.decode(signed.encode(msg))
    with pytest.raises(BadSignature):
        signed.decode(unsigned.encode(msg))
    with pytest.raises(BadSignature):
        Codec(SECRET + b"!").decode(signed.encode(msg))
    # a valid MAC over a frame whose flag was cleared (stripping the signature) is refused
    frame = signed.encode(msg)
    stripped = frame[:4] + b"\x00" + frame[5:-MAC_LEN]
    with pytest.raises(BadSignature):
        signed.decode(stripped)
    # a MAC with the signed flag but the wrong key, or the MAC moved off the end
    with pytest.raises(BadSignature):
        signed.decode(frame[:-MAC_LEN] + bytes(MAC_LEN))
    with pytest.raises((BadSignature, MalformedMessage)):
        signed.decode(frame + b"\x00")


def test_signed_frame_too_short_for_mac():
    for n in range(FRESHNESS.size + MAC_LEN):
        with pytest.raises(MalformedMessage, match="MAC"):
            Codec(SECRET).decode(MAGIC + bytes([PROTOCOL_VERSION, FLAG_SIGNED]) + b"\x00" * n)


# ---- replays (issue 16 item 7) -----------------------------------------------------------------------
@pytest.mark.parametrize("msg", EXAMPLES, ids=EXAMPLE_IDS)
def test_a_signed_frame_is_accepted_once_per_receiver(msg):
    sender, receiver, other = Codec(SECRET), Codec(SECRET), Codec(SECRET)
    frame = sender.encode(msg)
    assert receiver.decode(frame) == msg
    with pytest.raises(ReplayedMessage, match="replayed frame"):
        receiver.decode(frame)
    assert other.decode(frame) == msg  # each receiver keeps its own window
    assert receiver.decode(sender.encode(msg)) == msg  # the same message sent again is a new frame


def test_reordered_frames_are_accepted_and_old_ones_refused():
    now = [1000.0]
    sender, receiver = Codec(SECRET, clock=lambda: now[0]), Codec(SECRET, clock=lambda: now[0])
    frames = [sender.encode(REG) for _ in range(5)]
    for f in reversed(frames):  # delivered in reverse order: all fresh
        assert receiver.decode(f) == REG
    late = sender.encode(REG)
    now[0] += 601  # past the 600 s horizon
    with pytest.raises(ReplayedMessage, match="horizon"):
        receiver.decode(late)
    ahead = Codec(SECRET, clock=lambda: now[0] + 601).encode(REG)
    with pytest.raises(ReplayedMessage, match="ahead"):
        receiver.decode(ahead)


def test_unsigned_frames_carry_no_freshness_and_are_not_windowed():
    codec = Codec()
    frame = codec.encode(REG)
    assert len(frame) == HEADER_LEN + len(msgspec.msgpack.encode(REG))
    assert codec.decode(frame) == codec.decode(frame) == REG  # without a secret anyone can mint frames anyway


# ---- out-of-bound fields -----------------------------------------------------------------------------
REG = EXAMPLES[2]
BAD_FIELDS = [
    (REG, "block_ids", [1, -1]),
    (REG, "block_ids", [2**31]),
    (REG, "block_ids", [0] * (MAX_BLOCK_IDS + 1)),
    (REG, "block_ids", [1.0]),
    (REG, "block_ids", [True]),
    (REG, "block_ids", "1,2"),
    (REG, "transfer_id", "x" * 129),
    (REG, "transfer_id", ""),
    (REG, "transfer_id", "req 1"),
    (REG, "transfer_id", "req-1\n"),  # "$" in the pattern used to let a trailing newline through
    (REG, "transfer_id", "\nreq-1"),
    (REG, "transfer_id", "req\x00"),
    (REG, "transfer_id", "réq"),
    (REG, "transfer_id", "req#1"),
    (REG, "transfer_id", 5),
    (REG, "consumer_engine", "a,b"),
    (REG, "attempt", -1),
    (REG, "attempt", 2**31),
    (REG, "attempt", "1"),
    (REG, "consumer_rank", 4096),
    (REG, "consumer_rank", -1),
    (REG, "consumer_tp", 0),
    (REG, "consumer_tp", 4097),
    (REG, "first_token", -1),
    (REG, "num_tokens", 2**31),
    (REG, "ttl_ms", 0),
    (REG, "ttl_ms", 3_600_001),
    (REG, "ttl_ms", None),
    (EXAMPLES[0], "role", "router"),
    (EXAMPLES[0], "mode", "PUSH"),
    (EXAMPLES[0], "compat_hash", "a" * 63),
    (EXAMPLES[0], "compat_hash", "a" * 65),
    (EXAMPLES[0], "total_kv_heads", 0),
    (EXAMPLES[0], "tp_size", 0),
    (EXAMPLES[0], "agent_name", "a b"),
    (EXAMPLES[0], "agent_metadata", "text, not bytes"),
    (EXAMPLES[0], "layout", {"num_layers": 1}),
    (EXAMPLES[1], "reason", "x" * 513),
    (EXAMPLES[3], "reason", "x" * 513),
    (EXAMPLES[5], "keys", [["k", 0]] * (MAX_HEARTBEAT_KEYS + 1)),
    (EXAMPLES[5], "keys", [["k", -1]]),
    (EXAMPLES[5], "keys", [["k", 0, 1]]),
    (EXAMPLES[5], "keys", [["bad id", 0]]),
    (EXAMPLES[6], "nbytes", -1),
    (EXAMPLES[6], "nbytes", 2**63),
    (EXAMPLES[6], "num_descs", 2**40),
    (EXAMPLES[7], "code", "c" * 65),
    (EXAMPLES[7], "producer_rank", 4096),
    (EXAMPLES[8], "reason", "x" * 513),
    (EXAMPLES[8], "consumer_rank", -1),
]


@pytest.mark.parametrize("msg,field,value", BAD_FIELDS,
                         ids=[f"{type(m).__name__}.{f}-{i}" for i, (m, f, _) in enumerate(BAD_FIELDS)])
@pytest.mark.parametrize("secret", [None, SECRET], ids=["unsigned", "signed"])
def test_out_of_bound_fields_are_malformed(msg, field, value, secret):
    body = body_of(msg)
    body[field] = value
    codec = Codec(secret, max_bytes=16 << 20)
    with pytest.raises(MalformedMessage):
        codec.decode(raw_frame(msgspec.msgpack.encode(body), secret=secret))
    # the encoder does not validate; the receiver must
    struct = msgspec.structs.replace(msg, **{field: value}) if field != "keys" else None
    if struct is not None:
        try:
            frame = codec.encode(struct)
        except (TypeError, msgspec.EncodeError):
            return
        with pytest.raises(MalformedMessage):
            codec.decode(frame)


@pytest.mark.parametrize("msg", EXAMPLES, ids=EXAMPLE_IDS)
def test_unknown_and_missing_fields_are_malformed(msg):
    codec = Codec()
    body = body_of(msg)
    with pytest.raises(MalformedMessage):
        codec.decode(raw_frame(msgspec.msgpack.encode({**body, "extra": 1})))
    for info in msgspec.structs.fields(type(msg)):
        if not info.required:
            continue
        short = {k: v for k, v in body.items() if k != info.encode_name}
        with pytest.raises(MalformedMessage):
            codec.decode(raw_frame(msgspec.msgpack.encode(short)))


def test_nested_unknown_fields_and_tags_are_malformed():
    codec = Codec()
    hello = body_of(EXAMPLES[0])
    hello["layout"]["extra"] = 1
    with pytest.raises(MalformedMessage):
        codec.decode(raw_frame(msgspec.msgpack.encode(hello)))
    hello = body_of(EXAMPLES[0])
    hello["layout"]["regions"][0]["extra"] = 1
    with pytest.raises(MalformedMessage):
        codec.decode(raw_frame(msgspec.msgpack.encode(hello)))
    for tag in ("nope", "Register", "", 1, None):
        body = {**body_of(REG), "t": tag}
        with pytest.raises(MalformedMessage):
            codec.decode(raw_frame(msgspec.msgpack.encode(body)))
    body = body_of(REG)
    del body["t"]
    with pytest.raises(MalformedMessage):
        codec.decode(raw_frame(msgspec.msgpack.encode(body)))
    for not_a_map in ([1, 2], 1, "reg", None, b"reg"):
        with pytest.raises(MalformedMessage):
            codec.decode(raw_frame(msgspec.msgpack.encode(not_a_map)))


@pytest.mark.parametrize("secret", [None, SECRET])
def test_deep_nesting_is_malformed_not_a_crash(secret):
    """An unknown key whose value nests arrays deeply used to escape as RecursionError."""
    codec = Codec(secret)
    depth = 200_000
    for body in (
        b"\x81\xa1x" + b"\x91" * depth + b"\xc0",  # {"x": [[[...]]]}
        b"\x82\xa1x" + b"\x91" * depth + b"\xc0" + b"\xa1t\xa3reg",  # tag after the deep value
        b"\x82\xa1x" + b"\x81\xa1y" * depth + b"\xc0" + b"\xa1t\xa3reg",  # nested maps
        b"\x82\xa1t\xa5hello\xa6layout" + b"\x91" * depth + b"\xc0",
    ):
        with pytest.raises(MalformedMessage):
            codec.decode(raw_frame(body, secret=secret))


# ---- fuzz ------------------------------------------------------------------------------------------
def _decode_or_wire_error(codec: Codec, frame: bytes):
    try:
        return codec.decode(frame)
    except WireError:
        return None


@settings(max_examples=2000, deadline=None)
@given(frame=st.binary(max_size=256))
def test_fuzz_random_bytes(frame):
    for codec in (Codec(), Codec(SECRET)):
        _decode_or_wire_error(codec, frame)


@settings(max_examples=2000, deadline=None)
@given(flags=st.sampled_from([0, FLAG_SIGNED, 0x02, 0xFF]), body=st.binary(max_size=256))
def test_fuzz_random_body_behind_valid_header(flags, body):
    frame = MAGIC + bytes([PROTOCOL_VERSION, flags]) + body
    _decode_or_wire_error(Codec(), frame)
    assert _decode_or_wire_error(Codec(SECRET), frame) is None  # nobody can sign without the secret


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=8,
)
field_names = st.sampled_from(
    ["t", "transfer_id", "attempt", "consumer_engine", "consumer_rank", "consumer_tp", "block_ids", "first_token",
     "num_tokens", "ttl_ms", "keys", "layout", "regions", "reason", "code", "nbytes", "num_descs", "engine_id",
     "role", "rank", "tp_size", "mode", "compat_hash", "agent_metadata", "extra"]
)
tags = st.sampled_from(["hello", "reject", "reg", "revoke", "unneeded", "revoke_ack", "hb", "done", "failed", "x"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tag=tags, fields=st.dictionaries(field_names, msgpack_values, max_size=6))
def test_fuzz_structured_msgpack(tag, fields):
    body = msgspec.msgpack.encode({"t": tag, **fields})
    _decode_or_wire_error(Codec(), raw_frame(body))
    _decode_or_wire_error(Codec(SECRET), raw_frame(body, secret=SECRET))


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msg=messages, data=st.data())
def test_fuzz_mutated_valid_frames(msg, data):
    frame = bytearray(Codec().encode(msg))
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        i = data.draw(st.integers(HEADER_LEN, len(frame)), label="at")
        op = data.draw(st.sampled_from(["set", "insert", "delete"]), label="op")
        if op == "set" and i < len(frame):
            frame[i] = data.draw(st.integers(0, 255))
        elif op == "insert":
            frame[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        elif i < len(frame):
            del frame[i:i + data.draw(st.integers(1, 8))]
    out = _decode_or_wire_error(Codec(), bytes(frame))
    if out is not None:
        # whatever decoded must itself be valid: re-encoding and decoding gives it back
        assert Codec().decode(Codec().encode(out)) == out


# ---- compat hash -----------------------------------------------------------------------------------
BASE = dict(mode="push", model="meta-llama/Llama-3.1-8B", num_layers=32, total_kv_heads=8, head_dim=128,
            dtype="bfloat16", extra=())
VARIANTS = [
    ("mode", "pull"),
    ("model", "meta-llama/Llama-3.1-70B"),
    ("model", "meta-llama/llama-3.1-8b"),
    ("num_layers", 31),
    ("total_kv_heads", 16),
    ("head_dim", 64),
    ("dtype", "float16"),
    ("extra", ("fp8-scales",)),
    ("extra", ((),)),
]


def test_compat_hash_shape_and_stability():
    h = compat_hash(**BASE)
    assert len(h) == 64 and int(h, 16) >= 0
    assert compat_hash(**BASE) == h
    assert compat_hash(**{**BASE, "extra": ()}) == h
    assert compat_hash(**dict(reversed(list(BASE.items())))) == h  # keyword order is irrelevant
    # fits a Hello
    hello = msgspec.structs.replace(EXAMPLES[0], compat_hash=h)
    assert Codec().decode(Codec().encode(hello)) == hello


def test_compat_hash_is_stable_across_processes():
    code = ("from kvpush_common.protocol.wire import compat_hash; print(compat_hash(mode='push', model='m', num_layers=2, "
            "total_kv_heads=8, head_dim=128, dtype='bfloat16', extra=('a', 1)))")
    outs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    assert outs == {compat_hash(mode="push", model="m", num_layers=2, total_kv_heads=8, head_dim=128,
                                dtype="bfloat16", extra=("a", 1))}


@pytest.mark.parametrize("field,value", VARIANTS, ids=[f"{f}={v!r}" for f, v in VARIANTS])
def test_compat_hash_differs_when_any_factor_differs(field, value):
    assert compat_hash(**{**BASE, field: value}) != compat_hash(**BASE)


def test_compat_hash_push_vs_pull():
    assert compat_hash(**{**BASE, "mode": "push"}) != compat_hash(**{**BASE, "mode": "pull"})


@settings(max_examples=200, deadline=None)
@given(
    a=st.fixed_dictionaries(dict(
        mode=st.sampled_from(["push", "pull"]), model=st.text(max_size=20), num_layers=st.integers(1, 200),
        total_kv_heads=st.integers(1, 64), head_dim=st.integers(1, 512), dtype=st.sampled_from(["bfloat16", "fp8"]),
        extra=st.lists(st.text(max_size=5) | st.integers(), max_size=2).map(tuple))),
    b=st.fixed_dictionaries(dict(
        mode=st.sampled_from(["push", "pull"]), model=st.text(max_size=20), num_layers=st.integers(1, 200),
        total_kv_heads=st.integers(1, 64), head_dim=st.integers(1, 512), dtype=st.sampled_from(["bfloat16", "fp8"]),
        extra=st.lists(st.text(max_size=5) | st.integers(), max_size=2).map(tuple))),
)
def test_compat_hash_equal_iff_factors_equal(a, b):
    assert (compat_hash(**a) == compat_hash(**b)) == (a == b)
