"""Turn two KV layouts, a head route and two block id lists into NIXL transfer descriptors.

`plan_transfer` copies tokens [dst_first_token, num_tokens) of the route's heads, for every region
(region r of the producer goes to region r of the consumer).  The producer's block list covers the
request from token 0; the consumer's starts at `dst_first_token` (a consumer with a partial prefix
cache hit registers only its uncached tail).  Block sizes and block orders may differ between the
sides.

Everything is validated before any descriptor array is built.  Descriptors are built with numpy:
the token range is cut at every src and dst block boundary, each piece becomes one "unit" per
region (and per head, or per token, as the block orders allow), units are ordered by source
address, and units adjacent on both sides within one registration are merged.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from kvpush_common.protocol.layout import KVLayout, LayoutError, check_pairable
from kvpush_common.protocol.topology import HeadRoute

__all__ = ["PlanError", "TransferPlan", "plan_transfer", "check_block_ids"]

_U64 = np.uint64


class PlanError(ValueError):
    """A transfer cannot be planned (bad layouts, route, token range or block ids)."""


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """Rows [addr, length, device_id] (NIXL descriptor format), `src[i]` is copied to `dst[i]`."""

    src: np.ndarray  # (N, 3) uint64
    dst: np.ndarray  # (N, 3) uint64
    nbytes: int

    @property
    def num_descs(self) -> int:
        return int(self.src.shape[0])


# --------------------------------------------------------------------------- validation


def _block_ids(ids, side: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise PlanError(f"{side} block ids must be a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise PlanError(f"{side} block ids must be integers, got dtype {arr.dtype}")
    return arr


def _needed(ids: np.ndarray, first: int, count: int, layout: KVLayout, side: str, needed_for: str) -> np.ndarray:
    """ids[first:first+count], checked against the layout's block count, as int64."""
    if ids.size < first + count:
        raise PlanError(
            f"{side} has {ids.size} block ids but {needed_for} need {first + count} "
            f"(block_size {layout.block_size})"
        )
    sel = ids[first : first + count]
    bad = np.flatnonzero((sel < 0) | (sel >= layout.num_blocks))
    if bad.size:
        i = int(bad[0])
        raise PlanError(
            f"{side} block id {int(sel[i])} (list index {first + i}) out of range: "
            f"must be in [0, {layout.num_blocks})"
        )
    return sel.astype(np.int64)


def check_block_ids(ids, first: int, count: int, layout: KVLayout, side: str, needed_for: str = "") -> np.ndarray:
    """ids[first:first+count] as int64, each in range; on "dst" also no duplicates.  PlanError otherwise.
    The one block-id validator of every planning path (tokens, whole blocks)."""
    sel = _needed(_block_ids(ids, side), first, count, layout, side, needed_for or f"blocks [{first}, {first + count})")
    # strictly increasing ids (the usual allocation) are distinct: one linear check spares np.unique's sort
    if side == "dst" and not _increasing(sel) and np.unique(sel).size != sel.size:
        vals, counts = np.unique(sel, return_counts=True)
        raise PlanError(f"dst block id {int(vals[counts > 1][0])} appears more than once: tokens would overwrite each other")
    return sel


def _increasing(a: np.ndarray) -> bool:
    return bool((a[1:] > a[:-1]).all())


def _check_heads(layout: KVLayout, start: int, count: int, side: str) -> None:
    if start < 0 or start + count > layout.num_heads:
        raise PlanError(
            f"route heads [{start}, {start + count}) out of range on {side}: it holds {layout.num_heads} heads"
        )


# --------------------------------------------------------------------------- addressing


def _offset(layout: KVLayout, pos: np.ndarray, head) -> np.ndarray:
    """Byte offset within a block of (in-block position, local head), as uint64."""
    pos = pos.astype(_U64)
    head = np.asarray(head).astype(_U64)
    tb = _U64(layout.token_bytes)
    if layout.order == "NHD":
        return (pos * _U64(layout.num_heads) + head) * tb
    return (head * _U64(layout.block_size) + pos) * tb


def _head_runs_ok(layout: KVLayout) -> bool:
    """Tokens of one head are contiguous within a block."""
    return layout.order == "HND" or layout.num_heads == 1 or layout.block_size == 1


def _token_runs_ok(layout: KVLayout) -> bool:
    """Heads of one token are contiguous within a block."""
    return layout.order == "NHD" or layout.num_heads == 1 or layout.block_size == 1


def _region_arrays(layout: KVLayout):
    regs = layout.regions
    base = np.array([r.base for r in regs], dtype=_U64)
    stride = np.array([r.block_stride for r in regs], dtype=_U64)
    mem = np.array([r.mem_id for r in regs], dtype=np.int64)
    dev = np.array([r.device_id for r in regs], dtype=np.int64)
    return base, stride, mem, dev


def plan_transfer(
    src: KVLayout,
    dst: KVLayout,
    route: HeadRoute,
    src_blocks,
    dst_blocks,
    *,
    num_tokens: int,
    dst_first_token: int = 0,
) -> TransferPlan:
    """Descriptors that copy tokens [dst_first_token, num_tokens) of `route`'s heads, every region."""
    # ---- validation (nothing is allocated per token or per descriptor before this is done)
    try:
        src.validate()
        dst.validate()
        check_pairable(src, dst)
    except LayoutError as e:
        raise PlanError(f"layouts cannot be paired: {e}") from e

    try:
        num_tokens = operator.index(num_tokens)
        first = operator.index(dst_first_token)
    except TypeError as e:
        raise PlanError(f"num_tokens and dst_first_token must be integers: {e}") from e
    if first < 0:
        raise PlanError(f"dst_first_token must be >= 0, got {first}")
    if num_tokens <= first:
        raise PlanError(f"nothing to copy: num_tokens {num_tokens} <= dst_first_token {first}")
    bs_s, bs_d = src.block_size, dst.block_size
    if not src.token_rows:  # rows inside a block are not tokens: copy whole blocks
        num_tokens = -(-num_tokens // bs_s) * bs_s
    if first % bs_d:
        raise PlanError(f"dst_first_token {first} is not a multiple of the dst block size {bs_d}")

    nh = int(route.num_heads)
    hs0, hd0 = int(route.src_head_start), int(route.dst_head_start)
    if nh < 1:
        raise PlanError(f"route moves {nh} heads; must be >= 1")
    _check_heads(src, hs0, nh, "src")
    _check_heads(dst, hd0, nh, "dst")

    tokens = f"tokens [{first}, {num_tokens})"
    s_first_blk = first // bs_s
    s_ids = check_block_ids(src_blocks, s_first_blk, (num_tokens - 1) // bs_s + 1 - s_first_blk, src, "src", tokens)
    d_ids = check_block_ids(dst_blocks, 0, (num_tokens - first - 1) // bs_d + 1, dst, "dst", tokens)

    # ---- items: pieces of the token range (per region, to be broadcast over regions)
    tb = src.token_bytes
    if _head_runs_ok(src) and _head_runs_ok(dst):
        # one unit per (segment, head): the segment's tokens of one head are contiguous on both sides
        cuts_s = np.arange((first // bs_s + 1) * bs_s, num_tokens, bs_s, dtype=np.int64)
        cuts_d = np.arange(first + bs_d, num_tokens, bs_d, dtype=np.int64)
        seg = np.union1d(np.union1d(cuts_s, cuts_d), np.array([first], dtype=np.int64))
        seg_len = np.diff(np.append(seg, num_tokens))
        heads = np.arange(nh, dtype=np.int64)
        t = np.repeat(seg, nh)
        h = np.tile(heads, seg.size)
        length = np.repeat(seg_len, nh).astype(_U64) * _U64(tb)
    elif _token_runs_ok(src) and _token_runs_ok(dst):
        if nh == src.num_heads == dst.num_heads:
            # whole segment (all heads of consecutive tokens) is contiguous on both sides
            cuts_s = np.arange((first // bs_s + 1) * bs_s, num_tokens, bs_s, dtype=np.int64)
            cuts_d = np.arange(first + bs_d, num_tokens, bs_d, dtype=np.int64)
            t = np.union1d(np.union1d(cuts_s, cuts_d), np.array([first], dtype=np.int64))
            length = np.diff(np.append(t, num_tokens)).astype(_U64) * _U64(nh * tb)
        else:
            # one unit per token: its route heads are contiguous on both sides
            t = np.arange(first, num_tokens, dtype=np.int64)
            length = np.full(t.size, nh * tb, dtype=_U64)
        h = np.zeros(t.size, dtype=np.int64)
    else:
        # one block order per side: one unit per (token, head)
        tok = np.arange(first, num_tokens, dtype=np.int64)
        t, h = np.repeat(tok, nh), np.tile(np.arange(nh, dtype=np.int64), tok.size)
        length = np.full(t.size, tb, dtype=_U64)

    s_blk = s_ids[t // bs_s - s_first_blk].astype(_U64)
    s_off = _offset(src, t % bs_s, h + hs0)
    d_rel = t - first
    d_blk = d_ids[d_rel // bs_d].astype(_U64)
    d_off = _offset(dst, d_rel % bs_d, h + hd0)
    del t, h, d_rel

    # Units are ordered by source (device, address) so that every possible merge is between
    # neighbours.  Within one region that order is (src block id, offset in block) whatever the
    # region, so the items are sorted once; regions are sorted by (device, base).  Only when the
    # regions' source spans interleave (blocks_first: K[b] V[b] K[b+1] ...) is a global sort needed.
    if s_blk.size > 1 and not _is_sorted_pair(s_blk, s_off):
        perm = np.lexsort((s_off, s_blk))
        s_blk, s_off, d_blk, d_off, length = s_blk[perm], s_off[perm], d_blk[perm], d_off[perm], length[perm]
    s_base, s_stride, s_mem, s_dev = _region_arrays(src)
    d_base, d_stride, d_mem, d_dev = _region_arrays(dst)
    rperm = np.lexsort((s_base, s_dev))
    s_base, s_stride, s_mem, s_dev = s_base[rperm], s_stride[rperm], s_mem[rperm], s_dev[rperm]
    d_base, d_stride, d_mem, d_dev = d_base[rperm], d_stride[rperm], d_mem[rperm], d_dev[rperm]
    s_end = s_base + _U64(src.num_blocks - 1) * s_stride + _U64(src.block_bytes)
    d_end = d_base + _U64(dst.num_blocks - 1) * d_stride + _U64(dst.block_bytes)
    interleaved = bool(np.any((s_dev[1:] == s_dev[:-1]) & (s_base[1:] < s_end[:-1])))

    # ---- broadcast over regions: (R, U), flattened region-major
    n_reg, n_items = s_base.size, length.size
    s_addr = s_base[:, None] + s_stride[:, None] * s_blk[None, :] + s_off[None, :]
    d_addr = d_base[:, None] + d_stride[:, None] * d_blk[None, :] + d_off[None, :]
    del s_blk, s_off, d_blk, d_off

    # safety net (unreachable if the checks above are right): every range inside its region's span
    max_len = length.max()
    for addr, base, end, side in ((d_addr, d_base, d_end, "dst"), (s_addr, s_base, s_end, "src")):
        lo, hi = addr.min(axis=1), addr.max(axis=1) + max_len
        if np.any(lo < base) or np.any(hi > end):
            bad = (addr < base[:, None]) | (addr + length[None, :] > end[:, None])
            if bad.any():
                r, u = np.argwhere(bad)[0]
                raise PlanError(
                    f"internal error: {side} range [{int(addr[r, u])}, +{int(length[u])}) leaves region "
                    f"{int(rperm[r])} span [{int(base[r])}, {int(end[r])})"
                )

    s_addr = s_addr.ravel()
    d_addr = d_addr.ravel()
    length = np.tile(length, n_reg)
    # regions whose (src mem, src dev, dst mem, dst dev) differ must never merge
    _, reg_class = np.unique(np.stack([s_mem, s_dev, d_mem, d_dev], axis=1), axis=0, return_inverse=True)
    reg_unit = np.repeat(np.arange(n_reg), n_items)  # region (sorted index) of each unit
    if interleaved:
        perm = np.lexsort((s_addr, s_dev[reg_unit]))
        s_addr, d_addr, length, reg_unit = s_addr[perm], d_addr[perm], length[perm], reg_unit[perm]
    cls = reg_class.reshape(-1)[reg_unit]

    # ---- merge units adjacent on both sides within one registration
    joins = (
        (s_addr[1:] == s_addr[:-1] + length[:-1])
        & (d_addr[1:] == d_addr[:-1] + length[:-1])
        & (cls[1:] == cls[:-1])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    reg_start = reg_unit[starts]
    src_desc = np.empty((starts.size, 3), dtype=_U64)
    dst_desc = np.empty((starts.size, 3), dtype=_U64)
    src_desc[:, 0] = s_addr[starts]
    dst_desc[:, 0] = d_addr[starts]
    src_desc[:, 1] = np.add.reduceat(length, starts) if starts.size < length.size else length
    dst_desc[:, 1] = src_desc[:, 1]
    src_desc[:, 2] = s_dev[reg_start]
    dst_desc[:, 2] = d_dev[reg_start]
    src_desc.setflags(write=False)
    dst_desc.setflags(write=False)
    nbytes = n_reg * (num_tokens - first) * nh * tb
    return TransferPlan(src=src_desc, dst=dst_desc, nbytes=nbytes)


def _is_sorted_pair(major: np.ndarray, minor: np.ndarray) -> bool:
    """(major, minor) rows are in non-decreasing lexicographic order."""
    dm = major[1:].astype(np.int64) - major[:-1].astype(np.int64)
    return bool(np.all((dm > 0) | ((dm == 0) & (minor[1:] >= minor[:-1]))))
