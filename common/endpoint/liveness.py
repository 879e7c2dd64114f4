"""Consumer: a producer rank that is gone is seen in seconds, and the keys it owed end at once.

A receive waits on producer ranks; without this, a killed prefill is found out only when the receive times out
(`transfer_timeout_s`) and then its revoke goes unanswered for the whole fence wait (`fence_wait_s`): minutes
during which the request's blocks stay held.  A producer rank is declared gone, and every key still waiting on
it fails at once with a reason that names it (`Completion.on_producer_gone`), only when both hold:

1. NIXL could not reach it: a send to it (heartbeat, registration, revoke) raised a TransportError, as
   NIXL_ERR_REMOTE_DISCONNECT does once the peer's connection is gone.  Heartbeats go every `heartbeat_s` to
   every producer rank a key waits on (an empty one where the keys only wait for its last word), so this is
   known within one heartbeat of the death.
2. Its side channel refuses connections: nothing listens on the port its process held (probed on the
   handshake pool, one TCP connect).  A producer closes its side channel only after its NIXL agent is gone
   (`ProducerEndpoint._before_close`); a killed process loses both at its exit.  So the process that could
   have written has exited, and our own NIXL end has seen its connection close: what it sent before that was
   delivered ahead of the close (in-order streams), nothing can come after it.  No fence wait is needed.

A rank that NIXL cannot reach while something still accepts on its port is either the same process, alive
(unresponsive, paused: it may still write, so the fence rule stays) or a successor bound to the same port:
the handshake that follows tells which (`_on_peer_ok` fails what an old incarnation owed).  A false death
cannot come from a pause: a stopped process's listening socket still accepts.  Mixed into `ConsumerEndpoint`.
"""

from __future__ import annotations

import logging
import socket

from kvpush_common.endpoint.inbox import ProbeResult
from kvpush_common.protocol.wire import Heartbeat

log = logging.getLogger("kvpush_common.endpoint.consumer")


def probe_side_channel(addr: tuple[str, int], timeout_s: float) -> tuple[bool, str]:
    """(refused, what happened) for one TCP connect to a side channel.  Only an active refusal counts: a
    timeout or an unreachable host says nothing about whether the process lives."""
    try:
        with socket.create_connection(addr, timeout=timeout_s):
            return False, "its side channel accepts connections"
    except ConnectionRefusedError:
        return True, f"its side channel {addr[0]}:{addr[1]} refuses connections (the process exited)"
    except OSError as e:
        return False, f"side channel {addr[0]}:{addr[1]}: {e}"


class ProducerLiveness:
    def _poke_idle_owers(self, waiting: dict) -> None:
        """Heartbeat, keyless, the producer ranks that owe only a failing key's last word (RevokeAck): a send is
        what tells whether NIXL can still reach them."""
        for prod in sorted(self.completion.producers_owing() - set(waiting)):
            peer = self._peers.get(prod)
            if peer is not None:
                self._send(peer, Heartbeat(consumer_engine=self.cfg.engine_id, consumer_rank=self.cfg.rank, keys=[]))

    def _check_liveness(self) -> None:
        """Probe the side channel of each producer rank NIXL could not reach while a key waits on it."""
        if not self._unreachable:
            return
        owing = self.completion.producers_owing()
        for prod in list(self._unreachable):
            if prod not in owing:
                continue
            addr = self._addr.get(prod)
            if addr is None or prod in self._probing:
                continue
            self._probing.add(prod)
            self._pool.submit(self._probe, prod, addr)

    def _probe(self, prod, addr) -> None:
        """Handshake pool thread: socket only; the result goes back to the worker through the inbox."""
        try:
            refused, detail = probe_side_channel(addr, self.cfg.handshake_timeout_s)
        except Exception as e:  # never leave the rank marked as probing
            refused, detail = False, f"probe crashed: {e!r}"
        self._enqueue(ProbeResult(prod, refused, detail))

    def _on_probe(self, res: ProbeResult, now: float) -> list:
        self._probing.discard(res.producer)
        nixl_error = self._unreachable.get(res.producer)
        if nixl_error is None:
            return []  # reached again since (a message came from it, or a send went)
        if not res.refused:
            # alive, paused, or a successor on the same port: handshake again before the next use, which also
            # tells a successor (its keys then fail in _on_peer_ok); a live process's keys keep the fence rule
            self._suspect.add(res.producer)
            self._rehandshake(res.producer)
            return []
        prod = res.producer
        reason = f"NIXL cannot reach it ({nixl_error[:200]}) and {res.detail}"
        log.warning("producer %s rank %d is gone: %s", prod[0], prod[1], reason)
        self.stats.peers_gone.inc()
        reading = frozenset(r.key for r in self._reads if r.producer == prod)  # pull: our READ's end decides
        out = self.completion.on_producer_gone(prod, reason, now, keep=reading)
        self._unreachable.pop(prod, None)
        self._forget_peer(prod, "gone")  # the next request handshakes whatever listens there next
        return out

    def _rehandshake(self, prod) -> None:
        """Ask the rank's side channel who is there, unless a handshake with it already runs."""
        if self._connecting.get(prod):
            return
        ref = next((e.producer for e in self._expects.values() if e.producer.engine_id == prod[0]), None)
        if ref is None:
            return
        self._connecting[prod] = []
        self._pool.submit(self._handshake, ref, prod[1])
