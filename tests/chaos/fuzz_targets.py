"""Fuzz targets: every decoder that reads bytes from a socket, plus the producer's handling of
registrations up to the point where descriptors are built.  Used by the hypothesis tests
(tests/chaos/test_chaos_fuzz.py) and by atheris (tests/chaos/fuzz_atheris.py, scripts/chaos/chaos.sh).

Each target takes bytes and either returns or raises `Refused` (a clear, expected refusal).  Any
other exception is a bug.
"""

from __future__ import annotations

import msgspec
import numpy as np

from kvpush_common.endpoint.config import EndpointConfig
from kvpush_common.endpoint.base import Peer
from kvpush_common.endpoint.handshake import HandshakeServer
from kvpush_common.device.host import HostBackend
from kvpush_common.endpoint.producer import ProducerEndpoint
from kvpush_common.router.legs import decode_body, prefill_body
from kvpush_common.router.replies import ClientFields, UpstreamReply
from kvpush_common.protocol.legs import parse_leg
from kvpush_common.protocol.wire import MAX_HANDSHAKE_BYTES, Codec, Hello, HelloReject, Message, WireError

SECRET = b"fuzz-secret"
NOTIF = Codec()
SIGNED = Codec(SECRET)
HANDSHAKE = Codec(SECRET, max_bytes=MAX_HANDSHAKE_BYTES)


class Refused(Exception):
    """The input was refused with a clear error (the expected outcome for bad input)."""


def wire(data: bytes) -> None:
    """NIXL notification frames, unsigned and signed (bytes that parse as msgpack are also framed and
    signed, so that the fuzzer reaches the schema checks behind the MAC)."""
    for frame in _frames(data):
        for codec in (NOTIF, SIGNED):
            try:
                msg = codec.decode(frame)
            except WireError as e:
                assert str(e), "a refusal must say why"
                continue
            assert isinstance(msg, Message.__args__)


def _producer() -> ProducerEndpoint:
    backend = HostBackend(num_layers=2, num_heads=2, head_dim=4, block_size=4, num_blocks=8)
    return ProducerEndpoint(EndpointConfig(engine_id="P", total_kv_heads=2, secret=SECRET), backend)


_P = None
_SERVER = None


def handshake(data: bytes) -> None:
    """The producer's side channel: decode a Hello, validate it, answer Hello or HelloReject."""
    global _P, _SERVER
    if _SERVER is None:
        _P = _producer()
        _SERVER = HandshakeServer("127.0.0.1", 0, SECRET, _P.local_hello, _P._accept_hello)  # not started
    for frame in _frames(data):
        reply = _SERVER._answer(frame)
        assert isinstance(reply, (Hello, HelloReject))
        while not _P._inbox.empty():  # accepted peers would be added by the worker; drop them here
            _P._inbox.get_nowait()
        if isinstance(reply, HelloReject):
            assert reply.reason


def router(data: bytes) -> None:
    """What the router reads: a client body, an upstream reply, and kv_transfer_params."""
    try:
        body = msgspec.json.decode(data, type=dict)
        stream = bool(msgspec.convert(body, ClientFields).stream)
    except (msgspec.DecodeError, msgspec.ValidationError):
        body, stream = None, False
    if body is not None:
        prefill_body(body, {"kvpush": "prefill", "transfer_id": "t", "attempt": 0}, chat=bool(stream))
        decode_body(body, {"kvpush": "decode"})
        if isinstance(body.get("kv_transfer_params"), dict):
            parse_leg(body["kv_transfer_params"])
    try:
        reply = msgspec.json.decode(data, type=UpstreamReply)
        if isinstance(reply.kv_transfer_params, dict):
            parse_leg(reply.kv_transfer_params)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass


class RecordingTransport:
    """Stands in for NIXL under an unstarted producer: records every post's descriptors."""

    def __init__(self):
        self.notifs: dict[str, list[bytes]] = {}
        self.posts: list[tuple[np.ndarray, np.ndarray]] = []
        self.sent: list[bytes] = []

    def get_notifs(self):
        out, self.notifs = self.notifs, {}
        return out

    def send_notif(self, peer, msg):
        self.sent.append(msg)

    def post(self, op, peer, local, remote, mem_type, remote_mem_type, notif):
        self.posts.append((np.array(local), np.array(remote)))
        return object()

    def state(self, handle):
        return "DONE"

    def release(self, handle):
        return True


def _inside(descs: np.ndarray, layout) -> bool:
    spans = [(r.base, r.base + layout.num_blocks * r.block_stride) for r in layout.regions]
    for addr, length, _dev in descs.astype(np.int64):
        if not any(lo <= addr and addr + length <= hi for lo, hi in spans):
            return False
    return True


def registrations(data: bytes) -> None:
    """Arbitrary notification frames (signed as a handshaken consumer would, or not) and a ready KV,
    through a real producer step: nothing crashes, and every descriptor posted lies inside both
    sides' registered blocks (out-of-range or foreign block ids are refused before any is built)."""
    p = _producer()
    d_backend = HostBackend(num_layers=2, num_heads=2, head_dim=4, block_size=4, num_blocks=8)
    d_layout = d_backend.layout()
    p._peers[("D", 0)] = Peer("D", 0, 1, "D/r0", d_layout)
    t = RecordingTransport()
    p.transport = t
    frames = _frames(data)
    t.notifs = {"D/r0": frames[: len(frames) // 2 + 1], "X/r0": frames[len(frames) // 2 + 1:]}
    blocks = [b % 8 for b in data[:4]] or [0]
    p.kv_ready("t", 0, blocks, max(1, len(blocks) * 4 - (data[0] % 4 if data else 0)))
    for _ in range(2):
        p._step()
    assert p.stats.worker_errors._value.get() == 0
    for local, remote in t.posts:
        assert _inside(local, p.layout), "local descriptor outside the producer's blocks"
        assert _inside(remote, d_layout), "remote descriptor outside the consumer's blocks"


def _frames(data: bytes) -> list[bytes]:
    """Raw bytes, plus (when the bytes decode as a msgpack map) the same body framed and signed."""
    out = [data]
    try:
        obj = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return out
    import hashlib
    import hmac

    body = msgspec.msgpack.encode(obj)
    frame = b"KVP" + bytes([1, 1]) + body
    out.append(frame + hmac.new(SECRET, frame, hashlib.sha256).digest())
    return out


TARGETS = {"wire": wire, "handshake": handshake, "router": router, "registrations": registrations}
