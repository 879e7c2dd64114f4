"""When this process first started libfabric through NIXL.

libfabric picks its HMEM interfaces (FI_HMEM_NEURON, FI_HMEM_CUDA) once, when the process first
initialises it: a device runtime initialised later has its memory registered as host memory, with no
error.  A device backend compares its runtime's start with this moment (kvpush_neuron/startup.py).
kvpush's own LIBFABRIC backends are recorded as they are created; another component's NIXL agent
holding a LIBFABRIC backend is found on the Python heap, its start unknown, so it counts as earliest.
"""

from __future__ import annotations

import gc
import sys
import time
import weakref

_first_at: float | None = None
_ours: weakref.WeakSet = weakref.WeakSet()


def note_libfabric_backend(agent: object) -> None:
    """Called by NixlTransport right before it creates a LIBFABRIC backend on `agent`."""
    global _first_at
    if _first_at is None:
        _first_at = time.monotonic()
    _ours.add(agent)


def libfabric_started_at() -> float | None:
    """Monotonic time libfabric was first started here (-inf: by another component, time unknown;
    None: not yet).  Scans the heap: call it at start-up, not on a step path."""
    api = sys.modules.get("nixl._api")
    if api is not None:
        agent_type = api.nixl_agent
        for obj in gc.get_objects():
            # the real type, not isinstance(): that reads __class__, which lazy proxies answer with warnings
            if agent_type in type(obj).__mro__ and obj not in _ours and "LIBFABRIC" in getattr(obj, "backends", {}):
                return float("-inf")
    return _first_at
