"""vLLM-neuron entry class: `"kv_connector": "KVPushNeuronConnector",
"kv_connector_module_path": "kvpush_neuron.connector"`.

It is KVPushConnector with the Neuron device backend bound (Neuron HBM registered as VRAM through
NIXL LIBFABRIC).  The backend comes with its own issue; until then this class refuses to start
with a clear message.
"""

from __future__ import annotations

from kvpush_common.device import DeviceBackend
from kvpush_common.vllm.connector import KVPushConnector


class KVPushNeuronConnector(KVPushConnector):
    def make_backend(self, kv_caches: dict, head_offset: int) -> DeviceBackend:
        try:
            from .backend import NeuronKVCache  # noqa: F401  (arrives with the Neuron backend)
        except ImportError:
            raise NotImplementedError(
                "kvpush_neuron's device backend is not implemented yet (it needs torch-neuronx and the "
                "Neuron runtime); on CPU use kvpush_common.vllm.connector.KVPushConnector") from None
        return NeuronKVCache(kv_caches, head_offset)
