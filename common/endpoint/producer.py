"""Producer (prefill) rank: serves handshakes, matches registrations with ready KV, moves it to every consumer rank.

Engine thread: `kv_ready`, `abort`, `take_finished` only enqueue or drain.  The worker thread owns NIXL: it decodes
registrations, runs the rendezvous, waits for the device's KV fence, then hands each destination rank to one
transfer strategy, and sends WriteFailed whenever a destination will not be (fully) written.  Reading path: this
file (the core: inbox, messages, fence, dispatch), then one file per strategy, each a mixin on this class:

- `producer_push.py`: the push, one WRITE per destination rank;
- `producer_pull.py`: pull mode (`EndpointConfig.mode == "pull"`): a ReadGrant, and the blocks pinned while the
  consumer READs.

Push and pull part in one place, `_poll_fence`; each in-flight kind (`transfers.py`) has its poll in `_polls`.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from kvpush_common.endpoint.base import Endpoint, Peer
from kvpush_common.endpoint.handshake import HandshakeServer
from kvpush_common.endpoint.inbox import ConsumerHello, KVReady, LocalAbort, block_ids_as_ints
from kvpush_common.endpoint.producer_pull import PullGrants
from kvpush_common.endpoint.producer_push import DirectPushes
from kvpush_common.endpoint.transfers import AwaitingFence, DirectWrite, ReadPin, Transfer
from kvpush_common.plan.planner import PlanError, plan_transfer
from kvpush_common.protocol.identity import TransferKey
from kvpush_common.protocol.topology import routes_from
from kvpush_common.protocol.wire import (Heartbeat, Hello, ReadResult, Register, Revoke, RevokeAck, Unneeded, WriteDone,
                                         WriteFailed)
from kvpush_common.state.rendezvous import (Dest, Outcome, ReadyKV, Release, Rendezvous, SendFailed, SendRevokeAck,
                                            StartWrite)
from kvpush_common.transport.nixl import TransportError

log = logging.getLogger(__name__)


class ProducerEndpoint(DirectPushes, PullGrants, Endpoint):
    role = "producer"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rendezvous = Rendezvous(expected_dests=self._expected_dests, lease_s=self.cfg.lease_s,
                                     tombstone_s=self.cfg.tombstone_s)
        self._inflight: list[Transfer] = []  # one per (request, consumer rank) being written or read
        self._polls = {AwaitingFence: self._poll_fence, DirectWrite: self._poll_direct, ReadPin: self._poll_pin}
        self.server: HandshakeServer | None = None
        self._local_prepped: dict[tuple[int, int], object] = {}  # (head_start, num_heads) -> prepped list
        self._remote_prepped: dict[Dest, tuple[object, object]] = {}  # consumer rank -> (local, remote) lists
        self._ready_at: dict[TransferKey, float] = {}
        self._reg_from: dict[tuple[TransferKey, Dest], str] = {}  # registration -> incarnation that sent it
        self._last_fetch: float | None = None
        self._next_prune = 0.0
        self._routes_by_tp: dict[int, tuple] = {}  # consumer TP size -> the routes this rank writes (`_routes`)

    # ---- engine-facing ---------------------------------------------------------------------------
    def kv_ready(self, transfer_id: str, attempt: int, block_ids, num_tokens: int, written: bool = False,
                 consumer_tp: int | None = None) -> None:
        """The step that computed this request's KV was issued; its blocks stay ours until released.

        `written`: the caller knows the device already finished writing this KV, so no fence is recorded
        (a fence recorded now would also wait for whatever the engine queued after that step).
        `consumer_tp`: the decode instance's TP size, when known; if no rank of it reads from this rank
        (head replication), the KV is released at once."""
        fence = None if written else self.backend.mark_kv_written()
        ready = ReadyKV(tuple(block_ids), int(num_tokens), fence)  # the worker converts the ids, off the step
        self._enqueue(KVReady(TransferKey(transfer_id, attempt), ready, consumer_tp, self.clock()))

    def abort(self, transfer_id: str, attempt: int, reason: str = "") -> None:
        self._enqueue(LocalAbort(TransferKey(transfer_id, attempt), reason))

    @property
    def address(self) -> tuple[str, int]:
        return self.server.host, self.server.port

    # ---- lifecycle -------------------------------------------------------------------------------
    def _after_start(self) -> None:
        port = self.cfg.base_port + self.cfg.rank if self.cfg.base_port else 0
        self.server = HandshakeServer(self.cfg.host, port, self.cfg.secret, self.local_hello, self._accept_hello).start()

    def _before_close(self) -> None:
        """The side channel closes only once the worker (and with it the NIXL agent) is gone: consumers take a
        refused connection as proof that nothing can be written any more (liveness.py)."""
        if self._thread is not None and self._thread.is_alive():
            log.warning("producer worker did not stop: its side channel stays open")
            return
        if self.server is not None:
            self.server.close()

    def _accept_hello(self, hello: Hello) -> str | None:
        """Handshake thread: validate, then queue the peer for the worker before the reply goes out."""
        reason = self.check_peer_hello(hello, "consumer")
        if reason:
            return reason
        if not any(r.dst_rank == hello.rank for r in self._routes(hello.tp_size)):
            return f"producer rank {self.cfg.rank} writes nothing into consumer rank {hello.rank}"
        try:
            probe = next(r for r in self._routes(hello.tp_size) if r.dst_rank == hello.rank)
            plan_transfer(self.layout, hello.layout, probe, [0], [0], num_tokens=1)
        except PlanError as e:
            return f"KV layouts cannot be paired: {e}"
        self._enqueue(ConsumerHello(hello))
        return None

    def _routes(self, consumer_tp: int) -> tuple:
        """The routes this rank writes into a TP-`consumer_tp` consumer; worked out once per TP size (a push
        asked twice, each time building every route of the pairing)."""
        got = self._routes_by_tp.get(consumer_tp)
        if got is None:
            got = tuple(routes_from(self.cfg.total_kv_heads, self.cfg.tp_size, consumer_tp, self.cfg.rank))
            if len(self._routes_by_tp) >= 16:  # TP sizes of consumers long gone
                self._routes_by_tp.clear()
            self._routes_by_tp[consumer_tp] = got
        return got

    def _expected_dests(self, consumer_engine: str, consumer_tp: int) -> frozenset[Dest]:
        return frozenset((consumer_engine, r.dst_rank) for r in self._routes(consumer_tp))

    # ---- worker ----------------------------------------------------------------------------------
    def _claimed_sender(self, msg):
        if isinstance(msg, (Register, Revoke, Unneeded, Heartbeat, ReadResult)):
            return (msg.consumer_engine, msg.consumer_rank)
        return None

    def _step(self) -> bool:
        # Notifications are fetched before the inbox is drained: a consumer sends its first
        # registration only after our handshake reply, and its peer entry was queued before that.
        fetch_start = self.clock()
        notifs = self.transport.get_notifs()
        now = self.clock()
        # What this fetch returns was not there when the previous fetch started (control messages are not
        # in transit longer than fence_grace_s, design section 8, assumption a): registrations and heartbeats
        # count from then.  After a stall (the process was paused or starved, or a transport call blocked)
        # a consumer may already have given up on them: they count from before the stall and have expired.
        arrived_after = self._last_fetch if self._last_fetch is not None else fetch_start
        self._last_fetch = fetch_start
        if now - arrived_after > self.cfg.fence_grace_s:
            self.stats.stale_batches.inc()
            log.warning("producer worker stalled %.1f s: what it fetched counts from before the stall",
                        now - arrived_after)
        actions = []
        try:  # each unit is guarded, and whatever was decided is always acted on (no lost results)
            for item in self._drain_inbox():
                actions += self._guard(self._on_item, item, now)
            for peer, msg in self._receive(notifs):
                actions += self._guard(self._on_msg, peer, msg, now, arrived_after)
            actions += self._guard(self.rendezvous.tick, now)
        finally:
            self._run(actions, now)
        self._poll_inflight()
        if now >= self._next_prune:  # forget the sender of registrations whose entry has ended
            self._next_prune = now + 1.0
            self._reg_from = {k: v for k, v in self._reg_from.items() if self.rendezvous.entry_state(k[0]) is not None}
        if now >= self._next_evict:
            self._evict_idle(now, {i.dest for i in self._inflight})
        # registrations waiting for their KV need no poll: the engine's kv_ready wakes the worker.  Ready KV
        # waiting for a registration (it comes as a notification), or work in flight, does.
        return bool(self._inflight) or self.rendezvous.has_ready()

    def _poll_period(self, busy: bool) -> float:
        if any(isinstance(i, DirectWrite) for i in self._inflight):
            return min(self.cfg.write_poll_s, self.cfg.poll_s)  # on the wire: see it complete soon
        return super()._poll_period(busy)

    def _on_item(self, item, now: float) -> list:
        if isinstance(item, ConsumerHello):
            try:
                self._prepare_peer(self._add_peer(item.hello))
            except TransportError as e:
                log.warning("could not add consumer %s: %s", item.hello.agent_name, e)
        elif isinstance(item, KVReady):
            taken = self.clock()
            wake_s = max(0.0, taken - item.enqueued_at) if item.enqueued_at is not None else None
            # of the wake, the part inside the step that took it (NIXL's get_notifs, the items before it), the
            # rest being the worker coming round (its previous step, its sleep, the GIL)
            step_start = self._last_fetch if self._last_fetch is not None else taken
            in_step_s = None if wake_s is None else min(wake_s, max(0.0, taken - step_start))
            self.event("kv_ready", item.key, **({} if wake_s is None else {
                "wake_ms": round(wake_s * 1e3, 3), "in_step_ms": round(in_step_s * 1e3, 3),
                "asleep": item.enqueued_at >= self._slept_from, "prev_step_ms": round(self._last_step_s * 1e3, 3)}))
            if item.consumer_tp is not None and not self._routes(item.consumer_tp):
                return self.rendezvous.on_unread(item.key, item.ready, now,
                                                 f"no rank of a TP-{item.consumer_tp} consumer reads from "
                                                 f"producer rank {self.cfg.rank}")
            if wake_s is not None:
                self.stats.stage_seconds.labels(stage="wake").observe(wake_s)
            try:
                ready = replace(item.ready, block_ids=block_ids_as_ints(item.ready.block_ids))
            except (TypeError, ValueError) as e:
                log.warning("kv_ready of %s: bad block ids: %s", item.key, e)
                return self.rendezvous.on_unusable_ready(item.key, f"bad block ids: {e}", now)
            self._ready_at[item.key] = item.enqueued_at if item.enqueued_at is not None else now  # handoff from here
            return self.rendezvous.on_ready(item.key, ready, now)
        elif isinstance(item, LocalAbort):
            return self.rendezvous.on_local_abort(item.key, item.reason, now)
        return []

    def _on_msg(self, peer: Peer, msg, now: float, arrived_after: float) -> list:
        key = TransferKey(msg.transfer_id, msg.attempt) if not isinstance(msg, Heartbeat) else None
        dest = (peer.engine_id, peer.rank)
        if isinstance(msg, Register):
            if msg.consumer_tp != peer.tp_size:
                return [SendFailed(key, dest, "bad_registration", "consumer_tp differs from the handshake")]
            self.event("registration", key, consumer_rank=peer.rank)
            self._reg_from.setdefault((key, dest), peer.incarnation)
            return self.rendezvous.on_register(msg, now, arrived_after)
        if isinstance(msg, Revoke):
            return self.rendezvous.on_revoke(key, dest, now)
        if isinstance(msg, Unneeded):
            self.event("unneeded", key, consumer_rank=dest[1])
            return self.rendezvous.on_unneeded(key, dest, msg.reason, now)
        if isinstance(msg, ReadResult):
            return self._on_read_result(key, dest, msg, now)
        if isinstance(msg, Heartbeat):
            self.rendezvous.on_heartbeat([TransferKey(k.transfer_id, k.attempt) for k in msg.keys], now,
                                         peer.engine_id, arrived_after)
        return []

    def _run(self, actions, now: float) -> None:
        while actions:
            actions += self._guard(self._run_one, actions.pop(0), now)

    def _run_one(self, a, now: float) -> list:
        if isinstance(a, StartWrite):
            try:
                return self._start_write(a, now)
            except Exception as e:  # the rendezvous counts this destination as writing: it must get a result
                log.exception("starting write %s -> %s failed", a.key, a.dest)
                self.stats.worker_errors.inc()
                if any(i.key == a.key and i.dest == a.dest and not isinstance(i, AwaitingFence) for i in self._inflight):
                    return []  # posted: polling ends it
                self._inflight = [i for i in self._inflight if not (i.key == a.key and i.dest == a.dest)]
                return self._fail_write(a, "post_failed", f"internal error: {e!r}", now)
        elif isinstance(a, SendFailed):
            self.stats.writes_failed.labels(code=a.code).inc()
            peer = self._peers.get(a.dest)
            if peer is not None:
                self._send(peer, WriteFailed(transfer_id=a.key.transfer_id, attempt=a.key.attempt,
                                             producer_engine=self.cfg.engine_id, producer_rank=self.cfg.rank,
                                             code=a.code, reason=a.reason[:500]))
        elif isinstance(a, SendRevokeAck):
            peer = self._peers.get(a.dest)
            if peer is not None:
                self._send(peer, RevokeAck(transfer_id=a.key.transfer_id, attempt=a.key.attempt,
                                           producer_engine=self.cfg.engine_id, producer_rank=self.cfg.rank))
        elif isinstance(a, Release):
            self._outbox.append(a)  # first: the engine must get its blocks back whatever happens next
            self.event("released", a.key, outcome=a.outcome.value)
            ready_at = self._ready_at.pop(a.key, None)
            if ready_at is not None and a.outcome is Outcome.DONE:
                self.stats.handoff_seconds.observe(self.clock() - ready_at)
            self.stats.released.labels(outcome=a.outcome.value).inc()
        return []

    def _fail_write(self, a: StartWrite, code: str, reason: str, now: float) -> list:
        log.warning("write %s -> %s failed (%s): %s", a.key, a.dest, code, reason)
        return [SendFailed(a.key, a.dest, code, reason)] + self.rendezvous.on_write_result(a.key, a.dest, False, now)

    def _start_write(self, a: StartWrite, now: float) -> list:
        peer = self._peers.get(a.dest)
        if peer is None:
            return self._fail_write(a, "unknown_consumer", "no handshake with this consumer rank", now)
        if not self._same_incarnation(a, peer):
            return self._fail_write(a, "unknown_consumer", "consumer rank restarted since it registered", now)
        if a.reg.num_tokens != a.ready.num_tokens:
            return self._fail_write(a, "token_mismatch",
                                    f"consumer expects {a.reg.num_tokens} tokens, producer has {a.ready.num_tokens}", now)
        if a.reg.first_token >= a.ready.num_tokens:  # consumer already holds every token
            sent = self._send(peer, self._done_msg(a.key, 0, 0))
            return self.rendezvous.on_write_result(a.key, a.dest, sent, now)
        item = AwaitingFence(a, now, now + self.cfg.write_timeout_s)
        self._inflight.append(item)
        return self._poll_fence(item, now)

    def _poll_fence(self, item: AwaitingFence, now: float) -> list:
        """Once the device has written the KV, replace the item by the transfer that moves it."""
        a = item.start
        if now >= item.deadline and not self.backend.kv_written(a.ready.fence):
            self._inflight.remove(item)
            return self._fail_write(a, "fence_timeout", "device never finished writing the KV", now)
        if not self.backend.kv_written(a.ready.fence):
            return []
        self._inflight.remove(item)
        t_post = self.clock()
        fence_s = max(0.0, t_post - item.posted_at)  # posted_at of an AwaitingFence: when the write started
        peer = self._peers.get(a.dest)
        if peer is None or not self._same_incarnation(a, peer):  # it restarted while we waited for the fence
            return self._fail_write(a, "unknown_consumer", "consumer rank restarted since it registered", now)
        if self.cfg.mode == "pull":  # the one place push and pull part
            return self._grant(a, peer, now)
        return self._post_direct(a, peer, self._route_to(peer), t_post, fence_s, item.deadline, now)

    def _same_incarnation(self, a: StartWrite, peer: Peer) -> bool:
        """Block ids in a registration name memory of the process that sent it, never of its successor."""
        return self._reg_from.get((a.key, a.dest), peer.incarnation) == peer.incarnation

    def _route_to(self, peer: Peer):
        return next(r for r in self._routes(peer.tp_size) if r.dst_rank == peer.rank)

    def _prepare_peer(self, peer: Peer) -> None:
        """What posting to this consumer rank needs, set up once per handshake (a restarted rank's anew)."""
        if self.cfg.mode == "push":
            self._prepare_prepped(peer, (peer.engine_id, peer.rank))

    def _done_msg(self, key: TransferKey, nbytes: int, ndescs: int) -> WriteDone:
        return WriteDone(transfer_id=key.transfer_id, attempt=key.attempt, producer_engine=self.cfg.engine_id,
                         producer_rank=self.cfg.rank, nbytes=nbytes, num_descs=ndescs)

    def _poll_inflight(self) -> None:
        now = self.clock()
        actions: list = []
        for item in list(self._inflight):
            actions += self._polls[type(item)](item, now)
        self._run(actions, now)

