"""The vLLM Neuron plugin's KV cache tensors described for kvpush (Neuron HBM as NIXL regions).

vllm-neuron 0.2x keeps per layer one `(2, num_blocks, num_kv_heads, block_size, head_dim)` tensor
(HND blocks; K plane, V plane), or the K and V caches as a pair of `(num_blocks, heads, block_size,
head_dim)` tensors; both are read from shapes and strides.  Each K and V plane is its own NIXL
registration, as vLLM registers Neuron KV.  Block ids: vLLM's null block 0 is the plugin's -1.
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
    """Block ids fit for the core: trailing padding (0 or -1) dropped; a sentinel before a real block
    (a hole, e.g. a sliding-window layer's skipped block) or an id out of range raises BlockIdError."""
    ids = [int(b) for b in block_ids]
    while ids and ids[-1] in (NULL_BLOCK, PLUGIN_PAD):
        ids.pop()
    for i, b in enumerate(ids):
        if b in (NULL_BLOCK, PLUGIN_PAD):
            raise BlockIdError(f"block id {b} at index {i} is vLLM's null block (Neuron pad {PLUGIN_PAD}) before real "
                               "blocks: its tokens have no KV to move")
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
    regions, regs, addresses = [], [], []
    device = runtime.device_index(k0)
    for name in names:
        for plane in _planes(name, kv_caches[name]):
            if (tuple(plane.shape), plane.stride(), plane.dtype) != (tuple(k0.shape), k0.stride(), k0.dtype):
                raise LayoutError(f"KV tensor {name} differs from {names[0]} in shape, stride or dtype")
            if runtime.device_index(plane) != device:
                raise LayoutError(f"KV tensor {name} is on another Neuron device than {names[0]}")
            addr = runtime.data_ptr(plane)
            addresses.append(addr)
            regions.append(Region(base=addr, block_stride=s_blk * e, mem_id=len(regs), device_id=device))
            regs.append([addr, ((nb - 1) * s_blk + nh * bs * hd) * e, device])
    check_hbm_mapped(runtime, addresses)
    layout = KVLayout(num_layers=len(names), num_heads=nh, head_dim=hd, dtype_size=e,
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
