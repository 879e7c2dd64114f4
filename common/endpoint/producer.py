"""Producer (prefill) rank: serves handshakes, matches registrations with ready KV, posts WRITEs.

In pull mode (`EndpointConfig.mode == "pull"`) the match sends a ReadGrant instead of posting: the
consumer READs, and the source blocks stay pinned until its ReadResult or the grant's deadline.

Engine thread: `kv_ready`, `abort`, `take_finished` only enqueue or drain.  The worker thread owns
NIXL: it decodes registrations, runs the rendezvous, plans descriptors, posts one WRITE per
destination rank with a WriteDone notification riding on it, polls completion, and sends
WriteFailed whenever a destination will not be (fully) written.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from kvpush_common.plan.blockplan import BlockPlan, block_granular, block_runs, descs_per_run, unit_table
from kvpush_common.plan.write import plan_write
from kvpush_common.endpoint.base import Endpoint, Peer
from kvpush_common.endpoint.handshake import HandshakeServer
from kvpush_common.endpoint.inbox import ConsumerHello, KVReady, LocalAbort, block_ids_as_ints
from kvpush_common.endpoint.transfers import AwaitingFence, DirectWrite, ReadPin, StagedPush, Transfer
from kvpush_common.protocol.identity import TransferKey
from kvpush_common.plan.planner import PlanError, plan_transfer
from kvpush_common.plan.staging import LentSlots, StagedWrite, blocks_per_chunk, staged_pairs, unit_bytes, whole_block_units
from kvpush_common.state.rendezvous import Dest, Outcome, ReadyKV, Release, Rendezvous, SendFailed, SendRevokeAck, StartWrite
from kvpush_common.protocol.topology import routes_from
from kvpush_common.transport.nixl import TransportError
from kvpush_common.protocol.wire import (ChunkWritten, Heartbeat, Hello, ReadGrant, ReadResult, Register, Revoke, RevokeAck, SlotFree, Staging,
                   Unneeded, WriteDone, WriteFailed)

log = logging.getLogger(__name__)


class ProducerEndpoint(Endpoint):
    role = "producer"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rendezvous = Rendezvous(expected_dests=self._expected_dests, lease_s=self.cfg.lease_s,
                                     tombstone_s=self.cfg.tombstone_s)
        self._inflight: list[Transfer] = []  # one per (request, consumer rank) being written or read
        self._polls = {AwaitingFence: self._poll_fence, DirectWrite: self._poll_direct, StagedPush: self._advance_staged,
                       ReadPin: self._poll_pin}
        self.server: HandshakeServer | None = None
        self._local_prepped: dict[tuple[int, int], object] = {}  # (head_start, num_heads) -> prepped list
        self._remote_prepped: dict[Dest, tuple[object, object]] = {}  # consumer rank -> (local, remote) lists
        self._ready_at: dict[TransferKey, float] = {}
        self._peer_slots: dict[Dest, LentSlots] = {}  # staging slots each consumer rank lent us
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

    def local_hello(self, staging: Staging | None = None) -> Hello:
        """Our Hello says whether we can gather into staging (its address means nothing to the peer)."""
        if staging is None and self.staging is not None:
            staging = Staging(0, self.staging.size * self.staging.chunk_bytes, self.staging.device_id,
                              self.staging.chunk_bytes)
        return super().local_hello(staging)

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
        if isinstance(msg, (Register, Revoke, Unneeded, Heartbeat, ReadResult, SlotFree)):
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
            for dest, slots in self._peer_slots.items():  # slots whose SlotFree was lost come back
                if n := slots.reclaim(now):
                    self.stats.slots_reclaimed.inc(n)
                    log.warning("took back %d staging slots of %s whose SlotFree never came", n, dest)
            self._reg_from = {k: v for k, v in self._reg_from.items() if self.rendezvous.entry_state(k[0]) is not None}
        if now >= self._next_evict:
            self._evict_idle(now, {i.dest for i in self._inflight})
        # registrations waiting for their KV need no poll: the engine's kv_ready wakes the worker.  Ready KV
        # waiting for a registration (it comes as a notification), or work in flight, does.
        return bool(self._inflight) or self.rendezvous.has_ready()

    def _poll_period(self, busy: bool) -> float:
        if any(isinstance(i, (DirectWrite, StagedPush)) for i in self._inflight):
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
        key = TransferKey(msg.transfer_id, msg.attempt) if not isinstance(msg, (Heartbeat, SlotFree)) else None
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
        if isinstance(msg, SlotFree):
            slots = self._peer_slots.get(dest)
            try:
                if slots is None:
                    raise ValueError("no staging slots lent by this consumer rank")
                slots.give(msg.slot, msg.use or None)
            except ValueError as e:
                self.stats.rejected_msgs.labels(reason="bad_slot").inc()
                log.warning("ignored SlotFree from %s: %s", peer.agent, e)
            return []
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
        if self.cfg.mode == "pull":
            return self._grant(a, peer, now)
        route = self._route_to(peer)
        staged = self._staged_plan(a, peer, route)
        if staged is not None:
            self.stats.stage_seconds.labels(stage="fence").observe(fence_s)
            push = StagedPush(a, t_post, item.deadline, staged.src_blocks.size * staged.nbytes_per_block, staged)
            self._inflight.append(push)
            self.event("posted", a.key, consumer_rank=peer.rank, nbytes=push.nbytes, descs=staged.chunks, staged=True)
            self.stats.writes_posted.inc()
            self.stats.writes_staged.inc()
            return self._advance_staged(push, now)
        prepped = self._remote_prepped.get(a.dest)
        try:
            plan = plan_write(self.layout, peer.layout, route, a.ready.block_ids, a.reg.block_ids,
                              num_tokens=a.ready.num_tokens, dst_first_token=a.reg.first_token,
                              prepped=prepped is not None)
        except PlanError as e:
            return self._fail_write(a, "bad_registration", str(e), now)
        notif = self.codec.encode(self._done_msg(a.key, plan.nbytes, plan.num_descs))
        t_planned = self.clock()
        try:
            if isinstance(plan, BlockPlan):
                handle = self.transport.post_prepped("WRITE", prepped[0], plan.local_idx, prepped[1],
                                                     plan.remote_idx, notif)
            else:
                handle = self.transport.post("WRITE", peer.agent, plan.src, plan.dst, self.layout.mem_type,
                                             peer.layout.mem_type, notif)
        except TransportError as e:
            return self._fail_write(a, "post_failed", str(e), now)
        t_posted = self.clock()
        self._inflight.append(DirectWrite(a, t_post, item.deadline, plan.nbytes, handle))
        stages = {"fence": fence_s, "plan": t_planned - t_post, "post": t_posted - t_planned}
        for stage, seconds in stages.items():
            self.stats.stage_seconds.labels(stage=stage).observe(seconds)
        self.event("posted", a.key, consumer_rank=peer.rank, nbytes=plan.nbytes, descs=plan.num_descs,
                   from_token=a.reg.first_token,
                   **{f"{stage}_ms": round(seconds * 1e3, 3) for stage, seconds in stages.items()})
        self.stats.writes_posted.inc()
        if isinstance(plan, BlockPlan):
            self.stats.writes_prepped.inc()
        self.stats.descs_posted.inc(plan.num_descs)
        self.stats.post_seconds.observe(self.clock() - t_post)
        return []

    def _same_incarnation(self, a: StartWrite, peer: Peer) -> bool:
        """Block ids in a registration name memory of the process that sent it, never of its successor."""
        return self._reg_from.get((a.key, a.dest), peer.incarnation) == peer.incarnation

    def _grant(self, a: StartWrite, peer: Peer, now: float) -> list:
        """Pull mode: the KV is complete; let the consumer READ it.  Pinned until its ReadResult, or
        until write_timeout_s + fence_grace_s (the consumer gives up its READ after write_timeout_s)."""
        grant = ReadGrant(transfer_id=a.key.transfer_id, attempt=a.key.attempt, producer_engine=self.cfg.engine_id,
                          producer_rank=self.cfg.rank, block_ids=list(a.ready.block_ids),
                          num_tokens=a.ready.num_tokens)
        if not self._send(peer, grant):
            return self._fail_write(a, "post_failed", "could not send the read grant", now)
        self._inflight.append(ReadPin(a, now, now + self.cfg.write_timeout_s + self.cfg.fence_grace_s))
        self.stats.writes_posted.inc()
        self.event("granted", a.key, consumer_rank=peer.rank)
        return []

    def _on_read_result(self, key: TransferKey, dest: Dest, msg: ReadResult, now: float) -> list:
        item = next((i for i in self._inflight if isinstance(i, ReadPin) and i.key == key and i.dest == dest), None)
        if item is None:
            return []  # duplicate, or after the grant's deadline (already failed)
        self._inflight.remove(item)
        self.event("read_" + ("done" if msg.ok else "failed"), key, consumer_rank=dest[1])
        if msg.ok:
            self.stats.writes_done.inc()
            self.stats.xfer_seconds.observe(now - item.posted_at)
            return self.rendezvous.on_write_result(key, dest, True, now)
        self.stats.writes_failed.labels(code="read_failed").inc()
        return self.rendezvous.on_write_result(key, dest, False, now)

    def _route_to(self, peer: Peer):
        return next(r for r in self._routes(peer.tp_size) if r.dst_rank == peer.rank)

    def _prepare_peer(self, peer: Peer) -> None:
        """Prep per-block descriptor lists for this consumer rank once, if the geometry allows it."""
        dest = (peer.engine_id, peer.rank)
        self._peer_slots.pop(dest, None)  # a restarted consumer lends new slots (in-flight chunks keep theirs)
        if self.staging is not None and peer.staging is not None and peer.staging.nbytes >= peer.staging.chunk_bytes:
            self._peer_slots[dest] = LentSlots(peer.staging.addr, peer.staging.nbytes, peer.staging.chunk_bytes,
                                              peer.staging.device_id)
        old = self._remote_prepped.pop(dest, None)
        if old is not None:  # the consumer rank restarted: its memory and agent are new
            try:
                self.transport.release_prepped(old[1])
            except TransportError as e:
                log.warning("releasing stale prepped list of %s: %s", peer.agent, e)
        route = self._route_to(peer)
        if self.cfg.mode == "pull" or not (self.cfg.prepped_lists and block_granular(self.layout, peer.layout, route)):
            return
        try:
            hk = (route.src_head_start, route.num_heads)
            if hk not in self._local_prepped:
                self._local_prepped[hk] = self.transport.prep(None, unit_table(self.layout, *hk), self.layout.mem_type)
            remote = self.transport.prep(peer.agent, unit_table(peer.layout, route.dst_head_start, route.num_heads),
                                         peer.layout.mem_type)
            self._remote_prepped[dest] = (self._local_prepped[hk], remote)
        except TransportError as e:
            log.warning("prepped lists for %s unavailable, using per-request lists: %s", peer.agent, e)

    # ---- staged pushes -------------------------------------------------------------------------------
    def _staged_plan(self, a: StartWrite, peer: Peer, route) -> StagedWrite | None:
        """A staged push when both sides offered staging, the route moves whole blocks, and the direct
        plan would post at least staging_min_descs descriptors; else None (direct)."""
        slots = self._peer_slots.get(a.dest)
        if slots is None or self.staging is None or not whole_block_units(self.layout, peer.layout, route):
            return None
        if not (slots.free and self.staging.free):  # pool exhausted: do not queue behind it, go direct
            self.stats.staging_exhausted.inc()
            return None
        try:
            s, d = staged_pairs(self.layout, peer.layout, a.ready.block_ids, a.reg.block_ids,
                                num_tokens=a.ready.num_tokens, dst_first_token=a.reg.first_token)
            order = np.argsort(s, kind="stable")
            runs = block_runs(s[order], d[order])[0].size
            if descs_per_run(self.layout, peer.layout, route) * runs < self.cfg.staging_min_descs:
                return None
            per_chunk = blocks_per_chunk(self.layout, min(self.staging.chunk_bytes, slots.chunk_bytes))
        except PlanError:
            return None  # the direct path reports the same error
        return StagedWrite(s, per_chunk, len(self.layout.regions) * unit_bytes(self.layout))

    def _advance_staged(self, item: StagedPush, now: float) -> list:
        """Poll the chunk WRITEs, gather and post the next chunks while slots are free, finish or fail."""
        st, peer, slots = item.plan, self._peers.get(item.dest), self._peer_slots.get(item.dest)
        for entry in list(st.inflight):
            handle, local, remote, pool = entry
            state = self._settle(handle, now, item.deadline)
            if state is None:
                continue  # in flight (or past its deadline but not cancellable yet)
            st.inflight.remove(entry)
            self.staging.give(local)
            if state == "DONE":
                st.done_chunks += 1
                pool.landed(remote, now, self.cfg.write_timeout_s + self.cfg.fence_grace_s)
            else:  # never landed: the consumer will not free this slot, so it comes back here
                pool.give(remote)
                st.failed = st.failed or ("chunk WRITE ended in ERR" if state == "ERR" else "chunk WRITE timed out")
        if now >= item.deadline:
            st.failed = st.failed or "staged transfer timed out"
        if peer is None or slots is None:
            st.failed = st.failed or "consumer rank gone"
        while not st.failed and st.next_chunk < st.chunks:
            local = self.staging.take()
            remote = slots.take() if local is not None else None
            if remote is None:  # back-pressure: wait for our WRITEs or the consumer's SlotFree
                if local is not None:
                    self.staging.give(local)
                break
            first, count = st.span(st.next_chunk)
            nbytes = count * st.nbytes_per_block
            try:
                self.backend.gather(st.src_blocks[first:first + count], self.staging.slot_addr(local))
                notif = self.codec.encode(ChunkWritten(
                    transfer_id=item.key.transfer_id, attempt=item.key.attempt, producer_engine=self.cfg.engine_id,
                    producer_rank=self.cfg.rank, chunk=st.next_chunk, chunks=st.chunks, slot=remote, first=first,
                    count=count, use=slots.use_of(remote)))
                handle = self.transport.post(
                    "WRITE", peer.agent, np.array([[self.staging.slot_addr(local), nbytes, self.staging.device_id]], np.uint64),
                    np.array([[slots.slot_addr(remote), nbytes, slots.device_id]], np.uint64),
                    self.layout.mem_type, peer.layout.mem_type, notif)
            except Exception as e:  # gather or post failed: nothing of this chunk was sent
                self.staging.give(local)
                slots.give(remote)
                st.failed = f"chunk {st.next_chunk} not posted: {e}"
                break
            st.inflight.append((handle, local, remote, slots))
            st.next_chunk += 1
        if st.inflight:
            return []
        if st.failed:
            self._inflight.remove(item)
            self.event("write_failed", item.key, state="staged")
            return self._fail_write(item.start, "write_timeout" if "timed out" in st.failed else "write_error",
                                    st.failed, now)
        if st.done_chunks == st.chunks:
            self._inflight.remove(item)
            self.event("write_done", item.key, state="DONE", staged=True)
            self.stats.writes_done.inc()
            self.stats.bytes_written.inc(item.nbytes)
            self.stats.xfer_seconds.observe(now - item.posted_at)
            return self.rendezvous.on_write_result(item.key, item.dest, True, now)
        return []

    def _done_msg(self, key: TransferKey, nbytes: int, ndescs: int) -> WriteDone:
        return WriteDone(transfer_id=key.transfer_id, attempt=key.attempt, producer_engine=self.cfg.engine_id,
                         producer_rank=self.cfg.rank, nbytes=nbytes, num_descs=ndescs)

    def _poll_inflight(self) -> None:
        now = self.clock()
        actions: list = []
        for item in list(self._inflight):
            actions += self._polls[type(item)](item, now)
        self._run(actions, now)

    def _poll_pin(self, item: ReadPin, now: float) -> list:
        if now < item.deadline:
            return []
        self._inflight.remove(item)  # the consumer's READ bound has passed: unpin
        return self._fail_write(item.start, "read_timeout", "no ReadResult before the deadline", now)

    def _poll_direct(self, item: DirectWrite, now: float) -> list:
        state = self._settle(item.handle, now, item.deadline)
        if state is None:
            return []  # in flight (or past its deadline but not cancellable yet: keep polling)
        self._inflight.remove(item)
        self.event("write_" + ("done" if state == "DONE" else "failed"), item.key, state=state)
        if state == "DONE":
            self.stats.writes_done.inc()
            self.stats.bytes_written.inc(item.nbytes)
            self.stats.xfer_seconds.observe(now - item.posted_at)
            return self.rendezvous.on_write_result(item.key, item.dest, True, now)
        code = "write_error" if state == "ERR" else "write_timeout"
        return self._fail_write(item.start, code, f"NIXL WRITE ended in {state}", now)
