"""vLLM-neuron entry class: `"kv_connector": "KVPushNeuronConnector",
"kv_connector_module_path": "kvpush_neuron.connector"`.

It is KVPushConnector with the Neuron device backend bound: the plugin's KV tensors in HBM registered
as VRAM through NIXL LIBFABRIC/EFA, after the EFA preflight and the Neuron start-up checks.  Without
a Neuron host (torch-neuronx missing) it refuses to start with a clear message.

Block ids reach the core through `strip_block_sentinels` (BlockIdGuard): trailing padding (vLLM's
null block 0, the plugin's -1) is dropped, and a request whose ids have a sentinel before real
blocks, or an id out of range, moves no KV: its send is aborted (the decode side is told) and
reported finished so its blocks are freed; its receive is reported failed (vLLM then recomputes,
kv_load_failure_policy=recompute).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Callable

from kvpush_common.device.backend import DeviceBackend
from kvpush_common.vllm.connector import KVPushConnector
from kvpush_common.vllm.metadata import AbortOp, KVPushMetadata

from .kv_cache import BlockIdError

log = logging.getLogger(__name__)


class BlockIdGuard:
    """Rewrites each step's metadata with sentinel-free block ids and settles the requests it refuses."""

    REMEMBER_FINISHED = 4096  # finished request ids kept while a refused send may still wait for one

    def __init__(self, strip: Callable[[object], list[int]]):
        self._strip = strip
        self._failed_recvs: set[str] = set()
        self._refused_sends: set[str] = set()
        self._finished: OrderedDict[str, None] = OrderedDict()

    def filter(self, meta: KVPushMetadata) -> KVPushMetadata:
        out = KVPushMetadata(aborts=list(meta.aborts), declines=list(meta.declines))
        for op in meta.recvs:
            try:
                out.recvs.append(dataclasses.replace(op, block_ids=tuple(self._strip(op.block_ids))))
            except BlockIdError as e:
                log.warning("kvpush: not receiving %s (%s/%d): %s", op.req_id, op.transfer_id, op.attempt, e)
                self._failed_recvs.add(op.req_id)
        for op in meta.sends:
            try:
                out.sends.append(dataclasses.replace(op, block_ids=tuple(self._strip(op.block_ids))))
            except BlockIdError as e:
                log.warning("kvpush: not sending %s (%s/%d): %s", op.req_id, op.transfer_id, op.attempt, e)
                out.aborts.append(AbortOp(op.req_id, op.transfer_id, op.attempt, f"bad block ids on Neuron: {e}"))
                self._refused_sends.add(op.req_id)
        return out

    def settle(self, results, finished_req_ids: set[str]):
        """Add the refused requests to a KVConnectorTransferResults (mutated and returned).  A refused
        send is reported once vLLM has reported the request finished to this worker, as for any send."""
        if self._failed_recvs:
            results.finished_recving |= self._failed_recvs
            results.failed_recving |= self._failed_recvs
            self._failed_recvs = set()
        if self._refused_sends or self._finished:
            for r in finished_req_ids:
                self._finished[r] = None
            while len(self._finished) > self.REMEMBER_FINISHED:
                self._finished.popitem(last=False)
            ready = {r for r in self._refused_sends if r in self._finished}
            results.finished_sending |= ready
            self._refused_sends -= ready
            for r in ready:
                self._finished.pop(r, None)
            if not self._refused_sends:
                self._finished.clear()
        return results


class KVPushNeuronConnector(KVPushConnector):
    @staticmethod
    def runtime_factory():
        """The Neuron runtime of this worker (the tests substitute the simulated one)."""
        from .runtime import RealNeuronRuntime

        return RealNeuronRuntime()  # NeuronUnavailableError ("not available") off Neuron hosts

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._guard: BlockIdGuard | None = None

    def choose_transport(self, extra: dict):
        """Always LIBFABRIC (Neuron HBM registers only there), after the trn2 EFA preflight."""
        import os

        from .efa import neuron_transport

        return neuron_transport(extra, os.environ, same_host=bool(extra.get("same_host", True)))

    def make_backend(self, kv_caches: dict, head_offset: int) -> DeviceBackend:
        from .kv_cache import NeuronKVCache

        runtime = self.runtime_factory()
        adopt = getattr(runtime, "adopt", None)
        for cache in kv_caches.values():  # tensors on the device: the plugin's worker initialised the runtime
            if adopt is not None:
                adopt(cache[0] if isinstance(cache, (list, tuple)) else cache)
            break
        cfg = self._vllm_config
        backend = NeuronKVCache(kv_caches, head_offset, runtime=runtime, block_size=cfg.cache_config.block_size,
                                num_heads=self.local_kv_heads(), head_size=cfg.model_config.get_head_size())
        self._guard = BlockIdGuard(backend.block_ids)
        return backend

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPushMetadata)
        self._start_step(meta)

    def _start_step(self, meta: KVPushMetadata) -> None:
        """The step's block tables, sentinels stripped, to the core (only enqueues)."""
        if getattr(self, "_guard", None) is not None:
            meta = self._guard.filter(meta)
        self._worker.start_load_kv(meta)

    def get_transfer_results(self, finished_req_ids: set[str]):
        results = super().get_transfer_results(finished_req_ids)
        guard = getattr(self, "_guard", None)
        return guard.settle(results, finished_req_ids) if guard is not None else results
