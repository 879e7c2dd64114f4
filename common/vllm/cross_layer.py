"""vLLM's cross-layer KV cache seen as per-layer views, so every device backend reads it as it reads per-layer caches.

With `prefer_cross_layer_blocks` (setting `cross_layer_blocks`), vLLM (CUDA builds since 0.26; FlashAttention,
FlashInfer, Triton; one uniform attention group) allocates one tensor for all layers whose physical order puts
the block outermost, e.g. FlashAttention NHD `(blocks, layers, block_size, heads, 2 * head_size)`, and calls
`register_cross_layers_kv_cache` instead of `register_kv_caches`.  Each layer's view, taken as vLLM takes it
(`allocate_uniform_kv_caches`: undo the stride order, index the layer), is an ordinary per-layer tensor whose
block stride spans every layer; the layout reader then sees regions that interleave, and the planner merges a
run of consecutive blocks across all layers into one descriptor.
"""

from __future__ import annotations

from kvpush_common.protocol.layout import LayoutError


def cross_layer_views(kv_cache, attn_backend, kv_cache_config) -> dict:
    """{layer name: that layer's view of `kv_cache`} (the tensor vLLM hands `register_cross_layers_kv_cache`)."""
    tensors = list(getattr(kv_cache_config, "kv_cache_tensors", None) or [])
    try:
        order = tuple(attn_backend.get_kv_cache_stride_order(include_num_layers_dimension=True))
    except (AttributeError, NotImplementedError, TypeError):
        order = tuple(range(kv_cache.dim()))
    if sorted(order) != list(range(kv_cache.dim())):
        raise LayoutError(f"cross-layer KV cache of shape {tuple(kv_cache.shape)}: stride order {order} of "
                          f"{getattr(attn_backend, '__name__', attn_backend)} does not permute its dims")
    logical = kv_cache.permute(*[order.index(i) for i in range(len(order))])  # (layers, *one layer's logical dims)
    if not tensors or logical.shape[0] != len(tensors):
        raise LayoutError(f"cross-layer KV cache of shape {tuple(kv_cache.shape)} holds {logical.shape[0]} layers, "
                          f"the KV cache config lists {len(tensors)} tensors")
    return {name: logical[i] for i, t in enumerate(tensors) for name in t.shared_by}
