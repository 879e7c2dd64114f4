"""What the vLLM Neuron plugin hands the connector and what it never calls (docs/neuron.md), on CPU:
settings it cannot serve are refused at start-up, KV cache groups beyond one (vLLM's hybrid KV cache
manager) and groups of mixed KV shapes are refused naming the group, buffers shared by several layers are
registered once, and the simulated plugin registers the tensors the plugin registers and calls no
per-layer hook."""

from types import SimpleNamespace

import pytest
import torch

from kvpush_common.protocol.layout import LayoutError
from kvpush_common.testing.vllm_config import parallel_config
from kvpush_common.vllm.kv_groups import kv_group_problem
from kvpush_neuron.connector import KVPushNeuronConnector, neuron_settings_problems
from kvpush_neuron.kv_cache import describe_neuron_caches
from kvpush_neuron.testing.simulated_plugin import SimulatedNeuronPluginConnector, plugin_register_view
from kvpush_neuron.slab import plugin_kv_caches, ready_sim_runtime

B, H, BS, D = 6, 2, 32, 8


def settings(**kw):
    return SimpleNamespace(**{"kv_fence": "output", **kw})


def spec(kind="FullAttentionSpec", heads=H, head_size=D, window=None):
    return type(kind, (), {"num_kv_heads": heads, "head_size": head_size, "dtype": torch.bfloat16,
                           "block_size": BS, "sliding_window": window})()


def group(names, s):
    return SimpleNamespace(layer_names=list(names), kv_cache_spec=s)


def vllm_config(extra: dict):
    kt = SimpleNamespace(kv_role="kv_producer", kv_connector_extra_config=extra, engine_id="P", kv_connector="x")
    model = SimpleNamespace(served_model_name="m", model="m", get_total_num_kv_heads=lambda: 2)
    return SimpleNamespace(kv_transfer_config=kt, model_config=model,
                           parallel_config=parallel_config(1))


# ---- settings the plugin cannot serve --------------------------------------------------------------

def test_the_event_fence_is_refused_at_start_up():
    """The plugin's runtime gives no device event: kv_fence="event" would silently fence nothing on Neuron."""
    assert neuron_settings_problems(settings()) == []
    text = "\n".join(neuron_settings_problems(settings(kv_fence="event")))
    assert 'kv_fence="event"' in text and 'keep the default kv_fence="output"' in text
    with pytest.raises(ValueError, match="KVPushNeuronConnector cannot serve this configuration"):
        KVPushNeuronConnector(vllm_config({"kv_fence": "event"}), None)  # before any role starts anything


# ---- KV cache groups -----------------------------------------------------------------------------

def test_hybrid_kv_cache_groups_are_refused_naming_each_group():
    """GPT-OSS as the plugin's DI tutorial runs it (--no-disable-hybrid-kv-cache-manager): full and
    sliding-window layers in two groups over shared buffers; group 0's block ids are not group 1's blocks."""
    cfg = SimpleNamespace(kv_cache_groups=[group(["layers.0.self_attn", "layers.2.self_attn"], spec()),
                                           group(["layers.1.self_attn", "layers.3.self_attn"],
                                                 spec("SlidingWindowSpec", window=128))])
    problem = kv_group_problem(cfg)
    assert "2 groups" in problem and "group 1: SlidingWindowSpec(sliding_window=128) for layers.1.self_attn" in problem
    assert "without --no-disable-hybrid-kv-cache-manager" in problem
    assert neuron_settings_problems(settings(), cfg) == [problem]
    # one group, sliding-window layers kept whole (vLLM without the flag): served
    assert kv_group_problem(SimpleNamespace(kv_cache_groups=[group(["l.0", "l.1"], spec())])) is None
    assert kv_group_problem(SimpleNamespace(kv_cache_groups=[group(["l.0"], spec("SlidingWindowSpec", window=64))]))\
        is None
    assert kv_group_problem(None) is None  # the plugin's worker role may get no KVCacheConfig


def test_a_group_of_mixed_kv_shapes_is_refused_naming_the_layers():
    """An EAGLE drafter whose KV shape differs from the target's joins its group as UniformTypeKVCacheSpecs."""
    uniform = SimpleNamespace(kv_cache_specs={"layers.0.self_attn": spec(), "layers.1.self_attn": spec(),
                                              "draft.layers.0.self_attn": spec(heads=1, head_size=16)})
    problem = kv_group_problem(SimpleNamespace(kv_cache_groups=[group(uniform.kv_cache_specs, uniform)]))
    assert "2 KV shapes" in problem and "draft.layers.0.self_attn" in problem and "EAGLE drafter" in problem


def test_a_drafter_layer_of_another_shape_is_refused_at_registration():
    rt = ready_sim_runtime()
    kv = plugin_kv_caches(rt, num_layers=2, num_heads=H, head_dim=D, num_blocks=B)
    kv["draft.layers.0.self_attn"] = plugin_kv_caches(rt, num_layers=1, num_heads=1, head_dim=16,
                                                      num_blocks=B)["layers.0.self_attn"]
    with pytest.raises(LayoutError, match=r"draft.layers.0.self_attn \(\(6, 1, 32, 16\).*EAGLE drafter"):
        describe_neuron_caches(kv, rt, block_size=BS)
    same = dict(kv, **{"draft.layers.0.self_attn": plugin_kv_caches(rt, num_layers=1, num_heads=H, head_dim=D,
                                                                      num_blocks=B)["layers.0.self_attn"]})
    assert describe_neuron_caches(same, rt, block_size=BS)[0].num_layers == 3  # a drafter of the target's shape


# ---- shared buffers --------------------------------------------------------------------------------

def test_layers_sharing_a_buffer_are_registered_once():
    rt = ready_sim_runtime()
    kv = plugin_kv_caches(rt, num_layers=4, num_heads=H, head_dim=D, num_blocks=B, shared={2: 0, 3: 1})
    layout, regs, _ = describe_neuron_caches(kv, rt, block_size=BS)
    assert layout.num_layers == 2 and len(regs) == 4 and len({int(r[0]) for r in regs}) == 4
    assert [r.base for r in layout.regions] == [rt.data_ptr(kv[f"layers.{i}.self_attn"][p]) for i in (0, 1)
                                                 for p in (0, 1)]


def test_layers_overlapping_without_being_one_buffer_are_refused():
    """vLLM's hybrid manager lays each group's layer over shared KVCacheTensors; views that overlap but differ
    are not one layer's KV."""
    rt = ready_sim_runtime()
    buf, _ = rt.allocate(2 * (B + 1) * H * BS * D * 2)
    t = buf.view(torch.bfloat16)
    plane = B * H * BS * D
    a = t[: 2 * plane].view(2, B, H, BS, D)
    b = t[H * BS * D: H * BS * D + 2 * plane].view(2, B, H, BS, D)  # one block further on
    with pytest.raises(LayoutError, match="overlap in device memory without being the same buffer"):
        describe_neuron_caches({"layers.0.self_attn": a, "layers.1.self_attn": b}, rt, block_size=BS)


# ---- the simulated plugin follows the real one ---------------------------------------------------------

def test_the_simulated_plugin_registers_what_the_plugin_registers():
    """One int8 buffer per KVCacheTensor, one dtype view per buffer, per layer the full (2, blocks, heads, 32,
    dim) tensor; layers a KVCacheTensor is shared_by get the same tensor (NeuronModelRunner.initialize_kv_cache)."""
    rt = ready_sim_runtime()
    engine = {f"model.layers.{i}.self_attn.attn": torch.zeros(B, H, BS, 2 * D, dtype=torch.bfloat16) for i in range(3)}
    size = B * H * BS * 2 * D * 2
    cfg = SimpleNamespace(kv_cache_tensors=[
        SimpleNamespace(size=size, shared_by=["model.layers.0.self_attn.attn"]),
        SimpleNamespace(size=size, shared_by=["model.layers.1.self_attn.attn", "model.layers.2.self_attn.attn"])])
    view = plugin_register_view(rt, cfg, engine)
    assert set(view) == set(engine)
    for t in view.values():
        assert tuple(t.shape) == (2, B, H, BS, D) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert view["model.layers.1.self_attn.attn"].data_ptr() == view["model.layers.2.self_attn.attn"].data_ptr()
    assert view["model.layers.0.self_attn.attn"].data_ptr() != view["model.layers.1.self_attn.attn"].data_ptr()
    assert describe_neuron_caches(view, rt, block_size=BS)[0].num_layers == 2


def test_the_simulated_plugin_calls_no_per_layer_hook():
    """vLLM-CPU's attention layers call save_kv_layer and wait_for_layer_load; the plugin never does, so the
    simulation drops them before kvpush sees them."""
    conn = object.__new__(SimulatedNeuronPluginConnector)
    conn._worker = SimpleNamespace(save_kv_layer=lambda name: pytest.fail("a per-layer hook reached kvpush"))
    assert conn.save_kv_layer("model.layers.0.self_attn.attn", None, None) is None
    assert conn.wait_for_layer_load("model.layers.0.self_attn.attn") is None


def test_the_simulated_plugin_places_layers_as_vllm_029_and_later_do():
    """vLLM >= 0.29's KVCacheTensor places `layers` in one backing allocation at offset + l * layer_stride."""
    rt = ready_sim_runtime()
    engine = {f"model.layers.{i}.self_attn.attn": torch.zeros(B, H, BS, 2 * D, dtype=torch.bfloat16) for i in range(3)}
    page = H * BS * 2 * D * 2
    cfg = SimpleNamespace(kv_cache_tensors=[SimpleNamespace(size=3 * B * page, layers=list(engine), offset=0,
                                                            layer_stride=B * page, block_stride=page)])
    view = plugin_register_view(rt, cfg, engine)
    addrs = [view[n].data_ptr() for n in engine]
    assert [b - addrs[0] for b in addrs] == [0, B * page, 2 * B * page]
    assert all(tuple(t.shape) == (2, B, H, BS, D) for t in view.values())
    assert describe_neuron_caches(view, rt, block_size=BS)[0].num_layers == 3
    outer = SimpleNamespace(kv_cache_tensors=[SimpleNamespace(size=3 * B * page, layers=list(engine), offset=0,
                                                              layer_stride=page, block_stride=3 * page)])
    with pytest.raises(ValueError, match="block-outer"):
        plugin_register_view(rt, outer, engine)


def test_a_sliding_window_decode_asks_only_for_the_windows_blocks():
    """Every layer windowed (64 tokens, blocks of 32): the prefill has freed the blocks wholly before token
    n - 63 (vLLM's SlidingWindowManager), so the decode registers from there; other groups are untouched."""
    from kvpush_common.protocol.legs import ProducerIdentity
    from kvpush_common.vllm.kv_groups import sliding_window_of, window_first_token
    from kvpush_common.vllm.metadata import KVPushMetadata, RecvOp

    swa = SimpleNamespace(kv_cache_groups=[group(["l.0", "l.1"], spec("SlidingWindowSpec", window=64))])
    assert sliding_window_of(swa) == (64, BS)
    assert sliding_window_of(SimpleNamespace(kv_cache_groups=[group(["l.0"], spec(window=64))])) is None  # unified
    assert [window_first_token(n, 0, 64, 32) for n in (40, 96, 150, 330)] == [0, 32, 64, 256]
    assert window_first_token(150, 96, 64, 32) == 96  # a longer local prefix hit stays
    prod = ProducerIdentity(engine_id="P", host="h", port=1, tp_size=1)
    conn = object.__new__(KVPushNeuronConnector)
    conn._window = sliding_window_of(swa)
    # vLLM's decode list of a 220-token prompt holds only the window's 3 blocks (its unhashed blocks leave the
    # null blocks it padded the dropped ones with out) while the receive says tokens [0, 220)
    conn._sched = SimpleNamespace(build_connector_meta=lambda so: KVPushMetadata(recvs=[
        RecvOp("all", "t", 0, prod, (3, 4, 5, 6, 7), 150, 0), RecvOp("window", "w", 0, prod, (5, 6, 11), 220, 0),
        RecvOp("short", "u", 0, prod, (8, 9), 40, 0)]))
    got = [(op.block_ids, op.first_token) for op in conn.build_connector_meta(None).recvs]
    assert got == [((5, 6, 7), 64), ((5, 6, 11), 128), ((8, 9), 0)]
