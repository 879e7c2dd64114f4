"""A KV cache slab in GPU memory with a kvpush layout: the CUDA backend of the conformance suite and
of the benchmarks (the same role HostBackend plays for DRAM)."""

from __future__ import annotations

import numpy as np
import torch

from kvpush_common.protocol.layout import BlockOrder, KVLayout, contiguous_layout, slab_bytes
from kvpush_common.plan.staging import plane_grid, unit_bytes

from .device import CudaDevice, sliced_registrations


class CudaSlab(CudaDevice):
    name = "cuda"

    def __init__(self, *, num_layers: int, num_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 dtype: str = "bfloat16", dtype_size: int = 2, order: BlockOrder = "HND", blocks_first: bool = False,
                 cross_layer: bool = False,
                 head_offset: int = 0, device: int | None = None, fill: int = 0, cache_dtype: str = "auto",
                 kv_scales: str = "", latent: bool = False):
        super().__init__(torch.cuda.current_device() if device is None else device)
        facts = dict(cache_dtype=cache_dtype, kv_scales=kv_scales, latent=latent)  # what the bytes mean (KVLayout)
        probe = contiguous_layout(0, num_layers=num_layers, num_heads=num_heads, head_dim=head_dim,
                                  block_size=block_size, num_blocks=num_blocks, dtype=dtype, dtype_size=dtype_size,
                                  order=order, blocks_first=blocks_first, cross_layer=cross_layer, **facts)
        self.tensor = torch.full((slab_bytes(probe),), fill, dtype=torch.uint8, device=f"cuda:{self.device_index}")
        layout = contiguous_layout(
            self.tensor.data_ptr(), num_layers=num_layers, num_heads=num_heads, head_dim=head_dim,
            block_size=block_size, num_blocks=num_blocks, dtype=dtype, dtype_size=dtype_size, order=order,
            blocks_first=blocks_first, cross_layer=cross_layer, mem_type="VRAM", device_id=self.device_index,
            head_offset=head_offset, **facts)
        self._layout, self._regs = sliced_registrations(
            layout, [(self.tensor.data_ptr(), self.tensor.numel())], self.device_index)

    def layout(self) -> KVLayout:
        return self._layout

    def registration_regions(self) -> np.ndarray:
        return self._regs

    @property
    def slab_base(self) -> int:
        return self.tensor.data_ptr()

    def read_bytes(self) -> np.ndarray:
        return self.tensor.cpu().numpy()

    def write_bytes(self, data: np.ndarray, offset: int = 0) -> None:
        self.tensor[offset:offset + data.size].copy_(torch.from_numpy(np.ascontiguousarray(data)))
        torch.cuda.synchronize(self.device_index)

    # ---- staged transfers: gather/scatter kernels on their own stream -------------------------------
    def staging_buffer(self, nbytes: int):
        layout = self._layout
        offset, grid = plane_grid(layout)  # before allocating: raises when the regions are no uniform grid
        self.staging = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{self.device_index}")
        self._stream = torch.cuda.Stream(device=self.device_index)
        start = min(r.base for r in layout.regions) - self.slab_base + offset
        sizes = [start, unit_bytes(layout), layout.regions[0].block_stride, nbytes] + [p for _, p in grid]
        w = 8 if all(s % 8 == 0 for s in sizes) else 1  # copy 8-byte words when everything is aligned: ~8x faster
        self._word = torch.int64 if w == 8 else torch.uint8
        self._grid = [c for c, _ in grid]
        self._planes = self.tensor.view(self._word).as_strided(
            [*self._grid, layout.num_blocks, unit_bytes(layout) // w],
            [p // w for _, p in grid] + [layout.regions[0].block_stride // w, 1], start // w)
        addr = self.staging.data_ptr()
        return addr, np.array([[addr, nbytes, self.device_index]], dtype=np.uint64)

    def _chunk(self, addr: int, n: int) -> torch.Tensor:
        words = self.staging.view(self._word)
        off = (addr - self.staging.data_ptr()) // words.element_size()
        shape = [*self._grid, n, self._planes.shape[-1]]
        return words[off:off + int(np.prod(shape))].view(shape)

    def gather(self, block_ids, addr: int) -> None:
        idx = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=self.staging.device)
        with torch.cuda.stream(self._stream):
            torch.index_select(self._planes, len(self._grid), idx, out=self._chunk(addr, idx.numel()))
        self._stream.synchronize()

    def scatter(self, block_ids, addr: int) -> None:
        idx = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=self.staging.device)
        with torch.cuda.stream(self._stream):
            self._planes.index_copy_(len(self._grid), idx, self._chunk(addr, idx.numel()))
        self._stream.synchronize()
