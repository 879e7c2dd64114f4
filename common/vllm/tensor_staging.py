"""Staged-transfer gather/scatter for KV caches held in torch tensors (vLLM's per-layer caches, CPU or CUDA).

Each region (a layer's K or V plane, or a layer's interleaved block on vLLM's CPU layout) is viewed as
`[num_blocks, unit]` words over its tensor's storage, in physical byte order, so the staged stream is
the same bytes a direct WRITE would move (and pairs with any other backend's staging).  One
index_select / index_copy_ per region and chunk; on CUDA on a side stream, synchronised before return.
"""

from __future__ import annotations

import numpy as np
import torch

from kvpush_common.protocol.layout import KVLayout, LayoutError
from kvpush_common.plan.staging import unit_bytes


class TensorStaging:
    def __init__(self, layout: KVLayout, tensors: list[torch.Tensor]):
        storages = {t.untyped_storage().data_ptr(): t for t in tensors}
        self.device = tensors[0].device
        unit = unit_bytes(layout)
        offsets = []
        for r in layout.regions:
            owner = next((t for p, t in storages.items() if p <= r.base < p + t.untyped_storage().nbytes()), None)
            if owner is None:
                raise LayoutError(f"region at {r.base:#x} lies in none of the KV tensors")
            offsets.append((owner, r.base - owner.untyped_storage().data_ptr(), r.block_stride))
        sizes = [unit] + [o for _, o, _ in offsets] + [s for _, _, s in offsets]
        self.word = torch.int64 if all(x % 8 == 0 for x in sizes) else torch.uint8
        w = torch.tensor([], dtype=self.word).element_size()
        self.unit_words = unit // w
        flat = {}
        self.views = []
        for owner, off, stride in offsets:
            key = owner.untyped_storage().data_ptr()
            if key not in flat:
                flat[key] = torch.empty(0, dtype=torch.uint8, device=self.device).set_(owner.untyped_storage())
            self.views.append(flat[key].view(self.word).as_strided((layout.num_blocks, self.unit_words),
                                                                   (stride // w, 1), off // w))
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self.buffer: torch.Tensor | None = None

    def staging_buffer(self, nbytes: int) -> tuple[int, np.ndarray]:
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        addr = self.buffer.data_ptr()
        return addr, np.array([[addr, nbytes, self.device.index or 0]], dtype=np.uint64)

    def _chunk(self, addr: int, n: int) -> torch.Tensor:
        words = self.buffer.view(self.word)
        off = (addr - self.buffer.data_ptr()) // words.element_size()
        count = len(self.views) * n * self.unit_words
        return words[off:off + count].view(len(self.views), n, self.unit_words)

    def _run(self, fn) -> None:
        if self.stream is None:
            fn()
            return
        with torch.cuda.stream(self.stream):
            fn()
        self.stream.synchronize()

    def gather(self, block_ids, addr: int) -> None:
        idx = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=self.device)
        out = self._chunk(addr, idx.numel())

        def work():
            for r, view in enumerate(self.views):
                torch.index_select(view, 0, idx, out=out[r])
        self._run(work)

    def scatter(self, block_ids, addr: int) -> None:
        idx = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=self.device)
        src = self._chunk(addr, idx.numel())

        def work():
            for r, view in enumerate(self.views):
                view.index_copy_(0, idx, src[r])
        self._run(work)


class TensorStagingMixin:
    """Staged-transfer methods for a DeviceBackend holding vLLM's tensors in `_kv_caches` and its layout in `_layout`."""

    def staging_buffer(self, nbytes: int):
        self._staging = TensorStaging(self._layout, list(self._kv_caches.values()))
        return self._staging.staging_buffer(nbytes)

    def gather(self, block_ids, addr: int) -> None:
        self._staging.gather(block_ids, addr)

    def scatter(self, block_ids, addr: int) -> None:
        self._staging.scatter(block_ids, addr)
