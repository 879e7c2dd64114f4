"""vLLM's CUDA KV cache tensors described for kvpush (every form in `kv_forms`).

The 5-D forms become a K plane and a V plane per layer (`kv_planes=2`); vLLM >= 0.26's packed form,
whose (token, head) rows hold K then V, becomes one region per layer with `head_dim = 2 * head_size`
(`kv_planes=1`, token rows: any token and head stays addressable, so block-size mapping and head
slices for heterogeneous TP work as for the 5-D forms).  MLA's latent forms become one region per layer of one
head (`latent=True`, `head_dim` = the latent width): topology replicates that head, so each consumer rank takes
the whole latent from one producer rank.
"""

from __future__ import annotations

import numpy as np
import torch

from kvpush_common.protocol.layout import KVLayout, LayoutError, Region, layer_order

from .device import CudaDevice, sliced_registrations
from .kv_forms import describe_form


def describe_cuda_caches(kv_caches: dict, *, block_size: int, num_heads: int, head_size: int, head_offset: int = 0,
                         backends: dict[str, str] | None = None, cache_dtype: str = "auto", kv_scales: str = "",
                         latent: bool = False, drafter: str = "") -> tuple[KVLayout, list[tuple[int, int]], int]:
    """(layout, allocations [(ptr, nbytes)], device index) of vLLM's per-layer KV tensors.

    `backends` maps layer names to their attention backend's name, for the error of a refused layout;
    `cache_dtype`, `kv_scales`, `latent` (MLA) and `drafter` say what the bytes mean (`kv_groups.layout_facts`)."""
    if not kv_caches:
        raise LayoutError("vLLM registered no KV cache tensors")
    names = sorted(kv_caches, key=layer_order)
    backends = backends or {}
    for name in names:
        if not isinstance(kv_caches[name], torch.Tensor):
            raise LayoutError(f"layer {name} holds {type(kv_caches[name]).__name__}, not one KV tensor (attention "
                              f"backend {backends.get(name, 'unknown')}): hybrid state caches are not supported")
    t0 = kv_caches[names[0]]
    form = describe_form(t0, block_size=block_size, num_heads=num_heads, head_size=head_size,
                         backend=backends.get(names[0], "unknown"), latent=latent)
    shape, stride, e = tuple(t0.shape), t0.stride(), t0.element_size()
    regions, allocations = [], {}
    for name in names:
        t = kv_caches[name]
        if tuple(t.shape) != shape or t.stride() != stride or t.dtype != t0.dtype or t.device != t0.device:
            raise LayoutError(f"KV tensor {name} (shape {tuple(t.shape)}, strides {t.stride()}, {t.dtype}, {t.device}) "
                              f"differs from {names[0]} (shape {shape}, strides {stride}, {t0.dtype}, {t0.device})")
        st = t.untyped_storage()
        allocations[st.data_ptr()] = st.nbytes()
        for plane in range(form.kv_planes):
            regions.append(Region(base=t.data_ptr() + plane * form.plane_stride * e, block_stride=form.block_stride * e))
    device = t0.device.index or 0
    layout = KVLayout(num_layers=len(names), num_heads=num_heads, head_dim=form.row, dtype_size=e,
                      dtype=str(t0.dtype).removeprefix("torch."), block_size=block_size, num_blocks=form.num_blocks,
                      order=form.order, regions=regions, mem_type="VRAM" if t0.is_cuda else "DRAM",
                      head_offset=head_offset, kv_planes=form.kv_planes, cache_dtype=cache_dtype, kv_scales=kv_scales,
                      latent=latent, drafter=drafter).validate()
    return layout, sorted(allocations.items()), device


class CudaKVCache(CudaDevice):
    """vLLM's CUDA KV caches as a kvpush DeviceBackend (VRAM, registrations of at most 4 GiB, except a
    cross-layer cache with `whole_interleaved`, which is one registration)."""

    name = "cuda"

    def __init__(self, kv_caches: dict[str, torch.Tensor], head_offset: int, *, block_size: int, num_heads: int,
                 head_size: int, backends: dict[str, str] | None = None, whole_interleaved: bool = False,
                 **facts):
        layout, allocations, device = describe_cuda_caches(kv_caches, block_size=block_size, num_heads=num_heads,
                                                           head_size=head_size, head_offset=head_offset,
                                                           backends=backends, **facts)
        super().__init__(device)
        self._kv_caches = kv_caches
        self._layout, self._regs = sliced_registrations(layout, allocations, device, whole_interleaved=whole_interleaved)

    def layout(self) -> KVLayout:
        return self._layout

    def registration_regions(self) -> np.ndarray:
        return self._regs
