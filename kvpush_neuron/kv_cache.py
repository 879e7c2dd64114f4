"""The vLLM Neuron plugin's KV cache tensors described for kvpush (Neuron HBM as NIXL regions).

vllm-neuron 0.2x allocates one int8 `torch.zeros(size)` per vLLM KVCacheTensor on the `neuron` device,
views it as the KV dtype and `(2, num_blocks, num_kv_heads, block_size, head_dim)` (HND blocks; K plane,
V plane) and hands that full tensor per layer to register_kv_caches (docs/neuron.md).  The K and V
caches as a pair of `(num_blocks, heads, block_size, head_dim)` tensors are read as well; both from
shapes and strides.  Each K and V plane is its own NIXL registration, as vLLM registers Neuron KV.
Layers that share one buffer (a KVCacheTensor's `shared_by`) are one set of regions, registered and
moved once, as vLLM's NIXL connector de-duplicates its base addresses; P and D, serving one model,
de-duplicate alike.  Block ids: vLLM's (null block 0); the plugin's -1 lives only in its kernel tables.
"""

from __future__ import annotations


import numpy as np

from kvpush_common.device.backend import DeviceBackend
from kvpush_common.protocol.layout import KVLayout, LayoutError, Region, layer_order

from .runtime import NeuronRuntime
from .startup import check_hbm_mapped, check_launch_env, check_runtime_ready

DEFAULT_BLOCK_SIZE = 32  # vllm-neuron 0.2x UNIFORM_NEURON_PAGE
NULL_BLOCK = 0  # vLLM's null block (padding, skipped sliding-window blocks): never holds a request's KV
PLUGIN_PAD = -1  # the plugin's remap of the null block in its block tables


class BlockIdError(ValueError):
    pass


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
                           num_heads: int | None = None, head_size: int | None = None,
                           head_offset: int = 0) -> tuple[KVLayout, np.ndarray, int]:
    """(layout, registrations (N, 3) [addr, len, device], device index) of the plugin's KV tensors."""
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
                      regions=regions, mem_type=runtime.mem_type, head_offset=head_offset).validate()
    return layout, np.array(regs, dtype=np.uint64), device


class NeuronKVCache(DeviceBackend):
    """The plugin's KV caches as a kvpush DeviceBackend; refuses to start when a Neuron rule is broken."""

    name = "neuron"

    def __init__(self, kv_caches: dict, head_offset: int, *, runtime: NeuronRuntime,
                 block_size: int = DEFAULT_BLOCK_SIZE, num_heads: int | None = None, head_size: int | None = None):
        check_launch_env(runtime.env)
        check_runtime_ready(runtime)
        self.runtime = runtime
        self._kv_caches = kv_caches
        self._layout, self._regs, self.device_index = describe_neuron_caches(
            kv_caches, runtime, block_size=block_size, num_heads=num_heads, head_size=head_size,
            head_offset=head_offset)

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
