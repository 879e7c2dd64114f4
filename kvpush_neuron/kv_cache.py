"""The vLLM Neuron plugin's KV cache tensors described for kvpush (Neuron HBM as NIXL regions).

vllm-neuron 0.2x allocates one int8 `torch.zeros(size)` per vLLM KVCacheTensor on the `neuron` device,
views it as the KV dtype and `(2, num_blocks, num_kv_heads, block_size, head_dim)` (HND blocks; K plane,
V plane) and hands that full tensor per layer to register_kv_caches (docs/neuron.md).  The K and V
caches as a pair of `(num_blocks, heads, block_size, head_dim)` tensors are read as well; both from
shapes and strides.  Each K and V plane is its own NIXL registration, as vLLM registers Neuron KV.
Layers that share one buffer (a KVCacheTensor's `shared_by`) are one set of regions, registered and
moved once, as vLLM's NIXL connector de-duplicates its base addresses; P and D, serving one model,
de-duplicate alike.  Block ids: vLLM's (null block 0); the plugin's -1 lives only in its kernel tables.

What the bytes mean travels in the layout as on every connector (`KVLayout.cache_dtype`, `kv_scales`, `drafter`),
with the one thing only Neuron knows: an FP8 KV cache is the same torch dtype (float8_e4m3fn) on Trainium2 and
Trainium3, but the plugin writes Trainium2's e4m3 (with inf, largest finite 240) on one and e4m3fn (largest 448) on
the other, so the cache dtype is named with the range the plugin clamps to (`fp8_e4m3:max240`, `fp8_e4m3:max448`)
and a pair of generations is refused at the handshake instead of reading values past 240 as inf.
"""

from __future__ import annotations


import numpy as np

from kvpush_common.device.backend import DeviceBackend
from kvpush_common.protocol.layout import KVLayout, LayoutError, Region, layer_order

from .efa import TrnHost
from .runtime import NeuronRuntime
from .startup import check_hbm_mapped, check_launch_env, check_runtime_ready

DEFAULT_BLOCK_SIZE = 32  # vllm-neuron 0.2x UNIFORM_NEURON_PAGE
NULL_BLOCK = 0  # vLLM's null block (padding, skipped sliding-window blocks): never holds a request's KV
PLUGIN_PAD = -1  # the plugin's remap of the null block in its block tables


# The largest finite FP8 KV value the plugin clamps to, per Trainium generation: "TRN2 uses e4m3 (with inf), max
# finite = 240. TRN3 uses e4m3fn (no inf), max finite = 448" (jinhuang12/vllm-neuron vllm_neuron/utils/dtype_utils.py
# @ ed3580d0, FP8_CLAMP_MAX; aws-neuron-sdk vllm-neuron/docs/design/vllm/kv-cache-quantization.md @ a3247f5b).
FP8_MAX_BY_GENERATION = {"trn2": 240.0, "trn3": 448.0}
FP8_RANGE_FIX = ("set NEURON_PLATFORM_TARGET_OVERRIDE to this host's generation (trn2 or trn3), or serve a bf16 KV "
                 "cache (--kv-cache-dtype auto) on P and D")


class BlockIdError(ValueError):
    pass


def plugin_fp8_clamp_max() -> float | None:
    """The plugin's own FP8_CLAMP_MAX (resolved at its import from its platform target), None where the installed
    plugin has none."""
    try:
        from vllm_neuron.utils.dtype_utils import FP8_CLAMP_MAX
    except (ImportError, AttributeError, RuntimeError):
        return None
    return float(FP8_CLAMP_MAX)


def neuron_fp8_max(env, host: TrnHost | None = None) -> float | None:
    """The largest finite value of this host's FP8 KV cache: the plugin's FP8_CLAMP_MAX, else the generation of
    NEURON_PLATFORM_TARGET_OVERRIDE (the plugin's platform override) or of the DMI product name; None: unknown."""
    clamp = plugin_fp8_clamp_max()
    if clamp is not None:
        return clamp
    target = env.get("NEURON_PLATFORM_TARGET_OVERRIDE") or (host or TrnHost()).product_name() or ""
    return next((v for gen, v in FP8_MAX_BY_GENERATION.items() if target.startswith(gen)), None)


def neuron_layout_facts(vllm_config, layer_names, env, host: TrnHost | None = None) -> dict:
    """What the plugin's KV bytes mean, for the layout (`kv_groups.layout_facts`, as the CUDA and CPU connectors):
    the cache dtype (an FP8 one named with this generation's range), the drafter whose layers are listed, and the
    K/V scales of a quantised cache: `checkpoint`, since the plugin loads them from the checkpoint only (no runtime
    calibration) onto its own attention modules, which are not vLLM's and which the connector cannot reach; the
    model, a compatibility-hash factor, names them.  ValueError (at start-up) where an FP8 cache's range is
    unknown."""
    from kvpush_common.vllm.kv_groups import layout_facts

    facts = layout_facts(vllm_config, layer_names)
    if facts.pop("latent", False):
        raise ValueError("an MLA (latent) KV cache on the vLLM Neuron plugin is not served by kvpush: its views are "
                         "(2, blocks, heads, block_size, head_dim) K and V planes")
    if facts["cache_dtype"].startswith("fp8"):
        clamp = neuron_fp8_max(env, host)
        if clamp is None:
            raise ValueError(
                f"--kv-cache-dtype {facts['cache_dtype']} on Neuron: the FP8 range of this host's KV cache is unknown "
                "(Trainium2 stores e4m3 up to 240, Trainium3 e4m3fn up to 448; neither the plugin's FP8_CLAMP_MAX "
                f"nor a trn2/trn3 product name was found): {FP8_RANGE_FIX}")
        facts["cache_dtype"] = f"{facts['cache_dtype']}:max{clamp:g}"
        facts["kv_scales"] = "checkpoint"
    return facts


def strip_block_sentinels(block_ids, num_blocks: int) -> list[int]:
    """Block ids fit for the core: trailing padding (0 or -1) dropped; a leading run of -1 kept (the
    producer's blocks a sliding window dropped, which kvpush's scheduler side marks so: the planner
    refuses to read one); a null block or -1 anywhere else (a hole), or an id out of range, raises
    BlockIdError."""
    ids = [int(b) for b in block_ids]
    while ids and ids[-1] in (NULL_BLOCK, PLUGIN_PAD):
        ids.pop()
    lead = 0
    while lead < len(ids) and ids[lead] == PLUGIN_PAD:
        lead += 1
    for i in range(lead, len(ids)):
        b = ids[i]
        if b in (NULL_BLOCK, PLUGIN_PAD):
            raise BlockIdError(f"block id {b} at index {i} is vLLM's null block (or -1) between real blocks: its "
                               "tokens have no KV to move")
        if not 0 < b < num_blocks:
            raise BlockIdError(f"block id {b} at index {i} out of range: must be in [1, {num_blocks})")
    return ids


def _planes(name: str, cache) -> tuple:
    """(K, V) 4-D plane tensors of one layer's cache."""
    if isinstance(cache, (list, tuple)):
        if len(cache) != 2:
            raise LayoutError(f"{name}: expected a (K, V) pair, got {len(cache)} tensors")
        return tuple(cache)
    if cache.dim() != 5 or cache.shape[0] != 2:
        raise LayoutError(f"{name}: shape {tuple(cache.shape)} is not (2, num_blocks, heads, block_size, head_dim)")
    return cache[0], cache[1]


def describe_neuron_caches(kv_caches: dict, runtime: NeuronRuntime, *, block_size: int = DEFAULT_BLOCK_SIZE,
                           num_heads: int | None = None, head_size: int | None = None, head_offset: int = 0,
                           cache_dtype: str = "auto", kv_scales: str = "",
                           drafter: str = "") -> tuple[KVLayout, np.ndarray, int]:
    """(layout, registrations (N, 3) [addr, len, device], device index) of the plugin's KV tensors; `cache_dtype`,
    `kv_scales` and `drafter` say what the bytes mean (`neuron_layout_facts`)."""
    if not kv_caches:
        raise LayoutError("no KV caches to describe")
    names = sorted(kv_caches, key=layer_order)
    k0 = _planes(names[0], kv_caches[names[0]])[0]
    if k0.dim() != 4:
        raise LayoutError(f"{names[0]}: K plane shape {tuple(k0.shape)} is not "
                          "(num_blocks, heads, block_size, head_dim)")
    nb, nh, bs, hd = k0.shape
    want = (block_size, num_heads or nh, head_size or hd)
    if (bs, nh, hd) != want:
        raise LayoutError(f"KV plane shape {tuple(k0.shape)} does not match block_size/heads/head_dim {want}")
    s_blk, s_head, s_tok, s_dim = k0.stride()
    if (s_head, s_tok, s_dim) != (bs * hd, hd, 1):
        raise LayoutError(f"KV blocks are not HND packed (strides {k0.stride()}); the vLLM Neuron plugin stores "
                          "(heads, block_size, head_dim) per block")
    if s_blk < nh * bs * hd:
        raise LayoutError(f"blocks overlap (strides {k0.stride()})")
    e = k0.element_size()
    device = runtime.device_index(k0)
    span = ((nb - 1) * s_blk + nh * bs * hd) * e
    layers = []  # (layer name, (K address, V address))
    for name in names:
        addrs = []
        for plane in _planes(name, kv_caches[name]):
            if (tuple(plane.shape), plane.stride(), plane.dtype) != (tuple(k0.shape), k0.stride(), k0.dtype):
                raise LayoutError(
                    f"KV tensor {name} ({tuple(plane.shape)}, {plane.dtype}) differs from {names[0]} "
                    f"({tuple(k0.shape)}, {k0.dtype}) in shape, stride or dtype: kvpush moves layers of one KV "
                    "shape (an EAGLE drafter's layers of another shape cannot be served beside the target's)")
            if runtime.device_index(plane) != device:
                raise LayoutError(f"KV tensor {name} is on another Neuron device than {names[0]}")
            addrs.append(runtime.data_ptr(plane))
        layers.append((name, tuple(addrs)))
    check_hbm_mapped(runtime, [a for _, pair in layers for a in pair])
    regions, regs, kept = [], [], {}  # kept: (K, V) addresses -> the first layer holding them
    for name, pair in layers:
        if pair in kept:  # one buffer shared_by several layers: registered and moved once
            continue
        clash = next((other for held, other in kept.items() for a in pair for b in held if abs(a - b) < span), None)
        if clash is not None:
            raise LayoutError(f"KV tensors {clash} and {name} overlap in device memory without being the same "
                              "buffer (layers of different KV cache groups laid over shared buffers): kvpush "
                              "moves one KV cache group")
        kept[pair] = name
        for addr in pair:
            regions.append(Region(base=addr, block_stride=s_blk * e, mem_id=len(regs), device_id=device))
            regs.append([addr, span, device])
    layout = KVLayout(num_layers=len(regions) // 2, num_heads=nh, head_dim=hd, dtype_size=e,
                      dtype=str(k0.dtype).removeprefix("torch."), block_size=bs, num_blocks=nb, order="HND",
                      regions=regions, mem_type=runtime.mem_type, head_offset=head_offset, cache_dtype=cache_dtype,
                      kv_scales=kv_scales, drafter=drafter).validate()
    return layout, np.array(regs, dtype=np.uint64), device


class NeuronKVCache(DeviceBackend):
    """The plugin's KV caches as a kvpush DeviceBackend; refuses to start when a Neuron rule is broken."""

    name = "neuron"

    def __init__(self, kv_caches: dict, head_offset: int, *, runtime: NeuronRuntime,
                 block_size: int = DEFAULT_BLOCK_SIZE, num_heads: int | None = None, head_size: int | None = None,
                 **facts):
        check_launch_env(runtime.env)
        check_runtime_ready(runtime)
        self.runtime = runtime
        self._kv_caches = kv_caches
        self._layout, self._regs, self.device_index = describe_neuron_caches(
            kv_caches, runtime, block_size=block_size, num_heads=num_heads, head_size=head_size,
            head_offset=head_offset, **facts)

    def layout(self) -> KVLayout:
        return self._layout

    def registration_regions(self) -> np.ndarray:
        return self._regs

    def bind_thread(self) -> None:
        """Runs right before the endpoint creates its NIXL agent: the last moment to check the order."""
        check_runtime_ready(self.runtime)
        self.runtime.claim_agent(self.device_index, self)

    def mark_kv_written(self) -> object:
        return self.runtime.fence()

    def kv_written(self, token: object) -> bool:
        return self.runtime.fence_done(token)

    def block_ids(self, block_ids) -> list[int]:
        """vLLM / plugin block ids with sentinels stripped and checked (see strip_block_sentinels)."""
        return strip_block_sentinels(block_ids, self._layout.num_blocks)
