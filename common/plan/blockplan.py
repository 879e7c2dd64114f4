"""Block-granular transfers over prepped NIXL descriptor lists, for peers with the same block geometry.

When both sides use the same block size and the route's heads form one contiguous range inside every
block on both sides, a block maps to a block.  Then each side's descriptor list "one entry per
(region, block)" can be prepared once per peer (NIXL `prep_xfer_dlist`) and every request is just two
index arrays (`make_prepped_xfer`), which spares the post building a descriptor list per request (the larger part
of its cost; `scripts/bench/probes/bench_post.py` compares the two); the general planner stays for every other
pairing.
Whole blocks move, so the tail of a request's last block carries the producer's padding bytes into
the consumer's (freshly allocated) last block.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvpush_common.protocol.layout import KVLayout, same_block_arrangement
from kvpush_common.plan.planner import PlanError, TransferPlan, _increasing, check_block_ids
from kvpush_common.protocol.topology import HeadRoute


@dataclass(frozen=True, eq=False)
class BlockPlan:
    """Whole blocks, paired in source order.  The per-descriptor index arrays (regions x blocks entries:
    131,072 for a 16k-token request of a 64-layer model) are built only when a transfer posts them: a
    request whose blocks merge into runs never pays for them (building them was about half of the time between
    a 16k-token request's KV ready and its WRITE posted)."""

    src_blocks: np.ndarray  # the validated block pairs, sorted by source block
    dst_blocks: np.ndarray
    num_regions: int
    src_num_blocks: int  # blocks per region on each side (the prepped lists' stride)
    dst_num_blocks: int
    nbytes: int

    @property
    def num_descs(self) -> int:
        return self.num_regions * int(self.src_blocks.size)

    @cached_property
    def local_idx(self) -> np.ndarray:
        """int32 indices into the producer's prepped list (entry r * num_blocks + b)."""
        return _indices(self.num_regions, self.src_num_blocks, self.src_blocks)

    @cached_property
    def remote_idx(self) -> np.ndarray:
        """int32 indices into the consumer's prepped list."""
        return _indices(self.num_regions, self.dst_num_blocks, self.dst_blocks)


def _indices(num_regions: int, num_blocks: int, blocks: np.ndarray) -> np.ndarray:
    out = np.empty((num_regions, blocks.size), np.int32)
    np.add(np.arange(0, num_regions * num_blocks, num_blocks, dtype=np.int32)[:, None], blocks.astype(np.int32),
           out=out)
    return out.ravel()


def _slice_contiguous(layout: KVLayout, num_heads: int) -> bool:
    return layout.order == "HND" or layout.block_size == 1 or num_heads == layout.num_heads


def block_granular(src: KVLayout, dst: KVLayout, route: HeadRoute) -> bool:
    """Can this route move whole blocks between prepped per-block lists?

    The head slice must be one contiguous range inside a block on both sides, and hold its bytes in
    the same arrangement: same block size, and the same block order unless the slice is a single
    head or a block holds a single token (then NHD and HND store identical bytes).
    """
    return (same_block_arrangement(src, dst, route.num_heads) and len(src.regions) == len(dst.regions)
            and len(src.regions) * max(src.num_blocks, dst.num_blocks) < 2**31  # int32 indices
            and _slice_contiguous(src, route.num_heads) and _slice_contiguous(dst, route.num_heads))


def _unit_geometry(layout: KVLayout, head_start: int, num_heads: int):
    """Per region (column vectors): base, block stride, device; and the slice's offset and length in a block."""
    if head_start < 0 or head_start + num_heads > layout.num_heads:
        raise PlanError(f"heads [{head_start}, +{num_heads}) outside the {layout.num_heads} held")
    inner = head_start * (layout.block_size * layout.token_bytes if layout.order == "HND" else layout.token_bytes)
    length = layout.block_size * num_heads * layout.token_bytes
    base, stride, dev = _region_columns(layout)
    return base, stride, dev, np.uint64(inner), np.uint64(length)


def _per_layout(cache: dict, layout: KVLayout, build):
    """`build(layout)`, once per layout object: an endpoint plans with a few layouts, for every request."""
    hit = cache.get(id(layout))
    if hit is not None and hit[0] is layout:
        return hit[1]
    value = build(layout)
    if len(cache) >= 64:  # layouts of peers long gone
        cache.clear()
    cache[id(layout)] = (layout, value)  # holds the layout, so its id is not reused while cached
    return value


_COLUMNS: dict[int, tuple] = {}  # id(layout) -> (layout, (base, stride, dev))


def _region_columns(layout: KVLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per region (column vectors, read-only): base, block stride, device; built once per layout object, so
    planning a request does no Python work per region."""
    return _per_layout(_COLUMNS, layout, _build_columns)


def _build_columns(layout: KVLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    cols = tuple(np.array([getattr(r, f) for r in layout.regions], np.uint64)[:, None]
                 for f in ("base", "block_stride", "device_id"))
    for c in cols:
        c.flags.writeable = False
    return cols


def unit_table(layout: KVLayout, head_start: int, num_heads: int) -> np.ndarray:
    """(regions * num_blocks, 3) `[addr, len, dev]`: entry r * num_blocks + b is the head slice of block b."""
    base, stride, dev, inner, length = _unit_geometry(layout, head_start, num_heads)
    blocks = np.arange(layout.num_blocks, dtype=np.uint64)[None, :]
    out = np.empty((len(layout.regions), layout.num_blocks, 3), np.uint64)
    out[..., 0] = base + stride * blocks + inner
    out[..., 1] = length
    out[..., 2] = dev
    return out.reshape(-1, 3)


def plan_blocks(src: KVLayout, dst: KVLayout, route: HeadRoute, src_blocks, dst_blocks, *, num_tokens: int,
                dst_first_token: int = 0) -> BlockPlan:
    """Index arrays for tokens [dst_first_token, num_tokens), whole blocks, validated like the planner."""
    if not block_granular(src, dst, route):
        raise PlanError("layouts are not block-granular for this route; use plan_transfer")
    bs = src.block_size
    if dst_first_token % bs or not 0 <= dst_first_token < num_tokens:
        raise PlanError(f"dst_first_token {dst_first_token} must be a block multiple below num_tokens {num_tokens}")
    first_blk, nblk = dst_first_token // bs, -(-(num_tokens - dst_first_token) // bs)
    s = check_block_ids(src_blocks, first_blk, nblk, src, "src")
    d = check_block_ids(dst_blocks, 0, nblk, dst, "dst")
    # Pairs in source order: blocks freed in reverse and reallocated on both sides become ascending
    # runs again, which NIXL (and merge_runs) can merge.
    if not _increasing(s):
        order = np.argsort(s, kind="stable")
        s, d = s[order], d[order]
    nbytes = len(src.regions) * nblk * bs * route.num_heads * src.token_bytes
    return BlockPlan(s, d, len(src.regions), src.num_blocks, dst.num_blocks, nbytes)


def _units_touch(layout: KVLayout, num_heads: int) -> bool:
    """Does the head slice of block b+1 start where block b's ends, in every region?"""
    unit = layout.block_size * num_heads * layout.token_bytes
    return bool((_region_columns(layout)[1] == unit).all())


def _blocks_tile(layout: KVLayout, route: HeadRoute) -> bool:
    """A cross-layer cache moved whole: block b of region r sits at base + b * stride + r * block_bytes with
    stride = regions * block_bytes, one registration, all heads routed; then blocks b..b+n-1 of every region
    are one span."""
    return route.num_heads == layout.num_heads and _tiles(layout)


_TILES: dict[int, tuple[KVLayout, bool]] = {}  # id(layout) -> (layout, tiles): checked once per layout object


def _tiles(layout: KVLayout) -> bool:
    return _per_layout(_TILES, layout, _check_tiles)


def _check_tiles(layout: KVLayout) -> bool:
    if len(layout.regions) < 2:
        return False
    base, stride, dev = (c[:, 0] for c in _region_columns(layout))
    bb = np.uint64(layout.block_bytes)
    return (bool((stride == bb * np.uint64(base.size)).all())
            and bool((base == base[0] + bb * np.arange(base.size, dtype=np.uint64)).all())
            and bool((dev == dev[0]).all()) and len({r.mem_id for r in layout.regions}) == 1)


def descs_per_run(src: KVLayout, dst: KVLayout, route: HeadRoute) -> int:
    """Descriptors `merge_runs` posts per run of consecutive blocks: one for cross-layer caches on both sides,
    else one per region."""
    return 1 if _blocks_tile(src, route) and _blocks_tile(dst, route) else len(src.regions)


def _tiled_rows(layout: KVLayout, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """`[addr, len, dev]` per run of a `_blocks_tile` layout: every region's blocks of the run in one span."""
    reg = layout.regions[0]
    stride = np.uint64(reg.block_stride)
    rows = np.empty((starts.size, 3), np.uint64)
    rows[:, 0] = np.uint64(reg.base) + stride * starts.astype(np.uint64)
    rows[:, 1] = stride * lengths.astype(np.uint64)
    rows[:, 2] = reg.device_id
    return rows


def block_runs(src_blocks: np.ndarray, dst_blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src_start, dst_start, length) of the maximal runs consecutive on both sides (pairs in source order)."""
    if src_blocks.size == 0:
        z = np.zeros(0, np.int64)
        return z, z, z
    brk = np.flatnonzero((np.diff(src_blocks) != 1) | (np.diff(dst_blocks) != 1)) + 1
    starts = np.concatenate(([0], brk))
    lengths = np.diff(np.concatenate((starts, [src_blocks.size])))
    return src_blocks[starts], dst_blocks[starts], lengths


def _run_rows(layout: KVLayout, head_start: int, num_heads: int, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    base, stride, dev, inner, length = _unit_geometry(layout, head_start, num_heads)
    rows = np.empty((len(layout.regions), starts.size, 3), np.uint64)
    rows[..., 0] = base + stride * starts.astype(np.uint64)[None, :] + inner
    rows[..., 1] = length * lengths.astype(np.uint64)[None, :]
    rows[..., 2] = dev
    return rows.reshape(-1, 3)


def merge_runs(src: KVLayout, dst: KVLayout, route: HeadRoute, plan: BlockPlan,
               max_descs: int | None = None) -> TransferPlan | None:
    """One descriptor per (region, run of blocks consecutive on both sides), or per run when both sides are
    cross-layer caches whose blocks hold every region back to back (`_blocks_tile`), or None when the units of
    consecutive blocks do not touch (head slices, K/V-interleaved blocks), or, with `max_descs`, when
    merging would not halve the list or would leave more than `max_descs` entries (then per-block
    prepped lists are cheaper to post)."""
    if _blocks_tile(src, route) and _blocks_tile(dst, route):  # cross-layer caches: one row per run
        s0, d0, n = block_runs(plan.src_blocks, plan.dst_blocks)
        if max_descs is not None and s0.size > min(max_descs, plan.num_descs // 2):
            return None
        return TransferPlan(_tiled_rows(src, s0, n), _tiled_rows(dst, d0, n), plan.nbytes)
    if not (_units_touch(src, route.num_heads) and _units_touch(dst, route.num_heads)):
        return None
    s0, d0, n = block_runs(plan.src_blocks, plan.dst_blocks)
    if max_descs is not None and len(src.regions) * s0.size > min(max_descs, plan.num_descs // 2):
        return None
    return TransferPlan(_run_rows(src, route.src_head_start, route.num_heads, s0, n),
                        _run_rows(dst, route.dst_head_start, route.num_heads, d0, n), plan.nbytes)



MERGED_MAX_DESCS = 8192  # above this a merged list costs more to build and post than prepped indices


def consecutive_start(ids, first: int, count: int, num_blocks: int) -> int | None:
    """b when `ids[first:first + count]` is b, b+1, ..., all in [0, num_blocks) (a fresh allocation, the usual
    case), else None (then the numpy path validates and says what is wrong).  Python ints compared in C, no numpy:
    the writer thread runs cold after its sleep, where the numpy path's many small calls cost about ten times a
    hot plan."""
    if type(ids) not in (list, tuple) or count < 1 or len(ids) < first + count or type(ids[first]) is not int:
        return None
    b = ids[first]
    if b < 0 or b + count > num_blocks:
        return None
    try:  # array() refuses floats (2.0 would pass ==), as the numpy path's dtype check does
        return b if array("q", ids[first:first + count]) == _counting(b, b + count) else None
    except (TypeError, OverflowError):
        return None


_COUNTING = array("q")  # 0, 1, 2, ...: slicing it copies memory, where array(range(...)) made an int per id


def _counting(start: int, end: int) -> array:
    """start, start + 1, ..., end - 1: a slice of one array grown by doubling, so a run of ids costs a memcpy."""
    global _COUNTING
    if len(_COUNTING) < end:
        _COUNTING = array("q", range(max(end, 2 * len(_COUNTING))))
    return _COUNTING[start:end]


def plan_one_run(src: KVLayout, dst: KVLayout, route: HeadRoute, src_blocks, dst_blocks, *, num_tokens: int,
                 dst_first_token: int, max_descs: int | None) -> TransferPlan | None:
    """`merge_runs(plan_blocks(...))` when both sides' blocks are one run of consecutive ids, built without the
    per-block arrays; None for anything else (the general path then plans it, or says why not)."""
    bs = src.block_size
    if dst_first_token % bs or not 0 <= dst_first_token < num_tokens:
        return None
    first_blk, nblk = dst_first_token // bs, -(-(num_tokens - dst_first_token) // bs)
    s0 = consecutive_start(src_blocks, first_blk, nblk, src.num_blocks)
    d0 = consecutive_start(dst_blocks, 0, nblk, dst.num_blocks) if s0 is not None else None
    if d0 is None:
        return None
    regions = len(src.regions)
    nbytes = regions * nblk * bs * route.num_heads * src.token_bytes
    cap = None if max_descs is None else min(max_descs, regions * nblk // 2)  # merge_runs' rule, for one run
    if _blocks_tile(src, route) and _blocks_tile(dst, route):
        if cap is not None and 1 > cap:
            return None
        return TransferPlan(_one_tiled_row(src, s0, nblk), _one_tiled_row(dst, d0, nblk), nbytes)
    if not (_units_touch(src, route.num_heads) and _units_touch(dst, route.num_heads)):
        return None
    if cap is not None and regions > cap:
        return None
    one = np.ones(1, np.int64)
    return TransferPlan(_run_rows(src, route.src_head_start, route.num_heads, one * s0, one * nblk),
                        _run_rows(dst, route.dst_head_start, route.num_heads, one * d0, one * nblk), nbytes)


def _one_tiled_row(layout: KVLayout, start: int, length: int) -> np.ndarray:
    reg = layout.regions[0]
    return np.array([[reg.base + reg.block_stride * start, reg.block_stride * length, reg.device_id]], np.uint64)
