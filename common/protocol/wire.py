"""Every control message kvpush puts on a socket or in a NIXL notification, and their one codec.

Frame: b"KVP" | version (1 byte) | flags (1 byte) | [if signed: sender (8 bytes) | seq (8) | sent_at
(8, float seconds)] | msgpack body | HMAC-SHA256 (32 bytes, if flag 1).  The version sits outside the
body so that a peer of another version gets a clear error, not a schema failure; a signed frame's
freshness fields let the receiver refuse a replay (`protocol/replay.py`).  Bodies are msgspec tagged structs with bounded fields; nothing is pickled.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import struct
import threading
import time
from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta

from kvpush_common.protocol.layout import KVLayout
from kvpush_common.protocol.replay import ReplayWindow

# 2: Unneeded; 3: signed frames carry sender, seq and time (replay window); 4: staged transfers gone (Hello.staging,
# ChunkWritten, SlotFree), so a v3 peer that would still send them gets UnsupportedVersion, not a schema error
PROTOCOL_VERSION = 4
MAGIC = b"KVP"
HEADER_LEN = len(MAGIC) + 2
MAC_LEN = 32
FLAG_SIGNED = 0x01
FRESHNESS = struct.Struct("!8sQd")  # sender, seq, sent_at: signed frames only, under the MAC
MAX_BLOCK_IDS = 1 << 18  # 4M tokens at block size 16
MAX_HEARTBEAT_KEYS = 4096
MAX_NOTIF_BYTES = 4 << 20  # registrations and results travel as NIXL notifications
MAX_HANDSHAKE_BYTES = 64 << 20  # agent metadata grows ~90 B per registered region

# \Z, not $: msgspec uses re.search, and "$" also matches before a trailing newline.
Id = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-/]+\Z")]
Attempt = Annotated[int, Meta(ge=0, lt=2**31)]
Rank = Annotated[int, Meta(ge=0, lt=4096)]
TpSize = Annotated[int, Meta(ge=1, le=4096)]
BlockId = Annotated[int, Meta(ge=0, lt=2**31)]
Tokens = Annotated[int, Meta(ge=0, lt=2**31)]
Reason = Annotated[str, Meta(max_length=512)]
Mode = Literal["push", "pull"]


class WireError(ValueError):
    """A message could not be accepted; the text says why."""


class MessageTooLarge(WireError):
    pass


class UnsupportedVersion(WireError):
    pass


class BadSignature(WireError):
    pass


class MalformedMessage(WireError):
    pass


class ReplayedMessage(WireError):
    """A signed frame that verifies but was accepted before, or is too old to tell."""


class _Msg(msgspec.Struct, tag_field="t", forbid_unknown_fields=True, frozen=True):
    pass


class Hello(_Msg, tag="hello", omit_defaults=True):
    """Handshake, both directions: who I am, how my KV is laid out, and my NIXL agent."""

    engine_id: Id
    role: Literal["producer", "consumer"]
    rank: Rank
    tp_size: TpSize
    mode: Mode
    compat_hash: Annotated[str, Meta(min_length=64, max_length=64)]
    total_kv_heads: Annotated[int, Meta(ge=1, le=1 << 20)]
    agent_name: Id
    agent_metadata: bytes
    layout: KVLayout
    write_timeout_ms: Annotated[int, Meta(ge=1, le=3_600_000)] = 30_000  # the producer's WRITE bound


class HelloReject(_Msg, tag="reject"):
    reason: Reason


class KeyRef(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    transfer_id: Id
    attempt: Attempt


class Register(_Msg, tag="reg"):
    """Consumer rank -> producer rank: write tokens [first_token, num_tokens) into these blocks."""

    transfer_id: Id
    attempt: Attempt
    consumer_engine: Id
    consumer_rank: Rank
    consumer_tp: TpSize
    block_ids: Annotated[list[BlockId], Meta(max_length=MAX_BLOCK_IDS)]
    first_token: Tokens
    num_tokens: Tokens
    ttl_ms: Annotated[int, Meta(ge=1, le=3_600_000)]


class Revoke(_Msg, tag="revoke"):
    """Consumer gives up: post nothing more into my blocks, and tell me when nothing is in flight."""

    transfer_id: Id
    attempt: Attempt
    consumer_engine: Id
    consumer_rank: Rank
    reason: Reason = ""


class Unneeded(_Msg, tag="unneeded"):
    """Consumer rank -> producer rank: this attempt needs no bytes (the decode computes the prompt's short
    tail itself, from its own prefix cache): release the KV as soon as it is ready.  Never registered, so no
    WRITE can be in flight into this rank for it and no ack is needed."""

    transfer_id: Id
    attempt: Attempt
    consumer_engine: Id
    consumer_rank: Rank
    reason: Reason = ""


class RevokeAck(_Msg, tag="revoke_ack"):
    """Producer rank: no WRITE for this key into the revoking rank is in flight or will be posted."""

    transfer_id: Id
    attempt: Attempt
    producer_engine: Id
    producer_rank: Rank


class Heartbeat(_Msg, tag="hb"):
    """Consumer rank -> producer rank: I still want these; renew their leases."""

    consumer_engine: Id
    consumer_rank: Rank
    keys: Annotated[list[KeyRef], Meta(max_length=MAX_HEARTBEAT_KEYS)]


class WriteDone(_Msg, tag="done"):
    """Rides on the WRITE as its NIXL notification, so it arrives after the bytes."""

    transfer_id: Id
    attempt: Attempt
    producer_engine: Id
    producer_rank: Rank
    nbytes: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    num_descs: Annotated[int, Meta(ge=0, lt=2**40)]


class WriteFailed(_Msg, tag="failed"):
    """Producer rank: this key will never be (fully) written into your blocks by me."""

    transfer_id: Id
    attempt: Attempt
    producer_engine: Id
    producer_rank: Rank
    code: Annotated[str, Meta(max_length=64)]
    reason: Reason = ""


class ReadGrant(_Msg, tag="grant"):
    """Pull mode, producer rank -> consumer rank: read these source blocks now; they stay pinned until
    your ReadResult (or the producer's write timeout)."""

    transfer_id: Id
    attempt: Attempt
    producer_engine: Id
    producer_rank: Rank
    block_ids: Annotated[list[BlockId], Meta(max_length=MAX_BLOCK_IDS)]
    num_tokens: Tokens


class ReadResult(_Msg, tag="read"):
    """Pull mode, consumer rank -> producer rank: my READ of your blocks ended (ok rides on the READ)."""

    transfer_id: Id
    attempt: Attempt
    consumer_engine: Id
    consumer_rank: Rank
    ok: bool
    reason: Reason = ""


Message = Union[Hello, HelloReject, Register, Revoke, Unneeded, RevokeAck, Heartbeat, WriteDone, WriteFailed,
                ReadGrant, ReadResult]
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


class Codec:
    """Encode and decode frames; signs and verifies when a shared secret is configured.

    With a secret each codec is a sender of its own (random id, counting seq) and refuses frames it
    has accepted before (`ReplayWindow`); `clock` is the wall clock, injectable for tests.
    """

    def __init__(self, secret: bytes | None = None, max_bytes: int = MAX_NOTIF_BYTES,
                 clock=time.time, replay: ReplayWindow | None = None):
        self._secret = secret or None
        self.max_bytes = max_bytes
        self._clock = clock
        self._sender = os.urandom(8)
        self._seq = itertools.count()
        self._replay = replay or ReplayWindow()
        self._replay_lock = threading.Lock()

    @property
    def signed(self) -> bool:
        return self._secret is not None

    def encode(self, msg: Message) -> bytes:
        body = _ENCODER.encode(msg)
        header = MAGIC + bytes([PROTOCOL_VERSION, FLAG_SIGNED if self._secret else 0])
        if self._secret:
            frame = header + FRESHNESS.pack(self._sender, next(self._seq), self._clock()) + body
            frame += hmac.new(self._secret, frame, hashlib.sha256).digest()
        else:
            frame = header + body
        if len(frame) > self.max_bytes:
            raise MessageTooLarge(f"{type(msg).__name__} is {len(frame)} bytes; limit {self.max_bytes}")
        return frame

    def decode(self, frame: bytes) -> Message:
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise MalformedMessage(f"expected bytes, got {type(frame).__name__}")
        frame = bytes(frame)
        if len(frame) > self.max_bytes:
            raise MessageTooLarge(f"frame of {len(frame)} bytes exceeds limit {self.max_bytes}")
        if len(frame) < HEADER_LEN or frame[:3] != MAGIC:
            raise MalformedMessage("not a kvpush frame (bad magic or truncated header)")
        version, flags = frame[3], frame[4]
        if version != PROTOCOL_VERSION:
            raise UnsupportedVersion(f"peer speaks kvpush protocol v{version}; this side speaks v{PROTOCOL_VERSION}")
        if flags & ~FLAG_SIGNED:
            raise MalformedMessage(f"unknown frame flags 0x{flags:02x}")
        signed = bool(flags & FLAG_SIGNED)
        if self._secret and not signed:
            raise BadSignature("unsigned message but a shared secret is configured")
        if signed and not self._secret:
            raise BadSignature("peer signs its messages but no shared secret is configured here")
        body_at = HEADER_LEN
        if signed:
            if len(frame) < HEADER_LEN + FRESHNESS.size + MAC_LEN:
                raise MalformedMessage("signed frame too short for its freshness fields and MAC")
            frame, mac = frame[:-MAC_LEN], frame[-MAC_LEN:]
            if not hmac.compare_digest(mac, hmac.new(self._secret, frame, hashlib.sha256).digest()):
                raise BadSignature("message MAC does not verify (forged, corrupted, or wrong secret)")
            sender, seq, sent_at = FRESHNESS.unpack_from(frame, HEADER_LEN)
            body_at += FRESHNESS.size
            # the body is checked before the frame counts as seen, so a malformed one leaves no trace
        try:
            msg = _DECODER.decode(frame[body_at:])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise MalformedMessage(f"malformed message: {e}") from None
        except RecursionError:  # msgspec's nesting limit, e.g. deep arrays under an unknown key
            raise MalformedMessage("malformed message: nested too deeply") from None
        if signed:
            with self._replay_lock:
                why = self._replay.check(sender, seq, sent_at, self._clock())
            if why:
                raise ReplayedMessage(why)
        return msg


def layout_hash_facts(layout: KVLayout) -> dict:
    """The compat_hash factors a layout describes (its VALUE_FIELDS), for `compat_hash(**...)`."""
    from kvpush_common.protocol.layout import VALUE_FIELDS

    return {f: getattr(layout, f) for f in VALUE_FIELDS}


def compat_hash(*, mode: Mode, model: str, num_layers: int, total_kv_heads: int, head_dim: int, dtype: str,
                cache_dtype: str = "auto", kv_scales: str = "", latent: bool = False, drafter: str = "",
                extra: tuple = ()) -> str:
    """Hash of what must match for two engines to exchange KV at all.

    Block size, block order, TP size and addresses may differ: they travel in the Hello's layout
    and are checked pairwise by the planner with precise errors.  `dtype` is the storage type only: the value
    format (`cache_dtype`: fp8_e4m3 and fp8_e5m2 are both uint8, as vLLM's NixlConnector hashes cache_dtype in
    `compute_nixl_compatibility_hash`, vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py, 0.32), the
    K/V scales, MLA's latent form and the drafter are factors too; they enter only when not the default, so an
    unquantised dense cache without a drafter hashes as before.
    """
    layout_facts = tuple(f for f, default in ((f"cache_dtype={cache_dtype}", "cache_dtype=auto"),
                                              (f"kv_scales={kv_scales}", "kv_scales="),
                                              (f"latent={latent}", "latent=False"),
                                              (f"drafter={drafter}", "drafter=")) if f != default)
    factors = ("kvpush", PROTOCOL_VERSION, mode, model, num_layers, total_kv_heads, head_dim, dtype, *layout_facts,
               *extra)
    return hashlib.sha256(repr(factors).encode()).hexdigest()
