"""The benchmark's KV cache: a kvpush slab (VRAM or DRAM) in vLLM's FlashAttention layout, a vLLM-like
free block queue, and the byte pattern each prefill writes and each decode checks."""

from __future__ import annotations

import collections

import numpy as np

QWEN3_32B_RANK = dict(num_layers=64, num_heads=1, head_dim=128, dtype="bfloat16", dtype_size=2)  # TP=8 share


class BlockPool:
    """vLLM's free block queue: allocate from the head; a finished request's blocks go to the tail in
    reverse order (tail blocks first).  Under churn, requests get scattered and reversed blocks."""

    def __init__(self, num_blocks: int):
        self.free = collections.deque(range(num_blocks))
        self.num_blocks = num_blocks

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        return [self.free.popleft() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class KVSlab:
    """A slab on `device` (None: host DRAM) viewed as (layers*2, num_blocks, heads, head bytes): vLLM's
    FlashAttention HND block, so each of this rank's heads is one contiguous run inside a block."""

    def __init__(self, *, block_size: int, num_blocks: int, device: int | None, geometry: dict, head_offset: int = 0):
        """`geometry` is this rank's share (num_heads: the heads it holds, from `head_offset` on)."""
        self.block_size, self.num_blocks, self.device = block_size, num_blocks, device
        self.head_offset, self.num_heads = head_offset, geometry["num_heads"]
        if device is None:
            from kvpush_common.device.host import HostBackend

            self.backend = HostBackend(block_size=block_size, num_blocks=num_blocks, head_offset=head_offset, **geometry)
            flat = self.backend.buffer
        else:
            from kvpush_cuda.slab import CudaSlab

            self.backend = CudaSlab(block_size=block_size, num_blocks=num_blocks, device=device,
                                    head_offset=head_offset, **geometry)
            flat = self.backend.tensor
        self.heads = flat.reshape(geometry["num_layers"] * 2, num_blocks, self.num_heads, -1)

    def _index(self, blocks):
        if self.device is None:
            return np.asarray(blocks)
        import torch

        return torch.as_tensor(blocks, device=f"cuda:{self.device}")

    def _values(self, seq: int) -> list[int]:
        return [pattern(seq, self.head_offset + h) for h in range(self.num_heads)]

    def fill(self, blocks: list[int], seq: int) -> None:
        """What the prefill forward does to these blocks: each head gets pattern(seq, its model-wide
        index), so a head landing on the wrong rank or offset is caught (enqueued on the GPU; no sync)."""
        fill_heads(self.heads, self._index(blocks), self._values(seq))

    def count_wrong(self, blocks: list[int], seq: int, planes: slice = slice(None)) -> int:
        """Bytes in these blocks (of the chosen planes) that do not hold request `seq`'s pattern."""
        return count_wrong_heads(self.heads[planes], self._index(blocks), self._values(seq))


def fill_heads(heads, index, values: list[int]) -> None:
    """heads[:, index, h, :] = values[h], for a numpy array or a torch tensor (in place through views)."""
    for h, v in enumerate(values):
        if isinstance(heads, np.ndarray):
            heads[:, index, h, :] = v
        else:
            heads[:, :, h, :].index_fill_(1, index, v)


def count_wrong_heads(heads, index, values: list[int]) -> int:
    return int(sum(int((heads[:, index, h, :] != v).sum()) for h, v in enumerate(values)))


def pattern(seq: int, head: int = 0) -> int:
    """Byte of request number `seq` in model-wide KV head `head`: consecutive requests differ in every
    head, heads of one request differ (fewer than 251 heads), never 0 (fresh memory)."""
    return 1 + (seq * 7 + head) % 251


def peer_copy_ms(nbytes: int, src: int = 0, dst: int | None = None, reps: int = 10) -> float:
    """Median time of one torch copy of `nbytes` from GPU `src` to GPU `dst` (default: GPU 1 if present):
    the floor every benchmark here compares its transfers against."""
    import statistics
    import time

    import torch

    if dst is None:
        dst = 1 if torch.cuda.device_count() > 1 else 0
    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(dst)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize(src)
        t = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(dst)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)
