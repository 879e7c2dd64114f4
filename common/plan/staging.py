"""Staged transfers: fragmentation-immune pushes through contiguous staging buffers.

NIXL pays per non-contiguous descriptor (UCX cuda_ipc: ~4-9 us each on H200, inside `transfer()`), so
a request whose blocks are scattered on either side can take a second to post.  A staged push
instead gathers the request's blocks into a contiguous slot of the producer's staging pool, WRITEs
the slot in one descriptor into a slot the consumer lent it at handshake, and the consumer scatters
the slot into its destination blocks before counting that producer rank as done.  Requests move in
chunks of `chunk_bytes` (blocks of all regions), so gather of chunk k+1 overlaps the WRITE of chunk
k and the scatter of chunk k-1; slots are reused only after the consumer's SlotFree.

Eligibility: both sides hold whole blocks of the route's heads with the same block size (units of
`block_size * heads * token_bytes` bytes), both offered staging at handshake, and the direct plan
has at least `staging_min_descs` descriptors.  Chunk stream format: for registration entries
[first, first + count), region-major `[regions, count, unit]`.

The destination blocks are written only by the consumer's own scatter, on its worker thread, for a
key it still wants: a revoked or failed key's chunks are dropped (their slot freed), never scattered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpush_common.protocol.layout import KVLayout, same_block_arrangement
from kvpush_common.plan.planner import PlanError, check_block_ids
from kvpush_common.protocol.topology import HeadRoute


def whole_block_units(src: KVLayout, dst: KVLayout, route: HeadRoute) -> bool:
    """Can this route move as chunks of whole blocks (same unit bytes on both sides)?"""
    return (same_block_arrangement(src, dst, route.num_heads) and len(src.regions) == len(dst.regions)
            and route.num_heads == src.num_heads == dst.num_heads
            and src.kv_planes == dst.kv_planes and src.token_rows == dst.token_rows)


def unit_bytes(layout: KVLayout) -> int:
    return layout.block_size * layout.num_heads * layout.token_bytes


def staged_pairs(src: KVLayout, dst: KVLayout, src_blocks, dst_blocks, *, num_tokens: int,
                 dst_first_token: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Validated (src, dst) block ids in the consumer's registration order (the chunk stream order)."""
    bs = src.block_size
    if dst_first_token % bs or not 0 <= dst_first_token < num_tokens:
        raise PlanError(f"dst_first_token {dst_first_token} must be a block multiple below num_tokens {num_tokens}")
    first_blk, nblk = dst_first_token // bs, -(-(num_tokens - dst_first_token) // bs)
    return (check_block_ids(src_blocks, first_blk, nblk, src, "src"),
            check_block_ids(dst_blocks, 0, nblk, dst, "dst"))


def blocks_per_chunk(layout: KVLayout, chunk_bytes: int) -> int:
    per_block = len(layout.regions) * unit_bytes(layout)
    if per_block > chunk_bytes:
        raise PlanError(f"one block of all regions ({per_block} B) exceeds the staging chunk ({chunk_bytes} B)")
    return chunk_bytes // per_block


class SlotPool:
    """Fixed-size slots of a staging buffer, handed out and returned by index (one thread)."""

    def __init__(self, addr: int, nbytes: int, chunk_bytes: int, device_id: int = 0):
        self.addr, self.chunk_bytes, self.device_id = addr, chunk_bytes, device_id
        self.free = list(range(nbytes // chunk_bytes))[::-1]
        self.size = len(self.free)

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def give(self, slot: int) -> None:
        if slot in self.free or not 0 <= slot < self.size:
            raise ValueError(f"slot {slot} returned twice or out of range")
        self.free.append(slot)

    def slot_addr(self, slot: int) -> int:
        return self.addr + slot * self.chunk_bytes


class LentSlots(SlotPool):
    """A consumer rank's staging slots as its producer rank sees them.  Each use of a slot is numbered
    (ChunkWritten carries the number and SlotFree echoes it), so a late SlotFree of an earlier use never
    frees a slot that holds another chunk; a slot whose chunk landed but whose SlotFree never came (a
    lost notification) is taken back `hold_s` after it landed, when the consumer has scattered it or
    given up on its key (design section 9.5)."""

    def __init__(self, addr: int, nbytes: int, chunk_bytes: int, device_id: int = 0):
        super().__init__(addr, nbytes, chunk_bytes, device_id)
        self._use: dict[int, int] = {}  # slot -> number of its current use
        self._landed: dict[int, float] = {}  # slot -> when it is taken back without a SlotFree
        self._next_use = 1

    def take(self) -> int | None:
        slot = super().take()
        if slot is not None:
            self._use[slot], self._next_use = self._next_use, self._next_use + 1
        return slot

    def use_of(self, slot: int) -> int:
        return self._use[slot]

    def landed(self, slot: int, now: float, hold_s: float) -> None:
        self._landed[slot] = now + hold_s

    def give(self, slot: int, use: int | None = None) -> None:
        """Back to the pool: from our own failed WRITE (`use` None), or a SlotFree for `use`."""
        if use is not None and self._use.get(slot) != use:
            raise ValueError(f"slot {slot} freed for use {use}, but it is in use {self._use.get(slot)}")
        super().give(slot)
        self._use.pop(slot, None)
        self._landed.pop(slot, None)

    def reclaim(self, now: float) -> int:
        """Take back the slots whose SlotFree is overdue; how many."""
        overdue = [s for s, t in self._landed.items() if t <= now]
        for s in overdue:
            self.give(s)
        return len(overdue)


@dataclass
class StagedWrite:
    """Producer side of one staged push to one consumer rank."""

    src_blocks: np.ndarray
    per_chunk: int
    nbytes_per_block: int
    next_chunk: int = 0
    inflight: list = field(default_factory=list)  # (handle, local slot, remote slot, remote SlotPool)
    done_chunks: int = 0
    failed: str = ""

    @property
    def chunks(self) -> int:
        return -(-self.src_blocks.size // self.per_chunk)

    def span(self, chunk: int) -> tuple[int, int]:
        first = chunk * self.per_chunk
        return first, min(self.per_chunk, self.src_blocks.size - first)


def plane_grid(layout: KVLayout) -> tuple[int, list[tuple[int, int]]]:
    """Regions as a uniform grid of planes: (byte offset of region 0 from the lowest base, [(count, pitch)]).

    One level when region bases are evenly spaced (FlashAttention/Neuron: layer x K/V planes), two
    levels (layers, K/V) when the two planes of a layer interleave (FlashInfer's blocks-first).
    Raises PlanError when the regions follow neither pattern (then staging is not offered).
    """
    bases = np.array([r.base for r in layout.regions], dtype=np.int64)
    strides = {r.block_stride for r in layout.regions}
    if len(strides) != 1:
        raise PlanError("regions with different block strides cannot be staged")
    low = int(bases.min())
    if bases.size == 1:
        return int(bases[0]) - low, [(1, 0)]
    d = np.diff(bases)
    if (d == d[0]).all() and d[0] > 0:
        return int(bases[0]) - low, [(bases.size, int(d[0]))]
    if bases.size % 2 == 0:
        inner, outer = bases[1::2] - bases[0::2], np.diff(bases[0::2])
        if (inner == inner[0]).all() and inner[0] > 0 and (outer.size == 0 or ((outer == outer[0]).all() and outer[0] > 0)):
            return int(bases[0]) - low, [(bases.size // 2, int(outer[0]) if outer.size else 0), (2, int(inner[0]))]
    raise PlanError("region bases are not a uniform grid; staging needs one")


def host_planes(buffer: np.ndarray, base_addr: int, layout: KVLayout) -> np.ndarray:
    """A numpy view [grid..., num_blocks, unit] of a host slab (no copy; grid from plane_grid)."""
    offset, grid = plane_grid(layout)
    low = min(r.base for r in layout.regions)
    start = low - base_addr + offset
    shape = [c for c, _ in grid] + [layout.num_blocks, unit_bytes(layout)]
    strides = [p for _, p in grid] + [layout.regions[0].block_stride, 1]
    return np.lib.stride_tricks.as_strided(buffer[start:], shape=shape, strides=strides, writeable=True)


def host_gather(planes: np.ndarray, blocks: np.ndarray, out: np.ndarray) -> None:
    """Copy these blocks of every region into `out` (flat bytes) as [regions, len(blocks), unit]."""
    got = planes[..., blocks, :]
    out[:got.size] = got.reshape(-1)


def host_scatter(planes: np.ndarray, blocks: np.ndarray, data: np.ndarray) -> None:
    """Inverse of host_gather: `data` (flat bytes, [regions, len(blocks), unit]) into these blocks."""
    shape = planes.shape[:-2] + (blocks.size, planes.shape[-1])
    planes[..., blocks, :] = data[:int(np.prod(shape))].reshape(shape)
