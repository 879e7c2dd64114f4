"""Consumer: the handshakes with producer ranks, and what the worker does with their answers.

A request that needs a producer rank not (or no longer) handshaken waits in `_connecting` behind one handshake per
rank.  The handshake itself (`_handshake`) runs on the handshake pool threads, ZMQ only, so one slow producer never
delays the others; its result comes back through the inbox, and the worker thread acts on it (`_on_peer_ok`: add
the peer, fail what a restarted process owed, register what waited; `_on_peer_fail`).  A side channel that answers
as another engine is `moves.AddressMoves`.  Its own module to keep the core (`consumer.py`) short.  Mixed into
`ConsumerEndpoint`.
"""

from __future__ import annotations

import logging

from kvpush_common.endpoint.base import incarnation_of
from kvpush_common.endpoint.handshake import HandshakeError, request_hello
from kvpush_common.endpoint.inbox import Decline, Expect, HandshakeDone, HandshakeFailed, HandshakeMoved
from kvpush_common.protocol.legs import ProducerIdentity
from kvpush_common.transport.nixl import TransportError

log = logging.getLogger("kvpush_common.endpoint.consumer")


class ProducerHandshakes:
    def _connect(self, e: Expect | Decline, prod: tuple[str, int]) -> None:
        """Queue `e` behind a (new) handshake with producer rank `prod`; one handshake per rank at a time."""
        waiting = self._connecting.setdefault(prod, [])
        if not waiting:
            self._pool.submit(self._handshake, e.producer, prod[1])
        waiting.append(e)

    def _handshake(self, ref: ProducerIdentity, rank: int) -> None:
        """Pool thread: ZMQ only; the result goes back to the worker through the inbox."""
        prod = (ref.engine_id, rank)
        try:
            hello = request_hello(ref.host, ref.port + rank, self.local_hello(),
                                  self._hello_codec, self.cfg.handshake_timeout_s)
            reason = self.check_peer_hello(hello, "producer")
            if reason is None and (hello.rank, hello.tp_size) != (rank, ref.tp_size):
                reason = (f"expected producer {ref.engine_id} rank {rank} of TP {ref.tp_size}, found "
                          f"{hello.engine_id} rank {hello.rank} of TP {hello.tp_size}")
            if reason is None and hello.write_timeout_ms > self.cfg.write_timeout_s * 1000:
                # our fence wait after a revoke assumes no WRITE outlives our own write_timeout_s
                reason = (f"producer write_timeout_s {hello.write_timeout_ms / 1000:g} exceeds this consumer's "
                          f"{self.cfg.write_timeout_s:g}: raise the consumer's write_timeout_s")
            addr = (ref.host, ref.port + rank)
            if reason is None and hello.engine_id != ref.engine_id:
                self._enqueue(HandshakeMoved(prod, hello, addr, f"expected producer {ref.engine_id} rank {rank} of "
                                                                f"TP {ref.tp_size}, found {hello.engine_id} rank "
                                                                f"{hello.rank} of TP {hello.tp_size}"))
                return
            self._enqueue(HandshakeFailed(prod, reason) if reason else HandshakeDone(prod, hello, addr))
        except HandshakeError as err:
            self._enqueue(HandshakeFailed(prod, str(err)))
        except Exception as err:  # never lose the waiting requests
            log.exception("handshake crashed")
            self._enqueue(HandshakeFailed(prod, f"handshake crashed: {err!r}"))

    def _on_peer_ok(self, prod, hello, now: float, addr=None) -> list:
        out: list = []
        self._suspect.discard(prod)
        old = self._peers.get(prod)
        if old is not None and old.incarnation == incarnation_of(hello):
            peer = old  # the same process answered: keep its agent and connection
            self._last_seen[prod] = now
        else:
            if old is not None and addr is not None and self._addr.get(prod) == addr:
                # A new process answers on the old one's side-channel port, which the old one held until it
                # exited: nothing more can land from it.  Keys it owed end now instead of at their fence.
                log.warning("producer %s rank %d restarted: failing the keys its old process owed", *prod)
                self.stats.peers_evicted.inc()
                retrying = {e.key for e in self._connecting.get(prod, [])}  # their sends never got through
                for key in self.completion.keys_registered_with(prod) - retrying:
                    out += self.completion.on_failed(key, prod, "producer restarted", now)
            try:
                peer = self._add_peer(hello)
            except TransportError as err:
                return out + self._on_peer_fail(prod, f"could not load producer agent: {err}", now)
        if addr is not None:
            out += self._retire_replaced(prod, addr, now)
            self._addr[prod] = addr
        for e in self._connecting.pop(prod, []):
            if isinstance(e, Decline):
                self._send_unneeded(e, peer)
            elif self.completion.wants_registration(e.key):
                out += self._register(e, peer, now)
        return out

    def _on_peer_fail(self, prod, reason: str, now: float) -> list:
        log.warning("handshake with producer %s rank %d failed: %s", prod[0], prod[1], reason)
        out: list = []
        for e in self._connecting.pop(prod, []):
            if isinstance(e, Expect):  # a Decline is best effort: the producer's lease frees that KV
                out += self.completion.on_failed(e.key, prod, f"handshake failed: {reason}", now)
        return out
