"""Worker side of KVPushConnector (one per TP rank, in vLLM's worker process).

Per-step hooks only hand work to the kvpush endpoint's queues and drain its results; every NIXL
call happens on the endpoint's own worker thread.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable

from kvpush_common.endpoint.consumer import ConsumerEndpoint
from kvpush_common.device.backend import DeviceBackend
from kvpush_common.protocol.identity import TransferKey
from kvpush_common.endpoint.producer import ProducerEndpoint
from kvpush_common.state.rendezvous import Outcome, Release
from kvpush_common.protocol.topology import local_heads
from kvpush_common.vllm.compat import TransferResults
from kvpush_common.vllm.metadata import KVPushMetadata
from kvpush_common.vllm.settings import ConnectorSettings

log = logging.getLogger(__name__)

BackendFactory = Callable[[dict, int], DeviceBackend]
SLOW_HOOK_S = 50e-6  # a decode step's budget for kvpush's hook time (p99)


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, rank: int, make_backend: BackendFactory):
        self.settings = settings
        self.rank = rank
        self._make_backend = make_backend
        self.endpoint: ProducerEndpoint | ConsumerEndpoint | None = None
        self._req_of: dict[TransferKey, str] = {}
        self._sending: Counter[str] = Counter()  # producer: req id -> its sends not yet released
        self._finished_reqs: set[str] = set()  # producer: ids with a send, reported finished by the scheduler
        self._released: set[str] = set()  # producer: released but not yet reported finished by the scheduler
        self._finished_unsent: set[str] = set()  # named finished last step with no send known
        self._hooks: dict = {}  # hook name -> its kvpush_engine_hook_seconds child, once an endpoint is bound

    def register_kv_caches(self, kv_caches: dict) -> None:
        first, _ = local_heads(self.settings.total_kv_heads, self.settings.tp_size, self.rank)
        backend = self._make_backend(kv_caches, first)
        cfg = self.settings.endpoint_config(self.rank)
        cls = ProducerEndpoint if self.settings.role == "producer" else ConsumerEndpoint
        self._bind(cls(cfg, backend).start())
        if self.settings.metrics_port:
            from prometheus_client import start_http_server

            start_http_server(self.settings.metrics_port + self.rank, addr=self.settings.host,
                              registry=self.endpoint.stats.registry)
        where = f" on {self.endpoint.address[0]}:{self.endpoint.address[1]}" if cls is ProducerEndpoint else ""
        log.info("kvpush %s rank %d ready%s: %s", self.settings.role, self.rank, where, backend.layout().summary())

    def _bind(self, endpoint: ProducerEndpoint | ConsumerEndpoint) -> None:
        self.endpoint = endpoint
        self._hooks = {h: endpoint.stats.hook_seconds.labels(hook=h) for h in ("start_load_kv", "transfer_results")}

    def _timed(self, hook: str, started: float, meta: KVPushMetadata | None = None) -> None:
        ended = time.perf_counter()
        elapsed = ended - started
        histogram = self._hooks.get(hook)
        if histogram is not None:
            histogram.observe(elapsed)
        if elapsed > SLOW_HOOK_S and meta is not None and self.endpoint is not None:
            # which steps pass the goal (event log only): those handing a receive or send over, or others
            ops = (*meta.recvs, *meta.sends, *meta.aborts, *meta.declines)
            key = TransferKey(ops[0].transfer_id, ops[0].attempt) if ops else TransferKey("-", 0)
            self.endpoint.event("slow_hook", key, hook=hook, us=round(elapsed * 1e6, 1), recvs=len(meta.recvs),
                                sends=len(meta.sends),
                                other=len(meta.aborts) + len(meta.declines))

    def start_load_kv(self, meta: KVPushMetadata) -> None:
        started = time.perf_counter()
        try:
            self._hand_over(meta)
        finally:
            self._timed("start_load_kv", started, meta)

    def _hand_over(self, meta: KVPushMetadata) -> None:
        ep = self.endpoint
        for op in meta.recvs:
            key = TransferKey(op.transfer_id, op.attempt)
            self._req_of[key] = op.req_id
            ep.event("recv_staged", key)
            args = (op.transfer_id, op.attempt, op.producer, op.block_ids, op.num_tokens, op.first_token,
                    op.follow_address)
            ep.expect(*args)
        for op in meta.sends:
            self._req_of[TransferKey(op.transfer_id, op.attempt)] = op.req_id
            self._sending[op.req_id] += 1
            ep.event("send_staged", TransferKey(op.transfer_id, op.attempt))
            args = (op.transfer_id, op.attempt, op.block_ids, op.num_tokens, self.settings.kv_fence == "output",
                    op.consumer_tp)
            ep.kv_ready(*args)
        for op in meta.aborts:
            ep.abort(op.transfer_id, op.attempt, op.reason)
        for op in meta.declines:
            ep.decline(op.transfer_id, op.attempt, op.producer, op.reason)
        ep.engine_step()  # a consumer with keys waiting for bytes fetches its notifications now

    def transfer_results(self, finished_req_ids: set[str]) -> TransferResults:
        if self.endpoint is None:
            return TransferResults()
        started = time.perf_counter()
        try:
            return self._results(finished_req_ids)
        finally:
            self._timed("transfer_results", started)

    def _results(self, finished_req_ids: set[str]) -> TransferResults:
        out = TransferResults()
        # every request that finished is named here, on both roles; only those with a send are kept (until
        # released and reported), or a decode instance would hold every id it ever served.  An id whose send
        # is not known yet gets one more step (vLLM stages the send before it names the id finished).
        named = finished_req_ids | self._finished_unsent
        mine = {r for r in named if r in self._sending or r in self._released}
        self._finished_reqs |= mine
        self._finished_unsent = set(finished_req_ids) - mine
        for r in self.endpoint.take_finished():
            req_id = self._req_of.pop(r.key, None)
            if req_id is None:
                continue
            self.endpoint.event("reported", r.key)  # the engine learns of it here (per-step latency)
            if isinstance(r, Release):
                if r.outcome not in (Outcome.DONE, Outcome.UNNEEDED):
                    log.warning("kvpush send %s (%s) ended %s: %s", req_id, r.key, r.outcome.value, r.reason)
                self._released.add(req_id)
                self._sending[req_id] -= 1
                if self._sending[req_id] <= 0:
                    del self._sending[req_id]
            else:
                out.finished_recving.add(req_id)
                if not r.ok:
                    log.warning("kvpush recv %s (%s) failed: %s", req_id, r.key, r.reason)
                    out.failed_recving.add(req_id)
        # vLLM wants finished sends only for ids it already reported finished to this worker
        ready = self._released & self._finished_reqs
        out.finished_sending |= ready
        self._released -= ready
        self._finished_reqs -= ready
        return out

    def shutdown(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
