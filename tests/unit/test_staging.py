"""Staging building blocks: plane grids of real layouts, slot pools, host gather/scatter round trips."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush_common.device.host import HostBackend
from kvpush_common.protocol.layout import KVLayout, Region, contiguous_layout
from kvpush_common.plan.planner import PlanError
from kvpush_common.plan.staging import SlotPool, StagedWrite, blocks_per_chunk, plane_grid, staged_pairs


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 4), heads=st.integers(1, 3), bs=st.sampled_from([1, 4, 16]), blocks_first=st.booleans(),
       order=st.sampled_from(["HND", "NHD"]), data=st.data())
def test_gather_then_scatter_moves_exactly_the_chosen_blocks(layers, heads, bs, blocks_first, order, data):
    geo = dict(num_layers=layers, num_heads=heads, head_dim=4, block_size=bs, num_blocks=12,
               blocks_first=blocks_first, order=order)
    src, dst = HostBackend(**geo), HostBackend(**geo)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    src.buffer[:] = rng.integers(0, 256, src.buffer.size, dtype=np.uint8)
    n = data.draw(st.integers(1, 12))
    sb, db = rng.permutation(12)[:n], rng.permutation(12)[:n]
    a, _ = src.staging_buffer(1 << 16)
    b, _ = dst.staging_buffer(1 << 16)
    src.gather(sb, a)
    dst.staging[:] = src.staging
    dst.scatter(db, b)
    regions = len(src.layout().regions)
    for s, d in zip(sb, db):
        for r in range(regions):
            np.testing.assert_array_equal(dst.block_view(r, int(d)), src.block_view(r, int(s)))
    untouched = set(range(12)) - {int(x) for x in db}
    assert all((dst.block_view(r, x) == 0).all() for r in range(regions) for x in untouched)


def test_plane_grid_refuses_irregular_regions():
    regions = [Region(0, 64), Region(1000, 64), Region(5000, 64)]
    layout = KVLayout(num_layers=3, num_heads=1, head_dim=16, dtype_size=2, dtype="bfloat16", block_size=2,
                      num_blocks=4, order="HND", kv_planes=1, regions=regions)
    with pytest.raises(PlanError, match="uniform grid"):
        plane_grid(layout)


def test_slot_pool_hands_out_each_slot_once():
    pool = SlotPool(1 << 20, 4 * 4096, 4096)
    got = [pool.take() for _ in range(5)]
    assert got[:4] == [0, 1, 2, 3] and got[4] is None
    assert pool.slot_addr(2) == (1 << 20) + 2 * 4096
    pool.give(2)
    with pytest.raises(ValueError, match="twice"):
        pool.give(2)
    with pytest.raises(ValueError, match="out of range"):
        pool.give(9)


def test_chunks_cover_the_request_in_registration_order():
    layout = contiguous_layout(0, num_layers=2, num_heads=1, head_dim=8, block_size=16, num_blocks=64)
    per_chunk = blocks_per_chunk(layout, 4096)  # 4 regions x 256 B per block
    assert per_chunk == 4
    s, d = staged_pairs(layout, layout, [9, 3, 7, 1, 5, 11], [2, 4, 6, 8, 10], num_tokens=6 * 16, dst_first_token=16)
    assert list(s) == [3, 7, 1, 5, 11] and list(d) == [2, 4, 6, 8, 10]
    w = StagedWrite(s, per_chunk, 4 * 256)
    assert w.chunks == 2 and w.span(0) == (0, 4) and w.span(1) == (4, 1)
    with pytest.raises(PlanError, match="exceeds the staging chunk"):
        blocks_per_chunk(layout, 512)


def _torch_caches(shape, seed, zero=False, layers=3):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.attn": (torch.zeros(shape, dtype=torch.bfloat16) if zero else
                                       torch.randint(0, 100, shape, generator=g).to(torch.bfloat16))
            for i in range(layers)}


@pytest.mark.parametrize("kind", ["vllm-cpu", "flash-attn", "flash-infer", "flash-attn-hnd"])
def test_tensor_staging_round_trips_vllm_caches(kind):
    """vLLM's own per-layer tensors (CPU layout, and the CUDA layouts on CPU tensors) gather and scatter
    exactly the chosen blocks, in physical byte order."""
    import torch

    from kvpush_common.vllm.host_cache import VllmCpuCache
    from kvpush_common.vllm.tensor_staging import TensorStaging

    sb, db = [3, 1, 7], [0, 5, 2]
    if kind == "vllm-cpu":
        src, dst = _torch_caches((10, 2, 4, 16), 1), _torch_caches((10, 2, 4, 16), 0, zero=True)
        a, b = VllmCpuCache(src, 0), VllmCpuCache(dst, 0)
        block_dim, (sa, _), (da, _) = 0, a.staging_buffer(1 << 16), b.staging_buffer(1 << 16)
        a.gather(sb, sa)
        b._staging.buffer.copy_(a._staging.buffer)
        b.scatter(db, da)
    else:
        from kvpush_cuda.kv_cache import describe_cuda_caches

        shape = (10, 2, 4, 2, 8) if kind == "flash-infer" else (2, 10, 4, 2, 8)
        src, dst = _torch_caches(shape, 1), _torch_caches(shape, 0, zero=True)
        if kind == "flash-attn-hnd":  # logical (block_size, heads) dims over HND-packed memory
            src = {k: v.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4) for k, v in src.items()}
            dst = {k: v.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4) for k, v in dst.items()}
        block_dim = 0 if kind == "flash-infer" else 1
        s = TensorStaging(describe_cuda_caches(src, block_size=4, num_heads=2, head_size=8)[0], list(src.values()))
        d = TensorStaging(describe_cuda_caches(dst, block_size=4, num_heads=2, head_size=8)[0], list(dst.values()))
        sa, _ = s.staging_buffer(1 << 16)
        da, _ = d.staging_buffer(1 << 16)
        s.gather(sb, sa)
        d.buffer.copy_(s.buffer)
        d.scatter(db, da)
    for k in src:
        assert torch.equal(dst[k].index_select(block_dim, torch.tensor(db)), src[k].index_select(block_dim, torch.tensor(sb)))
        rest = torch.tensor(sorted(set(range(10)) - set(db)))
        assert int((dst[k].index_select(block_dim, rest) != 0).sum()) == 0
