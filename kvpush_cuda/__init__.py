"""kvpush CUDA backend (H200 HBM through NIXL UCX/LIBFABRIC).

Placeholder package: the backend lands with its own issue.  It will implement
`kvpush_common.device.backend.DeviceBackend` and import only `kvpush_common`.
"""
