"""An independent numpy reference for KV layouts (does not use kvpush_common.plan.planner).

`logical_index` maps a layout + block list onto byte offsets into the buffer that backs it, shaped
[regions, tokens, heads, token_bytes], using only reshapes/transposes of each block.  `apply_plan`
copies bytes by address between two buffers the way a NIXL WRITE would.
"""

from __future__ import annotations

import numpy as np

from kvpush_common.protocol.layout import KVLayout, Region


def logical_index(layout: KVLayout, buf_base: int, block_ids, num_tokens: int) -> np.ndarray:
    """Byte offsets (into a buffer whose byte 0 is at address `buf_base`) of tokens
    [0, num_tokens) where token i lives in block `block_ids[i // block_size]`.

    Shape (num_regions, num_tokens, num_heads, token_bytes), int64.
    """
    bs, nh, tb = layout.block_size, layout.num_heads, layout.token_bytes
    nblk = -(-num_tokens // bs)
    ids = [int(b) for b in list(block_ids)[:nblk]]
    assert len(ids) == nblk, "not enough blocks"
    inner = np.arange(bs * nh * tb, dtype=np.int64)
    if layout.order == "NHD":
        inner = inner.reshape(bs, nh, tb)
    else:
        inner = inner.reshape(nh, bs, tb).transpose(1, 0, 2)
    starts = np.array(
        [[reg.base - buf_base + b * reg.block_stride for b in ids] for reg in layout.regions], dtype=np.int64
    )  # (R, nblk)
    idx = starts[:, :, None, None, None] + inner[None, None]  # (R, nblk, bs, nh, tb)
    idx = idx.reshape(len(layout.regions), nblk * bs, nh, tb)
    return idx[:, :num_tokens]


def logical_view(buf: np.ndarray, layout: KVLayout, buf_base: int, block_ids, num_tokens: int) -> np.ndarray:
    return buf[logical_index(layout, buf_base, block_ids, num_tokens)]


def expected_after_copy(
    src_buf, src_base, src, dst_buf, dst_base, dst, route, src_blocks, dst_blocks, num_tokens, dst_first_token
) -> np.ndarray:
    """What dst_buf must look like after the transfer (a new array)."""
    h = route.num_heads
    si = logical_index(src, src_base, src_blocks, num_tokens)[
        :, dst_first_token:, route.src_head_start : route.src_head_start + h
    ]
    di = logical_index(dst, dst_base, dst_blocks, num_tokens - dst_first_token)[
        :, :, route.dst_head_start : route.dst_head_start + h
    ]
    assert si.shape == di.shape
    # every logical dst byte is a distinct buffer byte
    assert np.unique(di).size == di.size
    out = dst_buf.copy()
    out[di] = src_buf[si]
    return out


def _byte_index(addr: np.ndarray, length: np.ndarray, base: int, size: int) -> np.ndarray:
    assert np.all(addr >= np.uint64(base)), "descriptor below its buffer"
    rel = (addr - np.uint64(base)).astype(np.int64)  # exact in uint64 even for addresses >= 2**63
    assert np.all(rel >= 0) and np.all(rel + length <= size), "descriptor outside its buffer"
    total = int(length.sum())
    starts = np.repeat(rel - np.concatenate(([0], np.cumsum(length)[:-1])), length)
    return starts + np.arange(total, dtype=np.int64)


def apply_plan(plan, src_buf: np.ndarray, src_base: int, dst_buf: np.ndarray, dst_base: int) -> None:
    """Copy every descriptor of `plan` from src_buf to dst_buf by address (one buffer per side)."""
    src, dst = np.asarray(plan.src), np.asarray(plan.dst)
    assert src.dtype == np.uint64 and dst.dtype == np.uint64
    assert src.ndim == 2 and src.shape[1] == 3 and src.shape == dst.shape
    assert np.array_equal(src[:, 1], dst[:, 1]), "src and dst lengths differ"
    length = src[:, 1].astype(np.int64)
    assert np.all(length > 0)
    # NIXL may run descriptors in any order: dst ranges must not overlap
    order = np.argsort(dst[:, 0], kind="stable")
    d_sorted = dst[order, 0]
    assert np.all(d_sorted[1:] >= d_sorted[:-1] + dst[order, 1][:-1]), "overlapping dst descriptors"
    si = _byte_index(src[:, 0], length, src_base, src_buf.size)
    di = _byte_index(dst[:, 0], length, dst_base, dst_buf.size)
    dst_buf[di] = src_buf[si]


def make_layout(
    base: int,
    *,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    dtype_size: int,
    block_size: int,
    num_blocks: int,
    order: str,
    blocks_first: bool,
    pad: int = 0,
    mem_ids=None,
    head_offset: int = 0,
) -> tuple[KVLayout, int]:
    """A one-slab layout with `pad` spare bytes after every block, and per-region mem_ids.

    Returns (layout, slab bytes).
    """
    bb = block_size * num_heads * head_dim * dtype_size
    slot = bb + pad
    layer_bytes = 2 * num_blocks * slot
    regions = []
    for layer in range(num_layers):
        lb = base + layer * layer_bytes
        if blocks_first:
            planes = [(lb, 2 * slot), (lb + slot, 2 * slot)]
        else:
            planes = [(lb, slot), (lb + num_blocks * slot, slot)]
        for k, (b, s) in enumerate(planes):
            mem = 0 if mem_ids is None else mem_ids[2 * layer + k]
            regions.append(Region(b, s, mem, 0))
    layout = KVLayout(
        num_layers=num_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        dtype_size=dtype_size,
        dtype=f"u{dtype_size}",
        block_size=block_size,
        num_blocks=num_blocks,
        order=order,
        regions=regions,
        head_offset=head_offset,
    ).validate()
    return layout, num_layers * layer_bytes
