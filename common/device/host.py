"""DRAM device backend: KV caches in one page-aligned host slab, for the CPU platform and tests."""

from __future__ import annotations

import numpy as np

from kvpush_common.device.backend import DeviceBackend
from kvpush_common.protocol.layout import BlockOrder, KVLayout, contiguous_layout, slab_bytes

_PAGE = 4096


class HostBackend(DeviceBackend):
    name = "host"

    def __init__(self, *, num_layers: int, num_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 dtype: str = "bfloat16", dtype_size: int = 2, order: BlockOrder = "HND",
                 blocks_first: bool = False, cross_layer: bool = False, head_offset: int = 0, fill: int = 0,
                 cache_dtype: str = "auto", kv_scales: str = "", latent: bool = False):
        facts = dict(cache_dtype=cache_dtype, kv_scales=kv_scales, latent=latent)  # what the bytes mean (KVLayout)
        probe = contiguous_layout(0, num_layers=num_layers, num_heads=num_heads, head_dim=head_dim,
                                  block_size=block_size, num_blocks=num_blocks, dtype=dtype,
                                  dtype_size=dtype_size, order=order, blocks_first=blocks_first, cross_layer=cross_layer,
                                  **facts)
        nbytes = slab_bytes(probe)
        raw = np.empty(nbytes + _PAGE, dtype=np.uint8)
        start = (-raw.ctypes.data) % _PAGE
        self.buffer = raw[start:start + nbytes]
        self.buffer.fill(fill)  # first touch: fresh pages are slow to fault in on some VMs
        self._raw = raw
        self._layout = contiguous_layout(
            self.buffer.ctypes.data, num_layers=num_layers, num_heads=num_heads, head_dim=head_dim,
            block_size=block_size, num_blocks=num_blocks, dtype=dtype, dtype_size=dtype_size, order=order,
            blocks_first=blocks_first, cross_layer=cross_layer, head_offset=head_offset, **facts)

    def layout(self) -> KVLayout:
        return self._layout

    def registration_regions(self) -> np.ndarray:
        return np.array([[self.buffer.ctypes.data, self.buffer.nbytes, 0]], dtype=np.uint64)

    # ---- byte access for tests and benchmarks (device backends offer the same three) ----------------
    @property
    def slab_base(self) -> int:
        return self.buffer.ctypes.data

    def read_bytes(self) -> np.ndarray:
        return self.buffer.copy()

    def write_bytes(self, data: np.ndarray, offset: int = 0) -> None:
        self.buffer[offset:offset + data.size] = data

    def block_view(self, region: int, block_id: int) -> np.ndarray:
        """The bytes of one block of one region (for tests and poisoning)."""
        reg = self._layout.regions[region]
        off = reg.base - self.buffer.ctypes.data + block_id * reg.block_stride
        return self.buffer[off:off + self._layout.block_bytes]
