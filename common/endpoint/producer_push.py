"""Producer, whole-request push: one NIXL WRITE per destination rank, its WriteDone notification riding on it.

The descriptors come from `plan_write`: where both sides' blocks have the same geometry, indices into per-peer
prepped descriptor lists (prepared once, at the peer's handshake), else per-request lists.  A posted WRITE is a
`DirectWrite` in the producer's in-flight list until NIXL reports it DONE or ERR, or its deadline passes.  Mixed
into `ProducerEndpoint`; its code runs on the producer's worker thread.
"""

from __future__ import annotations

import logging

from kvpush_common.endpoint.base import Peer
from kvpush_common.endpoint.transfers import DirectWrite, Settled
from kvpush_common.plan.blockplan import BlockPlan, block_granular, unit_table
from kvpush_common.plan.planner import PlanError
from kvpush_common.plan.write import plan_write
from kvpush_common.state.rendezvous import Dest, StartWrite
from kvpush_common.transport.nixl import TransportError

log = logging.getLogger("kvpush_common.endpoint.producer")


class DirectPushes:
    def _prepare_prepped(self, peer: Peer, dest: Dest) -> None:
        """Prep per-block descriptor lists for this consumer rank once, if the geometry allows it."""
        old = self._remote_prepped.pop(dest, None)
        if old is not None:  # the consumer rank restarted: its memory and agent are new
            try:
                self.transport.release_prepped(old[1])
            except TransportError as e:
                log.warning("releasing stale prepped list of %s: %s", peer.agent, e)
        route = self._route_to(peer)
        if not block_granular(self.layout, peer.layout, route):
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

    def _post_direct(self, a: StartWrite, peer: Peer, route, t_post: float, fence_s: float, deadline: float,
                     now: float) -> list:
        """Plan and post the WRITE of this destination's KV."""
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
        self._inflight.append(DirectWrite(a, t_post, deadline, plan.nbytes, handle))
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

    def _poll_direct(self, item: DirectWrite, now: float) -> list:
        state = self._settle(item.handle, now, item.deadline)
        if state is None:
            return []  # in flight (or past its deadline but not cancellable yet: keep polling)
        self._inflight.remove(item)
        self.event("write_" + ("done" if state is Settled.DONE else "failed"), item.key, state=state.value)
        if state is Settled.DONE:
            self.stats.writes_done.inc()
            self.stats.bytes_written.inc(item.nbytes)
            self.stats.xfer_seconds.observe(now - item.posted_at)
            return self.rendezvous.on_write_result(item.key, item.dest, True, now)
        code = "write_error" if state is Settled.ERR else "write_timeout"
        return self._fail_write(item.start, code, f"NIXL WRITE ended in {state.value}", now)
