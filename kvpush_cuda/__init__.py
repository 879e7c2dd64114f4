"""kvpush CUDA backend (GPU HBM through NIXL UCX, or LIBFABRIC over EFA on p5en).

kv_forms.py reads vLLM's CUDA KV tensors (every form of vLLM 0.24-0.33) from shapes and strides,
kv_cache.py turns them into a kvpush layout, device.py binds the device and fences WRITEs with CUDA
events, slab.py is the test/bench slab, efa.py chooses the NIXL backend after the EFA preflight,
target.py is the `kvpush config cuda` target, connector.py the vLLM entry class.
Imports only `kvpush_common`.
"""
