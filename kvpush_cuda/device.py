"""What every CUDA KV backend shares: binding the device on NIXL threads and CUDA-event fences."""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from kvpush_common.device.backend import DeviceBackend
from kvpush_common.protocol.layout import KVLayout, LayoutError


class CudaDevice(DeviceBackend):
    def __init__(self, device_index: int):
        self.device_index = device_index

    def bind_thread(self) -> None:
        """NIXL registers and posts VRAM from the worker thread: it needs the right current device."""
        torch.cuda.set_device(self.device_index)

    def mark_kv_written(self) -> object:
        """Engine thread: record an event after the work that wrote the KV (cheap, asynchronous)."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device_index))
        return event

    def kv_written(self, token: object) -> bool:
        return token is None or token.query()


REGISTRATION_LIMIT = 4 << 30  # EFA memory registrations fail or slow down above 4 GiB per region


def sliced_registrations(layout: KVLayout, allocations: list[tuple[int, int]], device: int,
                         limit: int = REGISTRATION_LIMIT, *, whole_interleaved: bool = False) -> tuple[KVLayout, np.ndarray]:
    """NIXL registrations for `allocations` [(ptr, nbytes)], none above `limit` bytes, and the layout
    with each region's `mem_id` naming the registration that holds it (the planner never merges
    descriptors across registrations).  An allocation above the limit is registered region by region.

    An allocation whose regions interleave (vLLM's cross-layer cache: every region spans nearly all of it)
    cannot be cut by region; `whole_interleaved` registers it whole whatever its size (UCX takes that), else it
    is refused by the limit."""
    regs: list[list[int]] = []
    mem_of_alloc: dict[int, int] = {}
    regions = []
    for i, reg in enumerate(layout.regions):
        start, end = layout.region_span(i)
        owner = next((a for a in allocations if a[0] <= start and end <= a[0] + a[1]), None)
        if owner is None:
            raise LayoutError(f"region {i} [{start:#x}, {end:#x}) lies in no registered allocation")
        if owner[1] <= limit or (whole_interleaved and _interleaves(layout, owner)):
            if owner not in mem_of_alloc:
                mem_of_alloc[owner] = len(regs)
                regs.append([owner[0], owner[1], device])
            mem_id = mem_of_alloc[owner]
        else:
            if end - start > limit:
                hint = (" (a cross-layer KV cache: its regions interleave; set cross_layer_blocks false on this "
                        "transport)") if _interleaves(layout, owner) else ""
                raise LayoutError(f"region {i} spans {end - start} bytes, above the {limit}-byte registration "
                                  f"limit{hint}")
            mem_id = len(regs)
            regs.append([start, end - start, device])
        regions.append(msgspec.structs.replace(reg, mem_id=mem_id, device_id=device))
    return msgspec.structs.replace(layout, regions=regions), np.array(regs, dtype=np.uint64)


def _interleaves(layout: KVLayout, allocation: tuple[int, int]) -> bool:
    """Two of the layout's regions inside `allocation` overlap in span (blocks of different layers alternate)."""
    lo, hi = allocation[0], allocation[0] + allocation[1]
    spans = sorted(layout.region_span(i) for i in range(len(layout.regions))
                   if lo <= layout.regions[i].base < hi)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))
