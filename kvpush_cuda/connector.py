"""vLLM entry class for GPUs: `"kv_connector": "KVPushCudaConnector",
"kv_connector_module_path": "kvpush_cuda.connector"`.

It is KVPushConnector with the CUDA device backend bound: vLLM's CUDA KV tensors (every form in
`kv_forms`: FlashAttention, FlashInfer, Triton; 5-D or packed 4-D) registered as VRAM (at most 4 GiB
per registration; a cross-layer cache, `cross_layer_blocks`, whole over UCX), the CUDA device bound on the NIXL thread, and a CUDA event per step fencing each
WRITE.  A form it cannot read fails the start-up, naming shape, strides and attention backend.
"""

from __future__ import annotations

import logging

from kvpush_common.device.backend import DeviceBackend
from kvpush_common.vllm import compat
from kvpush_common.vllm.connector import KVPushConnector

log = logging.getLogger(__name__)


class KVPushCudaConnector(KVPushConnector):
    @classmethod
    def asks_cross_layer(cls, settings) -> bool:
        """By default (`cross_layer_blocks` unset) for whole-request transfers over UCX (ConnectorSettings says why).
        vLLM >= 0.29 then gets BLHNC from `get_required_kvcache_layout` and grants it only where every attention
        backend supports it (FlashAttention, Triton and FlashInfer declare no restriction, FlexAttention LBNHC
        only: vllm/v1/attention/backends/*.py `supported_kv_cache_layouts`, 0.32 and 0.33)."""
        return settings.wants_cross_layer_blocks()

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """vLLM 0.26-0.28: ask for the cross-layer cache only where each layer's view stays a kvpush layout: block,
        then layer, outermost (FlashAttention NHD).  Heads outside the layers (HND) would fail the start-up instead."""
        if not super().prefer_cross_layer_blocks:
            return False
        orders = cross_layer_stride_orders(self._vllm_config)
        if orders is not None and len(orders) == 1 and next(iter(orders))[:2] == (1, 0):
            return True
        if self.settings.cross_layer_blocks:  # asked for explicitly: say why not
            log.info("kvpush: not asking vLLM for its cross-layer KV cache: the attention backend's stride order "
                     "with layers %s does not put each block's layers outermost", sorted(orders or ()))
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config):
        """vLLM >= 0.34: by the NIXL backend the workers will choose (`efa.backend_name`, as `choose_transport` does
        before its preflight): over UCX vLLM's extensible KV cache may hold the registered cache, as it does under
        its own NixlConnector; over LIBFABRIC it must not (`compat.kv_cache_access` says why each)."""
        from .efa import backend_name

        return compat.kv_cache_access(backend_name(kv_transfer_config.kv_connector_extra_config or {}))

    def choose_transport(self, extra: dict):
        """UCX, or LIBFABRIC after the EFA preflight (the default where the host has EFA devices).  LIBFABRIC is
        refused under vLLM's extensible KV cache (CUDA VMM memory, on which the EFA provider fails RMA:
        ofiwg/libfabric#12853); `kv_cache_access` keeps that cache off, so only an explicit request reaches this."""
        import os

        import torch

        from .efa import backend_name, choose_transport

        if backend_name(extra) == "LIBFABRIC" and compat.extensible_kv_cache(self._vllm_config):
            raise ValueError("kvpush over LIBFABRIC (EFA) cannot use vLLM's extensible KV cache: it is CUDA VMM "
                             "memory, on which libfabric's EFA provider fails RMA (ofiwg/libfabric#12853); start "
                             "vLLM with --no-enable-extensible-kv-cache")
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
                           whole_interleaved=self.settings.backend == "UCX", **self.layout_facts(kv_caches))


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


def cross_layer_stride_orders(vllm_config) -> set[tuple[int, ...]] | None:
    """The physical dim order, layers dim included, of every attention backend of the model, as vLLM's cross-layer
    allocation would use it (None: this vLLM cannot say)."""
    try:
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        with set_current_vllm_config(vllm_config):
            return {tuple(b.get_kv_cache_stride_order(include_num_layers_dimension=True))
                    for b in get_current_attn_backends(vllm_config)}
    except Exception:  # noqa: BLE001 - an older vLLM, or a backend without a layered order: no cross-layer cache
        return None
