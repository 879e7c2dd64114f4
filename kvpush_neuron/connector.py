"""vLLM-neuron entry class: `"kv_connector": "KVPushNeuronConnector",
"kv_connector_module_path": "kvpush_neuron.connector"`.

It is KVPushConnector with the Neuron device backend bound: the plugin's KV tensors in HBM registered
as VRAM through NIXL LIBFABRIC/EFA, after the EFA preflight and the Neuron start-up checks.  Without
a Neuron host (torch-neuronx missing) it refuses to start with a clear message.
"""

from __future__ import annotations

from kvpush_common.device import DeviceBackend
from kvpush_common.vllm.connector import KVPushConnector


class KVPushNeuronConnector(KVPushConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        if self._worker is not None:  # LIBFABRIC after the EFA preflight, before NIXL starts
            import dataclasses
            import os

            from .efa import neuron_transport

            extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
            transport = neuron_transport(extra, os.environ, same_host=bool(extra.get("same_host", True)))
            self.settings = dataclasses.replace(self.settings, backend=transport.backend,
                                                backend_params=transport.backend_params)
            self._worker.settings = self.settings

    def make_backend(self, kv_caches: dict, head_offset: int) -> DeviceBackend:
        from .backend import NeuronKVCache
        from .runtime import RealNeuronRuntime

        runtime = RealNeuronRuntime()  # NeuronUnavailableError ("not available") off Neuron hosts
        for cache in kv_caches.values():  # tensors on the device: the plugin's worker initialised the runtime
            runtime.adopt(cache[0] if isinstance(cache, (list, tuple)) else cache)
            break
        cfg = self._vllm_config
        heads = max(1, cfg.model_config.get_total_num_kv_heads() // cfg.parallel_config.tensor_parallel_size)
        return NeuronKVCache(kv_caches, head_offset, runtime=runtime, block_size=cfg.cache_config.block_size,
                             num_heads=heads, head_size=cfg.model_config.get_head_size())
