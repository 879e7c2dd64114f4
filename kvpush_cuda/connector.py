"""vLLM entry class for GPUs: `"kv_connector": "KVPushCudaConnector",
"kv_connector_module_path": "kvpush_cuda.connector"`.

It is KVPushConnector with the CUDA device backend bound: vLLM's FlashAttention/FlashInfer KV
tensors registered as VRAM (at most 4 GiB per registration), the CUDA device bound on the NIXL
thread, and a CUDA event per step fencing each WRITE.
"""

from __future__ import annotations

from kvpush_common.device import DeviceBackend
from kvpush_common.vllm.connector import KVPushConnector


class KVPushCudaConnector(KVPushConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        if self._worker is not None:  # pick UCX or LIBFABRIC (after the EFA preflight) before NIXL starts
            import dataclasses
            import os

            import torch

            from .efa import choose_transport

            extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
            transport = choose_transport(extra, os.environ, gpus=max(1, torch.cuda.device_count()))
            self.settings = dataclasses.replace(self.settings, backend=transport.backend,
                                                backend_params=transport.backend_params)
            self._worker.settings = self.settings

    def make_backend(self, kv_caches: dict, head_offset: int) -> DeviceBackend:
        from .backend import CudaKVCache

        cfg = self._vllm_config
        heads = max(1, cfg.model_config.get_total_num_kv_heads() // cfg.parallel_config.tensor_parallel_size)
        return CudaKVCache(kv_caches, head_offset, block_size=cfg.cache_config.block_size, num_heads=heads,
                           head_size=cfg.model_config.get_head_size())
