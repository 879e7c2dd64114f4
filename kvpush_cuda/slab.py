"""A KV cache slab in GPU memory with a kvpush layout: the CUDA backend of the conformance suite and
of the benchmarks (the same role HostBackend plays for DRAM)."""

from __future__ import annotations

import numpy as np
import torch

from kvpush_common.protocol.layout import BlockOrder, KVLayout, contiguous_layout, slab_bytes

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
