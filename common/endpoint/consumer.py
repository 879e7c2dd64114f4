"""Consumer (decode) rank: registers destination blocks with every producer rank that writes into it,
counts their completions, and hands blocks back only when no WRITE into them can still land.

Engine thread: `expect`, `abort`, `take_finished` only enqueue or drain.  Handshakes run in a small
thread pool (ZMQ only) so one slow producer never delays the others (`consumer_handshake.py`); the worker
thread owns NIXL.

This module is the core and the push path (a producer rank's WRITE lands in our blocks, its WriteDone counts it
done).  Pull mode is mixed in from its own module (`consumer_pull.py`: the registration is answered with a
ReadGrant naming the source blocks; the worker thread plans and posts the READ, its ReadResult riding on it to the
producer, and polls it).  `_on_msg` is where they branch.
"""

from __future__ import annotations

import collections
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from kvpush_common.state.completion import Completion, Received, SendRevoke
from kvpush_common.endpoint.base import Endpoint, Peer
from kvpush_common.endpoint.consumer_handshake import ProducerHandshakes
from kvpush_common.endpoint.consumer_pull import PullReads, _Read
from kvpush_common.endpoint.handshake import handshake_codec
from kvpush_common.endpoint.liveness import ProducerLiveness
from kvpush_common.endpoint.moves import AddressMoves
from kvpush_common.endpoint.inbox import (Decline, Expect, HandshakeDone, HandshakeFailed, HandshakeMoved, LocalAbort,
                                          ProbeResult, block_ids_as_ints)
from kvpush_common.protocol.identity import TransferKey
from kvpush_common.protocol.legs import ProducerIdentity
from kvpush_common.protocol.topology import producers_for
from kvpush_common.protocol.wire import (MAX_BLOCK_IDS, MAX_HEARTBEAT_KEYS, Heartbeat, KeyRef, ReadGrant, Register,
                                         Revoke, RevokeAck, Unneeded, WriteDone, WriteFailed)

log = logging.getLogger(__name__)

HANDSHAKE_WORKERS = 4  # concurrent handshakes: a slow producer rank never blocks the others


class ConsumerEndpoint(ProducerHandshakes, ProducerLiveness, PullReads, AddressMoves, Endpoint):
    role = "consumer"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.completion = Completion(transfer_timeout_s=self.cfg.transfer_timeout_s,
                                     fence_wait_s=self.cfg.fence_wait_s, tombstone_s=self.cfg.tombstone_s)
        self._pool = ThreadPoolExecutor(max_workers=HANDSHAKE_WORKERS,
                                        thread_name_prefix=f"kvpush-hs-{self.cfg.rank}")
        self._connecting: dict[tuple[str, int], list[Expect | Decline]] = {}  # producer rank -> waiting requests
        self._hello_codec = handshake_codec(self.cfg.secret)
        self._next_heartbeat = 0.0
        self._expected_at: dict[TransferKey, float] = {}
        self._expects: dict[TransferKey, Expect] = {}  # pull mode needs the blocks when the grant comes
        self._reads: list[_Read] = []  # consumer_pull.PullReads: READs posted, not settled yet
        self._suspect: set[tuple[str, int]] = set()  # producer ranks to handshake again before the next use
        self._addr: dict[tuple[str, int], tuple[str, int]] = {}  # producer rank -> side channel it answered on
        self._probing: set[tuple[str, int]] = set()  # liveness.ProducerLiveness: side-channel probes under way
        self._waiting = False  # a key waits for bytes (the worker's last step said): the engine's step wakes it
        self._moved = collections.OrderedDict()  # moves.AddressMoves: (old engine, host, port) -> who is there now

    # ---- engine-facing ---------------------------------------------------------------------------
    def expect(self, transfer_id: str, attempt: int, producer: ProducerIdentity, block_ids, num_tokens: int,
               first_token: int = 0, follow_address: bool = False) -> None:
        """Blocks are allocated: register them.  `first_token` > 0 when a local prefix is cached;
        `follow_address`: the leg came in vLLM's NIXL contract (see `_on_moved`)."""
        # tuple() only (no copy of a tuple): the worker converts the ids (`block_ids_as_ints`), off the step
        self._enqueue(Expect(TransferKey(transfer_id, attempt), producer, tuple(block_ids), int(num_tokens),
                             int(first_token), bool(follow_address)))

    def decline(self, transfer_id: str, attempt: int, producer: ProducerIdentity, reason: str = "") -> None:
        """This attempt needs no bytes (nothing was registered for it): its producer ranks release the KV once
        ready instead of holding it to the lease end.  Best effort: nothing comes back to the engine."""
        self._enqueue(Decline(TransferKey(transfer_id, attempt), producer, reason))

    def abort(self, transfer_id: str, attempt: int, reason: str = "") -> None:
        """Give up; the blocks come back through take_finished once no WRITE can land in them."""
        self._enqueue(LocalAbort(TransferKey(transfer_id, attempt), reason))

    def _before_close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- worker ----------------------------------------------------------------------------------
    def _claimed_sender(self, msg):
        if isinstance(msg, (WriteDone, WriteFailed, RevokeAck, ReadGrant)):
            return (msg.producer_engine, msg.producer_rank)
        return None

    def _step(self) -> bool:
        now = self.clock()
        out: list = []
        try:  # each unit is guarded, and whatever was decided is always acted on (no lost results)
            for item in self._drain_inbox():
                out += self._guard(self._on_item, item, now)
            for peer, msg in self._receive(self.transport.get_notifs()):
                out += self._guard(self._on_msg, peer, msg, now)
            out += self._guard(self._poll_reads, now)
            out += self._guard(self.completion.tick, now)
        finally:
            self._act(out)
        if now >= self._next_heartbeat:
            self._heartbeat()
            self._next_heartbeat = now + self.cfg.heartbeat_s
        self._check_liveness()
        if now >= self._next_evict:  # the peers live work refers to, only when an eviction pass is due
            busy = {(e.producer.engine_id, r) for e in self._expects.values() for r in range(e.producer.tp_size)}
            self._evict_idle(now, busy | set(self._connecting) | {r.producer for r in self._reads})
        self._waiting = len(self.completion) > 0 or bool(self._reads)
        return self._waiting

    def _poll_period(self, busy: bool) -> float:
        """While a key waits for bytes its WriteDone is fetched once per engine step (`engine_step` wakes the
        worker), as vLLM's own decode does; `wire_poll_s` bounds the wait when the engine does not step.  A short
        poll instead woke the worker, and took its GIL, many times per decode step beside the engine thread."""
        if busy:
            return self.cfg.wire_poll_s
        return super()._poll_period(busy)

    def engine_step(self) -> None:
        """Engine thread, once per step (start_load_kv): while a key waits for its bytes, wake the worker to fetch
        the notifications that came since the last step.  One flag read, and one event set only then."""
        if self._waiting:
            self._wake.set()

    def _on_item(self, item, now: float) -> list:
        if isinstance(item, Expect):
            return self._on_expect(item, now)
        if isinstance(item, LocalAbort):
            return self.completion.abort(item.key, item.reason, now)
        if isinstance(item, Decline):
            return self._on_decline(item)
        if isinstance(item, HandshakeDone):
            return self._on_peer_ok(item.producer, item.hello, now, item.addr)
        if isinstance(item, HandshakeFailed):
            return self._on_peer_fail(item.producer, item.reason, now)
        if isinstance(item, HandshakeMoved):
            return self._on_moved(item, now)
        if isinstance(item, ProbeResult):
            return self._on_probe(item, now)
        return []

    def _on_msg(self, peer: Peer, msg, now: float) -> list:
        """The one place the strategies branch: a push ends with WriteDone; a pull's ReadGrant posts our READ
        (`consumer_pull`), which ends once `_poll_reads` sees it settle."""
        key = TransferKey(msg.transfer_id, msg.attempt)
        prod = (peer.engine_id, peer.rank)
        if isinstance(msg, WriteDone):
            return self.completion.on_done(key, prod, now)
        if isinstance(msg, WriteFailed):
            return self.completion.on_failed(key, prod, f"{msg.code}: {msg.reason}", now)
        if isinstance(msg, RevokeAck):
            return self.completion.on_revoke_ack(key, prod, now)
        if isinstance(msg, ReadGrant):
            return self._on_grant(peer, msg, now)
        return []

    def _act(self, out: list) -> None:
        for a in out:
            self._guard(self._act_one, a)

    def _act_one(self, a) -> None:
        if isinstance(a, Received):
            e = self._expects.pop(a.key, None)
            started = self._expected_at.pop(a.key, None)
            if started is not None and a.ok:
                self.stats.recv_wait_seconds.observe(self.clock() - started)
            self._outbox.append(a)  # first: the engine must get its blocks back whatever happens next
            self.event("received" if a.ok else "recv_failed", a.key, reason=a.reason[:200])
            (self.stats.received_ok if a.ok else self.stats.received_failed).inc()
            if not a.ok and started is not None and e is not None:  # producers silent since it began: re-check
                for r in range(e.producer.tp_size):
                    prod = (e.producer.engine_id, r)
                    if self._last_seen.get(prod, 0.0) < started:
                        self._suspect.add(prod)
        elif isinstance(a, SendRevoke):
            peer = self._peers.get(a.producer)
            if peer is not None:
                self._send(peer, Revoke(transfer_id=a.key.transfer_id, attempt=a.key.attempt,
                                        consumer_engine=self.cfg.engine_id, consumer_rank=self.cfg.rank,
                                        reason=a.reason[:500]))

    def _on_expect(self, e: Expect, now: float) -> list:
        if e.key in self.completion:
            log.warning("ignoring a second expect() for live key %s", e.key)
            return []
        e = self._followed(e)
        try:
            e = replace(e, block_ids=block_ids_as_ints(e.block_ids))
        except (TypeError, ValueError) as err:
            return [Received(e.key, False, f"bad block ids: {err}")]
        if len(e.block_ids) > MAX_BLOCK_IDS or not 0 <= e.first_token <= e.num_tokens < 2**31:
            return [Received(e.key, False, f"registration out of bounds: {len(e.block_ids)} blocks, tokens "
                                           f"[{e.first_token}, {e.num_tokens})")]
        try:
            ranks = producers_for(self.cfg.total_kv_heads, e.producer.tp_size, self.cfg.tp_size, self.cfg.rank)
        except ValueError as err:
            return [Received(e.key, False, f"cannot route from producer TP {e.producer.tp_size}: {err}")]
        expected = frozenset((e.producer.engine_id, r) for r in ranks)
        out = self.completion.start(e.key, expected, now)
        if out:
            return out
        self._expected_at[e.key] = now
        self._expects[e.key] = e
        out = []
        for prod in sorted(expected):
            if not self.completion.wants_registration(e.key):
                break  # an earlier producer rank already failed it
            if prod in self._peers and prod not in self._suspect and prod not in self._connecting:
                out += self._register(e, self._peers[prod], now, retry=True)
            else:
                self._connect(e, prod)
        return out

    def _on_decline(self, d: Decline) -> list:
        try:
            ranks = producers_for(self.cfg.total_kv_heads, d.producer.tp_size, self.cfg.tp_size, self.cfg.rank)
        except ValueError as err:
            log.warning("not declining %s: cannot route from producer TP %d: %s", d.key, d.producer.tp_size, err)
            return []
        self.event("declined", d.key, reason=d.reason[:200])
        self.stats.declined.inc()
        for prod in sorted((d.producer.engine_id, r) for r in ranks):
            if prod in self._peers and prod not in self._suspect and prod not in self._connecting:
                self._send_unneeded(d, self._peers[prod])
            else:
                self._connect(d, prod)
        return []

    def _send_unneeded(self, d: Decline, peer: Peer) -> None:
        self._send(peer, Unneeded(transfer_id=d.key.transfer_id, attempt=d.key.attempt,
                                  consumer_engine=self.cfg.engine_id, consumer_rank=self.cfg.rank,
                                  reason=d.reason[:500]))

    def _register(self, e: Expect, peer: Peer, now: float, retry: bool = False) -> list:
        prod = (peer.engine_id, peer.rank)
        self.completion.on_registered(e.key, prod)  # from now on a WRITE may land
        sent = self._send(peer, Register(transfer_id=e.key.transfer_id, attempt=e.key.attempt,
                                  consumer_engine=self.cfg.engine_id, consumer_rank=self.cfg.rank,
                                  consumer_tp=self.cfg.tp_size, block_ids=list(e.block_ids),
                                  first_token=e.first_token, num_tokens=e.num_tokens,
                                  ttl_ms=int(self.cfg.reg_ttl_s * 1000)))
        if sent:
            self.stats.registrations_sent.inc()
            self.event("registered", e.key, producer_rank=peer.rank, first_token=e.first_token, blocks=len(e.block_ids))
            return []
        if retry:  # the peer may have restarted (its old agent is unreachable): handshake again, then register
            self.completion.on_unsent(e.key, prod)
            self._suspect.add(prod)
            self._connect(e, prod)
            return []
        return self.completion.on_failed(e.key, prod, "could not send the registration", now)

    def _heartbeat(self) -> None:
        waiting = self.completion.waiting_keys()
        self._poke_idle_owers(waiting)
        for prod, keys in waiting.items():
            peer = self._peers.get(prod)
            if peer is None:
                continue
            for i in range(0, len(keys), MAX_HEARTBEAT_KEYS):
                chunk = [KeyRef(k.transfer_id, k.attempt) for k in keys[i:i + MAX_HEARTBEAT_KEYS]]
                if not self._send(peer, Heartbeat(consumer_engine=self.cfg.engine_id, consumer_rank=self.cfg.rank, keys=chunk)):
                    self._suspect.add(prod)
