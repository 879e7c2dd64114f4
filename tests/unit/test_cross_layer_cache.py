"""vLLM 0.26's cross-layer KV cache (`cross_layer_blocks`): the per-layer views kvpush takes of it match vLLM's
own (`allocate_uniform_kv_caches`), bytes move exactly to and from per-layer caches, a run of consecutive blocks
is one descriptor, and its registration is whole only where asked.  CPU tensors; no GPU needed."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvpush_common.plan.planner import TransferPlan, plan_transfer
from kvpush_common.plan.write import plan_write
from kvpush_common.protocol.layout import LayoutError
from kvpush_common.protocol.topology import routes
from kvpush_common.testing.kvref import apply_plan
from kvpush_common.vllm.connector import KVPushConnector
from kvpush_common.vllm.cross_layer import cross_layer_views
from kvpush_cuda.device import sliced_registrations
from kvpush_cuda.kv_cache import describe_cuda_caches

L, B, H, BS, D = 3, 8, 2, 4, 8  # layers, blocks, KV heads, block size, head size
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
CONFIG = SimpleNamespace(kv_cache_tensors=[SimpleNamespace(shared_by=[n]) for n in NAMES])


class FlashAttn:
    """vLLM 0.26 FlashAttention's stride orders with the layers dim (v1/attention/backends/flash_attn.py)."""

    layout = "NHD"

    @classmethod
    def get_kv_cache_stride_order(cls, include_num_layers_dimension=False):
        assert include_num_layers_dimension
        return (1, 0, 3, 2, 4) if cls.layout == "NHD" else (1, 2, 0, 3, 4)


class FlashAttnHND(FlashAttn):
    layout = "HND"


def cross_layer_cache(backend, fill=None):
    """What vLLM's allocate_uniform_kv_caches allocates and hands register_cross_layers_kv_cache, plus its own
    per-layer views (the ones the attention layers write through)."""
    shape = (L, B, H, BS, 2 * D)  # (layers,) + packed get_kv_cache_shape
    order = backend.get_kv_cache_stride_order(include_num_layers_dimension=True)
    raw = torch.zeros(int(np.prod(shape)) * 2, dtype=torch.uint8)
    if fill is not None:
        raw.copy_(torch.from_numpy(np.random.default_rng(fill).integers(0, 256, raw.numel(), dtype=np.uint8)))
    cross = raw.view(torch.bfloat16).view(tuple(shape[i] for i in order))
    permuted = cross.permute(*[order.index(i) for i in range(5)])
    return raw, cross, {n: permuted[i] for i, n in enumerate(NAMES)}


def per_layer_cache(fill=None):
    """vLLM 0.26's ordinary per-layer caches, NHD (blocks, heads, block_size, 2D) over (blocks, bs, heads, 2D)."""
    raw = torch.zeros(L * B * H * BS * 2 * D * 2, dtype=torch.uint8)
    if fill is not None:
        raw.copy_(torch.from_numpy(np.random.default_rng(fill).integers(0, 256, raw.numel(), dtype=np.uint8)))
    per = B * BS * H * 2 * D
    views = raw.view(torch.bfloat16)
    return raw, {n: views[i * per:(i + 1) * per].view(B, BS, H, 2 * D).permute(0, 2, 1, 3) for i, n in enumerate(NAMES)}


@pytest.mark.parametrize("backend", [FlashAttn, FlashAttnHND])
def test_views_are_vllms_own(backend):
    raw, cross, vllm_views = cross_layer_cache(backend)
    views = cross_layer_views(cross, backend, CONFIG)
    assert list(views) == NAMES
    for n in NAMES:
        assert views[n].data_ptr() == vllm_views[n].data_ptr()
        assert views[n].shape == vllm_views[n].shape and views[n].stride() == vllm_views[n].stride()
    views[NAMES[1]][5, 1, 2, 3] = 7.0  # block 5, head 1, token 2, element 3 of layer 1
    assert float(cross[5, 1, 2, 1, 3] if backend is FlashAttn else cross[5, 1, 1, 2, 3]) == 7.0


def test_a_run_of_consecutive_blocks_is_one_descriptor_and_moves_exactly():
    sraw, scross, _ = cross_layer_cache(FlashAttn, fill=1)
    draw, dcross, _ = cross_layer_cache(FlashAttn)
    src = describe_cuda_caches(cross_layer_views(scross, FlashAttn, CONFIG), block_size=BS, num_heads=H, head_size=D)[0]
    dst = describe_cuda_caches(cross_layer_views(dcross, FlashAttn, CONFIG), block_size=BS, num_heads=H, head_size=D)[0]
    assert src.regions[1].base - src.regions[0].base == BS * H * 2 * D * 2  # layer pages alternate in a block
    assert src.regions[0].block_stride == L * BS * H * 2 * D * 2
    route = routes(H, 1, 1)[0]
    general = plan_transfer(src, dst, route, [2, 3, 4], [5, 6, 7], num_tokens=3 * BS)
    for prepped in (False, True):  # the writer's path (block runs), with and without per-peer prepped lists
        plan = plan_write(src, dst, route, [2, 3, 4], [5, 6, 7], num_tokens=3 * BS, prepped=prepped)
        assert isinstance(plan, TransferPlan) and plan.num_descs == 1 and plan.nbytes == 3 * L * BS * H * 2 * D * 2
        assert np.array_equal(plan.src, general.src) and np.array_equal(plan.dst, general.dst)
    apply_plan(plan, sraw.numpy(), sraw.data_ptr(), draw.numpy(), draw.data_ptr())
    assert torch.equal(dcross[5:8].view(torch.int16), scross[2:5].view(torch.int16))
    assert int(dcross[:5].view(torch.int16).count_nonzero()) == 0
    runs = plan_write(src, dst, route, [6, 0, 1, 2], [0, 1, 2, 3], num_tokens=4 * BS - 1)  # two runs, last block part
    assert runs.num_descs == 2 and runs.nbytes == 4 * L * BS * H * 2 * D * 2  # whole blocks move
    fresh = torch.zeros_like(draw)
    apply_plan(runs, sraw.numpy(), sraw.data_ptr(), fresh.numpy(), draw.data_ptr())  # plan addresses: draw
    moved = fresh.view(torch.bfloat16).view(dcross.shape).view(torch.int16)
    for s_blk, d_blk in ((6, 0), (0, 1), (1, 2), (2, 3)):
        assert torch.equal(moved[d_blk], scross[s_blk].view(torch.int16))
    one_head = routes(H, 1, 2)[0]  # one head of an NHD block is a row per token: the general planner, per (layer, token)
    assert plan_write(src, dst, one_head, [2, 3], [5, 6], num_tokens=2 * BS, prepped=True).num_descs == L * 2 * BS
    per_layer = 3 * 2  # per-layer caches: one run per layer (and K|V share rows)
    pr, pl = per_layer_cache(fill=2)
    p_layout = describe_cuda_caches(pl, block_size=BS, num_heads=H, head_size=D)[0]
    assert plan_transfer(p_layout, p_layout, routes(H, 1, 1)[0], [2, 3, 4], [5, 6, 7],
                         num_tokens=3 * BS).num_descs == L < per_layer


@pytest.mark.parametrize("direction", ["cross to per-layer", "per-layer to cross"])
def test_a_cross_layer_instance_pairs_with_a_per_layer_one(direction):
    """The setting is per instance: both layouts describe every token of every head, so they pair byte-exactly."""
    craw, cross, _ = cross_layer_cache(FlashAttn, fill=3 if direction.startswith("cross") else None)
    praw, per = per_layer_cache(fill=None if direction.startswith("cross") else 4)
    c_views = cross_layer_views(cross, FlashAttn, CONFIG)
    c_layout = describe_cuda_caches(c_views, block_size=BS, num_heads=H, head_size=D)[0]
    p_layout = describe_cuda_caches(per, block_size=BS, num_heads=H, head_size=D)[0]
    (s_layout, s_raw, s_views), (d_layout, d_raw, d_views) = (
        ((c_layout, craw, c_views), (p_layout, praw, per)) if direction.startswith("cross")
        else ((p_layout, praw, per), (c_layout, craw, c_views)))
    plan = plan_transfer(s_layout, d_layout, routes(H, 1, 1)[0], [6, 1], [0, 3], num_tokens=7)
    apply_plan(plan, s_raw.numpy(), s_raw.data_ptr(), d_raw.numpy(), d_raw.data_ptr())
    for n in NAMES:
        s, d = s_views[n].view(torch.int16), d_views[n].view(torch.int16)  # (blocks, heads, tokens, 2D)
        assert torch.equal(d[0], s[6]) and torch.equal(d[3, :, :3], s[1, :, :3])
        assert int(d[3, :, 3:].count_nonzero()) == 0 and int(d[[1, 2, 4, 5, 6, 7]].count_nonzero()) == 0


def test_registered_whole_only_where_asked():
    raw, cross, _ = cross_layer_cache(FlashAttn)
    layout, allocations, _ = describe_cuda_caches(cross_layer_views(cross, FlashAttn, CONFIG), block_size=BS,
                                                  num_heads=H, head_size=D)
    assert allocations == [(raw.data_ptr(), raw.numel())]
    whole, regs = sliced_registrations(layout, allocations, 0, limit=raw.numel() // 2, whole_interleaved=True)
    assert regs.tolist() == [[raw.data_ptr(), raw.numel(), 0]] and {r.mem_id for r in whole.regions} == {0}
    with pytest.raises(LayoutError, match="cross_layer_blocks"):
        sliced_registrations(layout, allocations, 0, limit=raw.numel() // 2)


def test_bad_cross_layer_tensors_are_refused():
    _, cross, _ = cross_layer_cache(FlashAttn)
    with pytest.raises(LayoutError, match="holds 3 layers, the KV cache config lists 2"):
        cross_layer_views(cross, FlashAttn, SimpleNamespace(kv_cache_tensors=CONFIG.kv_cache_tensors[:2]))

    class Broken(FlashAttn):
        @classmethod
        def get_kv_cache_stride_order(cls, include_num_layers_dimension=False):
            return (0, 0, 1, 2, 3)

    with pytest.raises(LayoutError, match="does not permute"):
        cross_layer_views(cross, Broken, CONFIG)


def test_the_connector_asks_vllm_for_it_for_whole_request_transfers_over_ucx():
    """CUDA, unset: wished for over UCX (where one descriptor per run pays); set: as set.
    The base connector (vLLM's CPU build, the Neuron plugin) asks only when set true."""
    from kvpush_common.testing.vllm_config import vllm_config
    from kvpush_common.vllm.settings import ConnectorSettings
    from kvpush_cuda.connector import KVPushCudaConnector

    conn = KVPushConnector.__new__(KVPushConnector)
    for extra, wished in (({}, True), ({"backend": "LIBFABRIC"}, False), ({"cross_layer_blocks": False}, False),
                          ({"backend": "LIBFABRIC", "cross_layer_blocks": True}, True)):
        settings = ConnectorSettings.from_vllm(vllm_config(**extra))
        assert KVPushCudaConnector.asks_cross_layer(settings) is wished, extra
        conn.settings = settings
        assert conn.prefer_cross_layer_blocks is (extra.get("cross_layer_blocks") is True), extra
    with pytest.raises(ValueError, match=r"kv_connector_extra_config.cross_layer_blocks: expected `bool"):
        ConnectorSettings.from_vllm(vllm_config(cross_layer_blocks="yes"))


@pytest.mark.parametrize("orders,wished", [({(1, 0, 3, 2, 4)}, True), ({(1, 2, 0, 3, 4)}, False),
                                           ({(1, 0, 3, 2, 4), (1, 2, 0, 3, 4)}, False), (None, False)])
def test_the_cuda_connector_asks_only_where_layers_sit_right_inside_the_block(monkeypatch, orders, wished):
    """FlashAttention NHD puts (block, layer) outermost: each layer's view is a kvpush layout.  HND puts heads
    outside the layers, which no KVLayout describes: asking would fail the start-up, so it is not asked."""
    from kvpush_common.testing.vllm_config import vllm_config
    from kvpush_common.vllm.settings import ConnectorSettings
    from kvpush_cuda import connector as cuda_connector

    monkeypatch.setattr(cuda_connector, "cross_layer_stride_orders", lambda cfg: orders)
    conn = cuda_connector.KVPushCudaConnector.__new__(cuda_connector.KVPushCudaConnector)
    conn._vllm_config = None
    conn.settings = ConnectorSettings.from_vllm(vllm_config())
    assert conn.prefer_cross_layer_blocks is wished
    conn.settings = ConnectorSettings.from_vllm(vllm_config(cross_layer_blocks=False))
    assert conn.prefer_cross_layer_blocks is False


def test_cross_layer_stride_orders_come_from_vllms_attention_backends(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector import utils

    from kvpush_cuda.connector import cross_layer_stride_orders

    monkeypatch.setattr(utils, "get_current_attn_backends", lambda cfg: [FlashAttn, FlashAttnHND, FlashAttn])
    assert cross_layer_stride_orders(SimpleNamespace()) == {(1, 0, 3, 2, 4), (1, 2, 0, 3, 4)}

    def broken(cfg):
        raise RuntimeError("no layers")

    monkeypatch.setattr(utils, "get_current_attn_backends", broken)
    assert cross_layer_stride_orders(SimpleNamespace()) is None
