"""kvpush Neuron backend (Trainium HBM through NIXL LIBFABRIC/EFA).

Placeholder package: the backend lands with its own issue.  It will implement
`kvpush_common.device.DeviceBackend` behind a small device interface and import only
`kvpush_common`.
"""
