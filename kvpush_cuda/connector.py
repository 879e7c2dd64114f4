"""vLLM entry class for GPUs: `"kv_connector": "KVPushCudaConnector",
"kv_connector_module_path": "kvpush_cuda.connector"`.

It is KVPushConnector with the CUDA device backend bound: vLLM's CUDA KV tensors (every form in
`kv_forms`: FlashAttention, FlashInfer, Triton; 5-D or packed 4-D) registered as VRAM (at most 4 GiB
per registration; a cross-layer cache, `cross_layer_blocks`, whole over UCX), the CUDA device bound on the NIXL thread, and a CUDA event per step fencing each
WRITE.  A form it cannot read fails the start-up, naming shape, strides and attention backend.
"""

from __future__ import annotations

from kvpush_common.device.backend import DeviceBackend
from kvpush_common.vllm.connector import KVPushConnector


class KVPushCudaConnector(KVPushConnector):
    def choose_transport(self, extra: dict):
        """UCX, or LIBFABRIC after the EFA preflight (the default where the host has EFA devices)."""
        import os

        import torch

        from .efa import choose_transport

        return choose_transport(extra, os.environ, gpus=max(1, torch.cuda.device_count()))

    def make_backend(self, kv_caches: dict, head_offset: int) -> DeviceBackend:
        import torch

        from kvpush_common.protocol.layout import LayoutError

        from .kv_cache import CudaKVCache

        first = next(iter(kv_caches.values()), None)
        if isinstance(first, torch.Tensor) and not first.is_cuda:
            raise LayoutError(f"KVPushCudaConnector got KV tensors on {first.device}: on vLLM's CPU build use "
                              "KVPushConnector (kvpush_common.vllm.connector), whose layout reader knows the CPU cache")
        cfg = self._vllm_config
        return CudaKVCache(kv_caches, head_offset, block_size=cfg.cache_config.block_size, num_heads=self.local_kv_heads(),
                           head_size=cfg.model_config.get_head_size(), backends=attention_backends(cfg, kv_caches),
                           # the 4 GiB cap is for EFA registrations; over UCX a cross-layer cache registers whole
                           whole_interleaved=self.settings.backend == "UCX")


def attention_backends(vllm_config, layer_names) -> dict[str, str]:
    """Each layer's attention backend name (vLLM's static forward context), for start-up errors only."""
    ctx = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    out = {}
    for name in layer_names:
        backend = getattr(ctx.get(name), "attn_backend", None)
        try:
            out[name] = backend.get_name() if backend is not None else "unknown"
        except Exception:
            out[name] = getattr(backend, "__name__", "unknown")
    return out
