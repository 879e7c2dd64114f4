"""Consumer side: a producer restarted under a new engine id on the same side channel (the drop-in contract).

vLLM's NIXL contract names a producer by its side channel; the engine id in a leg is what a proxy learned from an
earlier answer.  When that address answers as another engine, a NIXL-contract request follows it; a kvpush leg
(the engine `kvpush router` verified) fails as before.  Either way the old process is gone -- it held the port
until it exited -- so the keys it owed end at once.  Mixed into `ConsumerEndpoint` (its worker thread only).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from kvpush_common.endpoint.inbox import Expect, HandshakeMoved
from kvpush_common.protocol.legs import ProducerIdentity
from kvpush_common.protocol.topology import producers_for
from kvpush_common.state.completion import Received

log = logging.getLogger("kvpush_common.endpoint.consumer")

MOVES_REMEMBERED = 256  # producer engines seen replaced at their address (bounded)


class AddressMoves:
    def _on_moved(self, m: HandshakeMoved, now: float) -> list:
        """The side channel a request named answers as another engine: the producer restarted there.  A leg in
        vLLM's NIXL contract names the producer by its address -- its engine id is what a proxy learned from an
        earlier answer -- so it follows the address: it was registered nowhere yet, and the engine there writes
        only KV it computed for the same transfer key (the pairing is by request identity; stale registrations
        are refused), so the worst case is its registration expiring unmatched, never wrong bytes.  A kvpush
        leg names the engine `kvpush router` verified: it fails as before, and the router asks (RecvReport)."""
        old, host, port = m.producer, m.addr[0], m.addr[1] - m.producer[1]
        new = ProducerIdentity(engine_id=m.hello.engine_id, host=host, port=port, tp_size=m.hello.tp_size)
        self._note_move(old[0], new)
        log.warning("producer %s rank %d: its side channel %s:%d answers as %s now (restarted)", old[0], old[1],
                    *m.addr, new.engine_id)
        arriving = (new.engine_id, m.hello.rank)
        out: list = []
        for e in self._connecting.pop(old, []):
            if isinstance(e, Expect) and e.follow_address:
                out += self._follow(e, new, now, arriving)
            elif isinstance(e, Expect):
                out += self.completion.on_failed(e.key, old, f"handshake failed: {m.reason}", now)
        return out + self._on_peer_ok(arriving, m.hello, now, m.addr)  # registers what waits for `arriving`

    def _follow(self, e: Expect, new: ProducerIdentity, now: float, arriving=None) -> list:
        """Point a waiting NIXL-contract request at the engine now serving its producer's address (`arriving`:
        the rank whose handshake just answered; the caller adds it as a peer next)."""
        for waiting in self._connecting.values():  # its other ranks' handshakes are for the old engine
            if e in waiting:
                waiting.remove(e)
        try:
            ranks = producers_for(self.cfg.total_kv_heads, new.tp_size, self.cfg.tp_size, self.cfg.rank)
        except ValueError as err:
            return [Received(e.key, False, f"cannot route from producer TP {new.tp_size}: {err}")]
        expected = frozenset((new.engine_id, r) for r in ranks)
        if not self.completion.repoint(e.key, expected):  # already registered with the old engine: it fails
            return self.completion.on_failed(e.key, (e.producer.engine_id, ranks[0] if ranks else 0),
                                             f"producer {e.producer.engine_id} was replaced by {new.engine_id}", now)
        self.event("followed", e.key, old_engine=e.producer.engine_id, new_engine=new.engine_id)
        e = self._expects[e.key] = replace(e, producer=new)
        out: list = []
        for prod in sorted(expected):
            if prod == arriving:
                self._connecting.setdefault(prod, []).append(e)
            elif prod in self._peers and prod not in self._suspect and prod not in self._connecting:
                out += self._register(e, self._peers[prod], now, retry=True)
            else:
                self._connect(e, prod)
        return out

    def _followed(self, e: Expect) -> Expect:
        """A NIXL-contract request naming an engine already seen replaced at that address names its successor."""
        new = self._moved.get((e.producer.engine_id, e.producer.host, e.producer.port)) if e.follow_address else None
        if new is None or new.tp_size != e.producer.tp_size:
            return e
        self.event("followed", e.key, old_engine=e.producer.engine_id, new_engine=new.engine_id)
        return replace(e, producer=new)

    def _note_move(self, old_engine: str, new: ProducerIdentity) -> None:
        for k, v in list(self._moved.items()):  # a chain of restarts: every older name points at the newest
            if v.engine_id == old_engine and (v.host, v.port) == (new.host, new.port):
                self._moved[k] = new
        self._moved[(old_engine, new.host, new.port)] = new
        while len(self._moved) > MOVES_REMEMBERED:
            self._moved.popitem(last=False)

    def _retire_replaced(self, prod, addr: tuple[str, int], now: float) -> list:
        """Another engine's rank answered on this side channel before: that process is gone (it held the port
        until it exited), so nothing more can land from it.  The keys it owed end now, and it is forgotten."""
        out: list = []
        for gone in [p for p, a in self._addr.items() if a == addr and p[0] != prod[0]]:
            log.warning("producer %s rank %d was replaced at %s:%d by %s: failing the keys it owed", *gone, *addr,
                        prod[0])
            del self._addr[gone]
            for key in self.completion.keys_registered_with(gone):
                out += self.completion.on_failed(key, gone, "producer replaced at its side channel", now)
            self._suspect.discard(gone)
            self._forget_peer(gone, "replaced at its side channel")
        return out
