"""vLLM's CUDA KV cache tensors described for kvpush (FlashAttention and FlashInfer layouts).

Per layer vLLM keeps one 5-D tensor: FlashAttention `(2, num_blocks, block_size, heads, head_size)`
(K plane, V plane), FlashInfer `(num_blocks, 2, block_size, heads, head_size)` (K and V of a block
side by side).  Inside a block the physical order is NHD, or HND when the KV cache layout says so
(then the logical block_size and heads dims carry permuted strides).  Everything is read from shapes
and strides and checked; an unknown arrangement is refused with the reason.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from kvpush_common.layout import KVLayout, LayoutError, Region
from kvpush_common.vllm.tensor_staging import TensorStagingMixin

from .device import CudaDevice, sliced_registrations


def _layer_order(name: str) -> tuple:
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name))


def describe_cuda_caches(kv_caches: dict[str, torch.Tensor], *, block_size: int, num_heads: int, head_size: int,
                         head_offset: int = 0) -> tuple[KVLayout, list[tuple[int, int]], int]:
    """(layout, allocations [(ptr, nbytes)], device index) of vLLM's per-layer KV tensors."""
    names = sorted(kv_caches, key=_layer_order)
    t0 = kv_caches[names[0]]
    if t0.dim() != 5:
        raise LayoutError(f"expected 5-D KV tensors, got shape {tuple(t0.shape)} for {names[0]}")
    shape, stride, e = tuple(t0.shape), t0.stride(), t0.element_size()
    if shape[0] == 2 and shape[2:] in ((block_size, num_heads, head_size),):
        kv_dim, blk_dim = 0, 1  # FlashAttention
    elif shape[1] == 2 and shape[2:] == (block_size, num_heads, head_size):
        kv_dim, blk_dim = 1, 0  # FlashInfer
    else:
        raise LayoutError(f"KV tensor shape {shape} is neither (2, blocks, {block_size}, {num_heads}, {head_size}) "
                          f"nor (blocks, 2, {block_size}, {num_heads}, {head_size})")
    s_tok, s_head, s_dim = stride[2], stride[3], stride[4]
    if s_dim != 1:
        raise LayoutError(f"head_size is not the innermost dimension (strides {stride})")
    if (s_tok, s_head) == (num_heads * head_size, head_size):
        order = "NHD"
    elif (s_tok, s_head) == (head_size, block_size * head_size):
        order = "HND"
    else:
        raise LayoutError(f"block interior is neither NHD nor HND packed (strides {stride})")
    block_elems = block_size * num_heads * head_size
    if stride[blk_dim] < block_elems or stride[kv_dim] < block_elems:
        raise LayoutError(f"blocks or K/V planes overlap (strides {stride})")
    regions, allocations = [], {}
    for name in names:
        t = kv_caches[name]
        if tuple(t.shape) != shape or t.stride() != stride or t.dtype != t0.dtype or t.device != t0.device:
            raise LayoutError(f"KV tensor {name} differs from {names[0]} in shape, stride, dtype or device")
        st = t.untyped_storage()
        allocations[st.data_ptr()] = st.nbytes()
        base = t.data_ptr()
        for plane in range(2):
            regions.append(Region(base=base + plane * stride[kv_dim] * e, block_stride=stride[blk_dim] * e))
    device = t0.device.index or 0
    layout = KVLayout(num_layers=len(names), num_heads=num_heads, head_dim=head_size, dtype_size=e,
                      dtype=str(t0.dtype).removeprefix("torch."), block_size=block_size, num_blocks=shape[blk_dim],
                      order=order, regions=regions, mem_type="VRAM" if t0.is_cuda else "DRAM",
                      head_offset=head_offset).validate()
    return layout, sorted(allocations.items()), device


class CudaKVCache(TensorStagingMixin, CudaDevice):
    """vLLM's CUDA KV caches as a kvpush DeviceBackend (VRAM, registrations of at most 4 GiB)."""

    name = "cuda"

    def __init__(self, kv_caches: dict[str, torch.Tensor], head_offset: int, *, block_size: int, num_heads: int,
                 head_size: int):
        layout, allocations, device = describe_cuda_caches(kv_caches, block_size=block_size, num_heads=num_heads,
                                                           head_size=head_size, head_offset=head_offset)
        super().__init__(device)
        self._kv_caches = kv_caches
        self._layout, self._regs = sliced_registrations(layout, allocations, device)

    def layout(self) -> KVLayout:
        return self._layout

    def registration_regions(self) -> np.ndarray:
        return self._regs
