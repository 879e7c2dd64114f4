"""vLLM's CPU KV cache tensors described as a kvpush DeviceBackend.

vLLM's CPU attention keeps one tensor per layer shaped [num_blocks, num_kv_heads, block_size,
2 * head_size] (layout LBHNC): each (block, head) row block holds that head's K rows then its V rows.
kvpush describes it as one region per layer (`kv_planes=1`) whose rows are not tokens
(`token_rows=False`), and moves whole blocks.
"""

from __future__ import annotations


import numpy as np
import torch

from kvpush_common.device.backend import DeviceBackend
from kvpush_common.protocol.layout import KVLayout, LayoutError, Region, layer_order


def describe_cpu_caches(kv_caches: dict[str, torch.Tensor], head_offset: int, *, cache_dtype: str = "auto",
                        kv_scales: str = "", latent: bool = False, drafter: str = "") -> tuple[KVLayout, np.ndarray]:
    """`latent`: MLA's cache, [blocks, 1, block_size, latent width] (one row per token: addressable by token)."""
    names = sorted(kv_caches, key=layer_order)
    first = kv_caches[names[0]]
    if first.dim() != 4 or first.device.type != "cpu":
        raise LayoutError(f"expected 4-D CPU KV tensors [blocks, heads, block_size, 2*head_size], got "
                          f"{tuple(first.shape)} on {first.device}")
    nb, nh, bs, row = first.shape
    e = first.element_size()
    want = (nh * bs * row, bs * row, row, 1)
    if any(got != w for i, (got, w) in enumerate(zip(first.stride(), want)) if not (i == 1 and nh == 1)):  # a size-1
        # dim's stride is arbitrary: MLA's one latent head comes as (blocks, 1, block_size, 576) strided (9216, 576, ...)
        raise LayoutError(f"KV tensor {names[0]} is not packed block-major (strides {first.stride()})")
    storages: dict[int, int] = {}
    regions = []
    for name in names:
        t = kv_caches[name]
        if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
            raise LayoutError(f"KV tensor {name} differs from {names[0]} in shape, stride or dtype")
        st = t.untyped_storage()
        mem_id = storages.setdefault(st.data_ptr(), len(storages))
        regions.append(Region(base=t.data_ptr(), block_stride=nh * bs * row * e, mem_id=mem_id, device_id=0))
    layout = KVLayout(num_layers=len(names), num_heads=nh, head_dim=row, dtype_size=e,
                      dtype=str(first.dtype).removeprefix("torch."), block_size=bs, num_blocks=nb, order="HND",
                      regions=regions, mem_type="DRAM", head_offset=head_offset, kv_planes=1,
                      token_rows=latent, cache_dtype=cache_dtype, kv_scales=kv_scales, latent=latent,
                      drafter=drafter).validate()
    seen, regs = set(), []
    for name in names:
        st = kv_caches[name].untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            regs.append([st.data_ptr(), st.nbytes(), 0])
    return layout, np.array(regs, dtype=np.uint64)


class VllmCpuCache(DeviceBackend):
    name = "vllm-cpu"

    def __init__(self, kv_caches: dict[str, torch.Tensor], head_offset: int, **facts):
        self._kv_caches = kv_caches  # keep the tensors (and their memory) alive
        self._layout, self._regions = describe_cpu_caches(kv_caches, head_offset, **facts)

    def layout(self) -> KVLayout:
        return self._layout

    def registration_regions(self) -> np.ndarray:
        return self._regions
