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
    def make_backend(self, kv_caches: dict, head_offset: int) -> DeviceBackend:
        from .backend import CudaKVCache

        cfg = self._vllm_config
        heads = max(1, cfg.model_config.get_total_num_kv_heads() // cfg.parallel_config.tensor_parallel_size)
        return CudaKVCache(kv_caches, head_offset, block_size=cfg.cache_config.block_size, num_heads=heads,
                           head_size=cfg.model_config.get_head_size())
