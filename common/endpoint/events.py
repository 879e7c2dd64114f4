"""Per-request event log of an endpoint (opt-in), for timelines in the demo and order checks in tests.

Set KVPUSH_EVENT_DIR: each endpoint appends JSON lines `{"t": wall time, "ev": name, "tid", "attempt"}`
to `<dir>/<engine>-<role>-r<rank>.jsonl` (from the worker thread, and from the engine thread when the
vLLM worker hooks stage a send or receive).  Off by default: no cost.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec


class EventLog:
    def __init__(self, path: Path | None):
        self._file = open(path, "ab", buffering=0) if path else None
        self._enc = msgspec.json.Encoder()

    @classmethod
    def from_env(cls, engine_id: str, role: str, rank: int) -> "EventLog":
        d = os.environ.get("KVPUSH_EVENT_DIR")
        if not d:
            return cls(None)
        Path(d).mkdir(parents=True, exist_ok=True)
        return cls(Path(d) / f"{engine_id.replace('/', '_')}-{role}-r{rank}.jsonl")

    def __call__(self, ev: str, key, **extra) -> None:
        if self._file is not None:
            rec = {"t": time.time(), "ev": ev, "tid": key.transfer_id, "attempt": key.attempt, **extra}
            self._file.write(self._enc.encode(rec) + b"\n")


def read_events(directory: str | Path) -> list[dict]:
    out = []
    for p in sorted(Path(directory).glob("*.jsonl")):
        role = p.stem.rsplit("-", 2)[-2]
        for line in p.read_bytes().splitlines():
            if line.strip():
                out.append({**msgspec.json.decode(line), "role": role, "file": p.name})
    return sorted(out, key=lambda e: e["t"])
