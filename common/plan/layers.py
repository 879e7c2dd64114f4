"""One layer range of a KV layout, as a layout of its own: the planner then plans a layer-streamed WRITE
with no change (regions keep their absolute addresses, so the descriptors name the same memory)."""

from __future__ import annotations

import msgspec

from kvpush_common.protocol.layout import KVLayout

_SLICES: dict[tuple[int, int, int], tuple[KVLayout, KVLayout]] = {}  # (id(layout), first, end) -> (layout, slice)
_MAX_SLICES = 1024


def layer_slice(layout: KVLayout, first: int, end: int) -> KVLayout:
    """Layers [first, end) of `layout` (cached per layout object; the whole layout when it is all of it)."""
    if not 0 <= first < end <= layout.num_layers:
        raise ValueError(f"layers [{first}, {end}) out of range for {layout.num_layers} layers")
    if (first, end) == (0, layout.num_layers):
        return layout
    key = (id(layout), first, end)
    hit = _SLICES.get(key)
    if hit is not None and hit[0] is layout:
        return hit[1]
    k = layout.kv_planes
    part = msgspec.structs.replace(layout, num_layers=end - first, regions=layout.regions[first * k:end * k])
    if len(_SLICES) >= _MAX_SLICES:
        _SLICES.clear()
    _SLICES[key] = (layout, part)
    return part
