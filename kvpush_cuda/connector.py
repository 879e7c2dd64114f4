"""vLLM entry class for GPUs: `"kv_connector": "KVPushCudaConnector",
"kv_connector_module_path": "kvpush_cuda.connector"`.

It is KVPushConnector with the CUDA device backend bound.  The backend itself (VRAM registration,
CUDA-event fences, LIBFABRIC/EFA preflight) comes with its own issue; until then this class refuses
to start with a clear message instead of treating VRAM as host memory.
"""

from __future__ import annotations

from kvpush_common.device import DeviceBackend
from kvpush_common.vllm.connector import KVPushConnector


class KVPushCudaConnector(KVPushConnector):
    def make_backend(self, kv_caches: dict, head_offset: int) -> DeviceBackend:
        try:
            from .backend import CudaKVCache  # noqa: F401  (arrives with the CUDA backend)
        except ImportError:
            raise NotImplementedError(
                "kvpush_cuda's device backend is not implemented yet; on CPU use "
                "kvpush_common.vllm.connector.KVPushConnector") from None
        return CudaKVCache(kv_caches, head_offset)
