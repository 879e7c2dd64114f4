"""Device id lists as runtimes and launchers write them ("0,2-3,5"): NEURON_VISIBLE_DEVICES, CUDA_VISIBLE_DEVICES."""

from __future__ import annotations


def parse_range(text: str) -> list[int]:
    """"0,2-3,5" -> [0, 2, 3, 5] (ValueError on anything else)."""
    ids: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        ids += list(range(int(lo), int(hi or lo) + 1))
    return ids
