"""Block-granular plans (prepped per-block lists) against the independent numpy reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush_common.plan.blockplan import block_granular, plan_blocks, unit_table
from kvpush_common.protocol.layout import contiguous_layout, slab_bytes
from kvpush_common.plan.planner import PlanError, TransferPlan, plan_transfer
from kvpush_common.protocol.topology import routes
from kvpush_common.testing.kvref import logical_view


def _side(rng, *, heads, bs, order, blocks_first, num_blocks, geo):
    probe = contiguous_layout(0, num_heads=heads, block_size=bs, num_blocks=num_blocks, order=order,
                              blocks_first=blocks_first, **geo)
    buf = np.empty(slab_bytes(probe), np.uint8)
    layout = contiguous_layout(buf.ctypes.data, num_heads=heads, block_size=bs, num_blocks=num_blocks, order=order,
                               blocks_first=blocks_first, **geo)
    return buf, layout


def _draw_pairing(data):
    """KV heads in all, producer TP, consumer TP, and one route between them."""
    total = data.draw(st.sampled_from([1, 2, 4]))
    p_tp = data.draw(st.sampled_from([t for t in (1, 2, 4) if total % t == 0]))
    d_tp = data.draw(st.sampled_from([t for t in (1, 2, 4) if total % t == 0]))
    return total, p_tp, d_tp, data.draw(st.sampled_from(routes(total, p_tp, d_tp)))


def _copy(buf_s, ls, buf_d, ld, route, plan):
    """Apply a block plan the way NIXL would: entry i of one unit table onto entry j of the other."""
    us = unit_table(ls, route.src_head_start, route.num_heads)[plan.local_idx]
    ud = unit_table(ld, route.dst_head_start, route.num_heads)[plan.remote_idx]
    for (sa, ln, _), (da, _, _) in zip(us, ud):
        so, do = int(sa) - buf_s.ctypes.data, int(da) - buf_d.ctypes.data
        buf_d[do:do + int(ln)] = buf_s[so:so + int(ln)]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_block_plans_match_the_reference(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    total, p_tp, d_tp, route = _draw_pairing(data)
    bs = data.draw(st.sampled_from([1, 2, 4, 16]))
    geo = dict(num_layers=data.draw(st.integers(1, 3)), head_dim=data.draw(st.integers(1, 8)), dtype_size=2)
    nblk = 12
    buf_s, ls = _side(rng, heads=total // p_tp, bs=bs, order=data.draw(st.sampled_from(["NHD", "HND"])),
                      blocks_first=data.draw(st.booleans()), num_blocks=nblk, geo=geo)
    buf_d, ld = _side(rng, heads=total // d_tp, bs=bs, order=data.draw(st.sampled_from(["NHD", "HND"])),
                      blocks_first=data.draw(st.booleans()), num_blocks=nblk, geo=geo)
    n = data.draw(st.integers(1, 6 * bs))
    first = data.draw(st.integers(0, (n - 1) // bs)) * bs
    sblk = rng.permutation(nblk)[: -(-n // bs)]
    dblk = rng.permutation(nblk)[: -(-(n - first) // bs)]
    buf_s[:] = rng.integers(0, 256, buf_s.size, dtype=np.uint8)
    buf_d[:] = 0xAB
    if not block_granular(ls, ld, route):
        with pytest.raises(PlanError):
            plan_blocks(ls, ld, route, sblk, dblk, num_tokens=n, dst_first_token=first)
        return
    plan = plan_blocks(ls, ld, route, sblk, dblk, num_tokens=n, dst_first_token=first)
    _copy(buf_s, ls, buf_d, ld, route, plan)
    hs, hd, h = route.src_head_start, route.dst_head_start, route.num_heads
    src = logical_view(buf_s, ls, buf_s.ctypes.data, sblk, n)[:, first:, hs:hs + h]
    dst = logical_view(buf_d, ld, buf_d.ctypes.data, dblk, n - first)[:, :, hd:hd + h]
    np.testing.assert_array_equal(dst, src)


def test_mixed_block_orders_with_several_heads_are_not_block_granular():
    geo = dict(num_layers=1, head_dim=4, block_size=16, num_blocks=4)
    nhd, hnd = contiguous_layout(0, num_heads=2, order="NHD", **geo), contiguous_layout(1 << 20, num_heads=2, order="HND", **geo)
    assert not block_granular(nhd, hnd, routes(2, 1, 1)[0])
    one = dict(geo, num_heads=1)
    assert block_granular(contiguous_layout(0, order="NHD", **one), contiguous_layout(1 << 20, order="HND", **one),
                          routes(1, 1, 1)[0])


def test_out_of_range_and_duplicate_ids_are_refused():
    geo = dict(num_layers=1, num_heads=1, head_dim=4, block_size=4, num_blocks=4)
    a, b = contiguous_layout(0, **geo), contiguous_layout(1 << 20, **geo)
    r = routes(1, 1, 1)[0]
    with pytest.raises(PlanError, match="out of range"):
        plan_blocks(a, b, r, [0, 1], [1, 4], num_tokens=8)
    with pytest.raises(PlanError, match="more than once"):
        plan_blocks(a, b, r, [0, 1], [2, 2], num_tokens=8)
    with pytest.raises(PlanError, match="block ids"):
        plan_blocks(a, b, r, [0], [2, 3], num_tokens=8)


def test_kv_interleaved_layouts_move_whole_blocks():
    """vLLM's CPU cache (K rows then V rows per block and head) is kv_planes=1 with token_rows=False: whatever the token count,
    whole blocks move, on both planning paths, and mismatched block sizes are refused."""
    from kvpush_common.protocol.layout import KVLayout, Region
    from kvpush_common.plan.planner import plan_transfer

    def side(base, bs=4, nblk=4):
        row = 8  # 2 * head_size bytes-wide rows (dtype_size 1 for simplicity)
        return KVLayout(num_layers=2, num_heads=2, head_dim=row, dtype_size=1, dtype="int8", block_size=bs,
                        num_blocks=nblk, order="HND", kv_planes=1, token_rows=False,
                        regions=[Region(base + layer * nblk * 2 * bs * row, 2 * bs * row) for layer in range(2)])

    src, dst = side(0), side(1 << 20)
    route = routes(2, 1, 1)[0]
    plan = plan_transfer(src, dst, route, [0, 1], [2, 3], num_tokens=5)  # 5 tokens -> 2 whole blocks
    assert plan.nbytes == 2 * 2 * (2 * 4 * 8)  # layers * blocks * block bytes
    bp = plan_blocks(src, dst, route, [0, 1], [2, 3], num_tokens=5)
    assert bp.nbytes == plan.nbytes and bp.num_descs == 4
    with pytest.raises(PlanError, match="whole blocks"):
        plan_transfer(src, side(1 << 20, bs=8, nblk=2), route, [0, 1], [1], num_tokens=5)


def _apply_rows(buf_s, buf_d, plan):
    for (sa, ln, _), (da, _, _) in zip(plan.src, plan.dst):
        so, do = int(sa) - buf_s.ctypes.data, int(da) - buf_d.ctypes.data
        buf_d[do:do + int(ln)] = buf_s[so:so + int(ln)]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_merged_runs_copy_the_same_bytes_as_per_block_plans(data):
    """plan_write's merged block runs move exactly what the per-block plan moves, in fewer descriptors."""
    from kvpush_common.plan.blockplan import merge_runs
    from kvpush_common.plan.write import plan_write

    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    total, p_tp, d_tp, route = _draw_pairing(data)
    bs = data.draw(st.sampled_from([1, 2, 4]))
    order = data.draw(st.sampled_from(["NHD", "HND"]))
    geo = dict(num_layers=data.draw(st.integers(1, 3)), head_dim=data.draw(st.integers(1, 8)), dtype_size=2)
    nblk = 16
    buf_s, ls = _side(rng, heads=total // p_tp, bs=bs, order=order, blocks_first=data.draw(st.booleans()),
                      num_blocks=nblk, geo=geo)
    buf_d, ld = _side(rng, heads=total // d_tp, bs=bs, order=order, blocks_first=data.draw(st.booleans()),
                      num_blocks=nblk, geo=geo)
    n = data.draw(st.integers(1, 8 * bs))
    first = data.draw(st.integers(0, (n - 1) // bs)) * bs
    k_s, k_d = -(-n // bs), -(-(n - first) // bs)
    if data.draw(st.booleans()):  # runs: consecutive (possibly reversed on both sides) or shuffled
        start_s, start_d = data.draw(st.integers(0, nblk - k_s)), data.draw(st.integers(0, nblk - k_d))
        sblk, dblk = np.arange(start_s, start_s + k_s), np.arange(start_d, start_d + k_d)
        if data.draw(st.booleans()):
            sblk, dblk = sblk[::-1].copy(), dblk[::-1].copy()
    else:
        sblk, dblk = rng.permutation(nblk)[:k_s], rng.permutation(nblk)[:k_d]
    buf_s[:] = rng.integers(0, 256, buf_s.size, dtype=np.uint8)
    buf_d[:] = 0xAB
    if not block_granular(ls, ld, route):  # whole blocks do not line up: the entry point is the general planner
        plan = plan_write(ls, ld, route, sblk, dblk, num_tokens=n, dst_first_token=first, prepped=True)
        ref = plan_transfer(ls, ld, route, sblk, dblk, num_tokens=n, dst_first_token=first)
        assert isinstance(plan, TransferPlan) and np.array_equal(plan.src, ref.src) and np.array_equal(plan.dst, ref.dst)
        return
    bp = plan_blocks(ls, ld, route, sblk, dblk, num_tokens=n, dst_first_token=first)
    _copy(buf_s, ls, buf_d, ld, route, bp)
    ref_d = buf_d.copy()
    buf_d[:] = 0xAB
    merged = merge_runs(ls, ld, route, bp)
    plan = plan_write(ls, ld, route, sblk, dblk, num_tokens=n, dst_first_token=first, prepped=True)
    if merged is None:
        assert isinstance(plan, type(bp)) and np.array_equal(plan.local_idx, bp.local_idx)
        assert np.array_equal(plan.remote_idx, bp.remote_idx)
        return
    assert merged.nbytes == bp.nbytes and merged.num_descs <= bp.num_descs
    _apply_rows(buf_s, buf_d, merged)
    np.testing.assert_array_equal(buf_d, ref_d)


def test_consecutive_blocks_merge_into_one_descriptor_per_region():
    from kvpush_common.plan.blockplan import merge_runs

    geo = dict(num_layers=4, num_heads=1, head_dim=8, block_size=16, num_blocks=64)
    src, dst = contiguous_layout(0, **geo), contiguous_layout(1 << 30, **geo)
    route = routes(1, 1, 1)[0]
    # blocks freed in reverse and reallocated on both sides: descending, still one run after sorting
    bp = plan_blocks(src, dst, route, list(range(40, 8, -1)), list(range(63, 31, -1)), num_tokens=32 * 16)
    merged = merge_runs(src, dst, route, bp)
    assert merged.num_descs == len(src.regions) and bp.num_descs == 32 * len(src.regions)
    assert int(merged.src[0, 1]) == 32 * src.block_bytes


def test_region_columns_are_per_layout_object_even_past_the_cache_bound():
    """Each layout's base/stride/device columns are built once and reused; more layouts than the cache holds
    (peers coming and going) still each get their own addresses."""
    from kvpush_common.plan import blockplan
    from kvpush_common.protocol.layout import contiguous_layout

    geo = dict(num_layers=2, num_heads=1, head_dim=8, block_size=4, num_blocks=3)
    layouts = [contiguous_layout(1 << (20 + i % 20), **geo) for i in range(70)]
    for lay in layouts + layouts[:3]:
        table = blockplan.unit_table(lay, 0, 1)
        assert int(table[0, 0]) == lay.regions[0].base and int(table[-1, 0]) == lay.regions[-1].base + 2 * lay.regions[-1].block_stride
    first, again = blockplan._region_columns(layouts[-1]), blockplan._region_columns(layouts[-1])
    assert all(a is b for a, b in zip(first, again))  # built once, not per call


def test_cross_layer_tiling_is_decided_per_layout_object_even_past_the_cache_bound():
    """`_blocks_tile` is checked once per layout (it ran twice per push); cross-layer and per-layer layouts
    alternating past the cache's bound each keep their own answer, and a route with fewer heads never tiles."""
    from kvpush_common.plan import blockplan

    geo = dict(num_layers=2, num_heads=2, head_dim=8, block_size=4, num_blocks=3)
    layouts = [contiguous_layout(1 << (20 + i % 20), cross_layer=i % 2 == 0, **geo) for i in range(70)]
    whole, half = routes(2, 1, 1)[0], routes(2, 2, 2)[0]
    for i, lay in enumerate(layouts + layouts[:3]):
        assert blockplan._blocks_tile(lay, whole) is (i % 2 == 0)
        assert blockplan._blocks_tile(lay, half) is False


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_one_run_fast_path_plans_what_the_numpy_path_plans(data):
    """Consecutive ids as Python lists take `plan_one_run`; the same ids as a numpy array take the per-block path.
    Both give the same plan (or both refuse it), over per-layer and cross-layer layouts, prepped or not."""
    from kvpush_common.plan.write import plan_write

    total, p_tp, d_tp, route = _draw_pairing(data)
    bs = data.draw(st.sampled_from([1, 2, 4]))
    order = data.draw(st.sampled_from(["NHD", "HND"]))
    geo = dict(num_layers=data.draw(st.integers(1, 3)), head_dim=data.draw(st.integers(1, 8)), dtype_size=2,
               block_size=bs, num_blocks=16, order=order, cross_layer=data.draw(st.booleans()))
    ls = contiguous_layout(1 << 30, num_heads=total // p_tp, **geo)
    ld = contiguous_layout(1 << 40, num_heads=total // d_tp, **geo)
    n = data.draw(st.integers(1, 8 * bs))
    first = data.draw(st.integers(0, (n - 1) // bs)) * bs
    k_s, k_d = -(-n // bs), -(-(n - first) // bs)
    sblk = list(range(data.draw(st.integers(-1, 17 - k_s)), 99))[:k_s + data.draw(st.integers(0, 2))]
    dblk = list(range(data.draw(st.integers(-1, 17 - k_d)), 99))[:k_d]
    if data.draw(st.booleans()) and len(sblk) > 1:
        sblk[-1] += 1  # the run breaks at its end
    prepped = data.draw(st.booleans())
    try:
        ref = plan_write(ls, ld, route, np.array(sblk), np.array(dblk), num_tokens=n, dst_first_token=first,
                         prepped=prepped)
    except PlanError:
        with pytest.raises(PlanError):
            plan_write(ls, ld, route, sblk, tuple(dblk), num_tokens=n, dst_first_token=first, prepped=prepped)
        return
    got = plan_write(ls, ld, route, sblk, tuple(dblk), num_tokens=n, dst_first_token=first, prepped=prepped)
    assert type(got) is type(ref) and got.nbytes == ref.nbytes and got.num_descs == ref.num_descs
    if isinstance(ref, TransferPlan):
        np.testing.assert_array_equal(got.src, ref.src)
        np.testing.assert_array_equal(got.dst, ref.dst)
        assert got.src.dtype == ref.src.dtype == np.uint64
    else:
        np.testing.assert_array_equal(got.local_idx, ref.local_idx)
        np.testing.assert_array_equal(got.remote_idx, ref.remote_idx)


def test_consecutive_start_takes_only_whole_int_runs_in_range():
    from kvpush_common.plan.blockplan import consecutive_start

    assert consecutive_start((3, 4, 5), 0, 3, 6) == 3
    assert consecutive_start([9, 3, 4, 7], 1, 2, 6) == 3  # only the needed slice counts
    assert consecutive_start((3, 4, 5), 0, 3, 5) is None  # 5 is out of range
    assert consecutive_start((-1, 0), 0, 2, 5) is None
    assert consecutive_start((3, 5), 0, 2, 9) is None
    assert consecutive_start((3, 4), 0, 3, 9) is None  # too few ids
    assert consecutive_start((2.0, 3.0), 0, 2, 9) is None  # floats go to the numpy path, which refuses them
    assert consecutive_start((2, 3.0), 0, 2, 9) is None
    assert consecutive_start((False, True), 0, 2, 9) is None
    assert consecutive_start(np.arange(3), 0, 3, 9) is None  # arrays: the numpy path
    assert consecutive_start((2**63, 2**63 + 1), 0, 2, 2**64) is None
    assert consecutive_start(tuple(range(70_000, 70_300)), 0, 300, 10**6) == 70_000  # past what was compared before
    assert consecutive_start((70_000, 70_001, 70_003), 0, 3, 10**6) is None
