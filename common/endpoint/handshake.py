"""Side channel: one ZMQ request/reply per (consumer rank, producer rank) pair, exchanging `Hello`s.

The producer rank serves it (ROUTER on host:base_port+rank); a consumer rank asks.  Both sides learn
each other's NIXL agent metadata and KV layout in one round trip.  Messages are size-bounded at the
socket (ZMQ_MAXMSGSIZE) and in the codec.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import zmq

from kvpush_common.protocol.wire import MAX_HANDSHAKE_BYTES, Codec, Hello, HelloReject, WireError

log = logging.getLogger(__name__)


class HandshakeError(RuntimeError):
    pass


class HandshakeServer:
    """Answers consumers' Hellos on a background thread.

    `accept(hello)` returns None to accept (after queueing the peer for the NIXL-owning thread) or a
    reason to reject.  It runs before the reply is sent, so a consumer can never send a registration
    that arrives before its peer entry is queued.
    """

    def __init__(self, host: str, port: int, secret: bytes | None, local_hello: Callable[[], Hello],
                 accept: Callable[[Hello], str | None]):
        self._codec = handshake_codec(secret)
        self._local_hello = local_hello
        self._accept = accept
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_HANDSHAKE_BYTES + 1024)
        if port == 0:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        else:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        self.host = host
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvpush-handshake-{self.port}", daemon=True)

    def start(self) -> "HandshakeServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) != 3 or frames[1] != b"":
                continue  # not a REQ envelope
            ident, payload = frames[0], frames[2]
            reply = self._answer(payload)
            try:
                self._sock.send_multipart([ident, b"", self._codec.encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                log.warning("handshake reply failed: %s", e)

    def _answer(self, payload: bytes) -> Hello | HelloReject:
        try:
            hello = self._codec.decode(payload)
        except WireError as e:
            return HelloReject(reason=f"bad handshake: {e}"[:500])
        if not isinstance(hello, Hello):
            return HelloReject(reason=f"expected hello, got {type(hello).__name__}")
        try:
            reason = self._accept(hello)
        except Exception as e:  # a bug in validation must not kill the side channel
            log.exception("handshake validation crashed")
            reason = f"internal error: {e!r}"
        if reason:
            return HelloReject(reason=reason[:500])
        return self._local_hello()


def handshake_codec(secret: bytes | None) -> Codec:
    """One per asking endpoint, kept: a signed codec is a replay-window sender, and one per request
    would fill every server's sender table."""
    return Codec(secret, max_bytes=MAX_HANDSHAKE_BYTES)


def request_hello(host: str, port: int, hello: Hello, hcodec: Codec, timeout_s: float) -> Hello:
    """Send our Hello, return the peer's; HandshakeError on rejection, timeout or bad reply."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_HANDSHAKE_BYTES + 1024)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(hcodec.encode(hello))
        reply = hcodec.decode(sock.recv())
    except zmq.Again:
        raise HandshakeError(f"no handshake reply from {host}:{port} within {timeout_s:.1f} s") from None
    except zmq.ZMQError as e:
        raise HandshakeError(f"handshake with {host}:{port} failed: {e}") from None
    except WireError as e:
        raise HandshakeError(f"bad handshake reply from {host}:{port}: {e}") from None
    finally:
        sock.close(linger=0)
    if isinstance(reply, HelloReject):
        raise HandshakeError(f"{host}:{port} rejected the handshake: {reply.reason}")
    if not isinstance(reply, Hello):
        raise HandshakeError(f"{host}:{port} answered with {type(reply).__name__}")
    return reply
