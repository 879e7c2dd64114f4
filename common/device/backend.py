"""The small interface a device backend implements so the protocol core can move its KV.

The core never imports a backend; `kvpush_cuda` and `kvpush_neuron` implement this for device
memory, `HostBackend` for DRAM.  Engine-thread methods must be cheap (they run in the step path).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from kvpush_common.protocol.layout import KVLayout


class DeviceBackend(ABC):
    name: str = "abstract"

    @abstractmethod
    def layout(self) -> KVLayout:
        """Where this rank's KV blocks are (addresses valid for the process lifetime)."""

    @abstractmethod
    def registration_regions(self) -> np.ndarray:
        """(N, 3) uint64 `[addr, length, device_id]`: few, large regions covering every KV region."""

    def bind_thread(self) -> None:
        """Called first on every thread that will call NIXL (e.g. to bind the CUDA device)."""

    def mark_kv_written(self) -> object:
        """Engine thread, right after the step that wrote a request's KV: a cheap completion token."""
        return None

    def kv_written(self, token: object) -> bool:
        """Worker thread: has the work behind `token` finished on the device?"""
        return True
