"""kvpush protocol core: device-agnostic push (and pull) KV transfer over NIXL.

Installed as `kvpush_common`.  It imports no device backend; `kvpush_cuda` and `kvpush_neuron`
implement `kvpush_common.device.backend.DeviceBackend` and import this package, never each other.
"""

__version__ = "0.1.0"
