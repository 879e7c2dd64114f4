"""KV caches shaped like the vLLM Neuron plugin's, allocated through a NeuronRuntime: the Neuron
backend of the conformance suite ("neuron-sim", simulated runtime) and of hardware tests."""

from __future__ import annotations

import numpy as np

from kvpush_common.protocol.layout import contiguous_layout, slab_bytes

from .kv_cache import DEFAULT_BLOCK_SIZE, NeuronKVCache
from .runtime import NeuronRuntime, SimulatedNeuronRuntime


def _torch_dtype(dtype: str, dtype_size: int):
    import torch

    t = getattr(torch, dtype, None)
    if not isinstance(t, torch.dtype) or t.itemsize != dtype_size:
        raise ValueError(f"dtype {dtype!r} with {dtype_size}-byte elements is not a torch dtype")
    return t


def plugin_views(buffer, *, num_layers: int, num_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 dtype: str, dtype_size: int, shared: dict[int, int] | None = None) -> dict:
    """Per-layer `(2, num_blocks, heads, block_size, head_dim)` views of one device buffer, named as the plugin's
    models name attention layers; `shared` maps a layer to the layer whose KV it shares (one view for both)."""
    t = buffer.view(_torch_dtype(dtype, dtype_size)).view(num_layers, 2, num_blocks, num_heads, block_size, head_dim)
    owner = {int(k): int(v) for k, v in (shared or {}).items()}
    return {f"layers.{i}.self_attn": t[owner.get(i, i)] for i in range(num_layers)}


def ready_sim_runtime() -> SimulatedNeuronRuntime:
    """A simulated runtime started the documented way: NEURON_RT_MAP_HBM=1, then init."""
    runtime = SimulatedNeuronRuntime({"NEURON_RT_MAP_HBM": "1", "NEURON_VISIBLE_DEVICES": "0"})
    runtime.init()
    return runtime


class NeuronSlab(NeuronKVCache):
    """One device allocation viewed as the plugin's per-layer tensors; the layout equals
    `contiguous_layout(order="HND", blocks_first=False)`.  Byte access: slab_base, read/write_bytes.
    `shared` ({layer: layer whose buffer it shares}) hands several layers one tensor, as a KVCacheTensor
    `shared_by` them does: the layout then holds each shared buffer once (its slots of the sharing layers'
    own are left unused)."""

    def __init__(self, *, num_layers: int, num_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = DEFAULT_BLOCK_SIZE, dtype: str = "bfloat16", dtype_size: int = 2,
                 head_offset: int = 0, runtime: NeuronRuntime | None = None, core: int = 0, fill: int = 0,
                 shared: dict[int, int] | None = None):
        runtime = ready_sim_runtime() if runtime is None else runtime
        geo = dict(num_layers=num_layers, num_heads=num_heads, head_dim=head_dim, block_size=block_size,
                   num_blocks=num_blocks, dtype=dtype, dtype_size=dtype_size)
        nbytes = slab_bytes(contiguous_layout(0, order="HND", blocks_first=False, **geo))
        self.tensor, _ = runtime.allocate(nbytes, core)
        if fill:
            runtime.from_host(self.tensor, np.full(nbytes, fill, dtype=np.uint8))
        super().__init__(plugin_views(self.tensor, shared=shared, **geo), head_offset, runtime=runtime,
                         block_size=block_size, num_heads=num_heads, head_size=head_dim)

    @property
    def slab_base(self) -> int:
        return self.runtime.data_ptr(self.tensor)

    def read_bytes(self) -> np.ndarray:
        return self.runtime.to_host(self.tensor)

    def write_bytes(self, data: np.ndarray, offset: int = 0) -> None:
        self.runtime.from_host(self.tensor, data, offset)


def plugin_kv_caches(runtime: NeuronRuntime, *, num_layers: int, num_heads: int, head_dim: int, num_blocks: int,
                     block_size: int = DEFAULT_BLOCK_SIZE, dtype: str = "bfloat16", dtype_size: int = 2,
                     core: int = 0, shared: dict[int, int] | None = None) -> dict:
    """The tensors the plugin hands register_kv_caches (NeuronModelRunner.initialize_kv_cache): one int8 device
    buffer per KVCacheTensor, viewed as `dtype` and per layer as `(2, num_blocks, heads, block_size, head_dim)`,
    named as its models name attention layers (`layers.{i}.self_attn`).  `shared` maps a layer to the layer
    whose buffer it shares (a KVCacheTensor `shared_by` both): both get the same tensor."""
    import torch

    geo = dict(num_layers=1, num_heads=num_heads, head_dim=head_dim, block_size=block_size, num_blocks=num_blocks,
               dtype=dtype, dtype_size=dtype_size)
    nbytes = 2 * num_blocks * num_heads * block_size * head_dim * dtype_size
    caches = {}
    for i in range(num_layers):
        owner = (shared or {}).get(i)
        if owner is not None:
            caches[f"layers.{i}.self_attn"] = caches[f"layers.{owner}.self_attn"]
            continue
        buffer, _ = runtime.allocate(nbytes, core)
        caches[f"layers.{i}.self_attn"] = next(iter(plugin_views(buffer.view(torch.int8), **geo).values()))
    return caches
