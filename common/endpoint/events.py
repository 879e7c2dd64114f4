"""Per-request event log of an endpoint (opt-in), for timelines in the demo and order checks in tests.

Set KVPUSH_EVENT_DIR: each endpoint appends JSON lines `{"t": wall time, "ev": name, "tid", "attempt"}`
to `<dir>/<engine>-<role>-r<rank>.jsonl`, written by the endpoint's worker thread (records that the vLLM
worker hooks make on the engine thread are queued for it).  Off by default: no cost.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from pathlib import Path

import msgspec


MAX_PENDING = 1 << 16  # records queued for the writer; a writer that stopped loses the oldest, never memory


class EventLog:
    """One endpoint's event file.  Only the endpoint's worker thread writes to it, once per step (`flush`, after
    the step): a record made on any thread is queued.  A file write releases the GIL: inside the engine's step it
    let the worker run its whole step there (the decode's once-per-receive hook tail had another
    cause, the block-id conversion: docs/benchmarks/README.md#decode-hook-vllm), and inside the worker's push path
    (kv_ready -> WRITE posted) each one let the engine thread take the GIL back before the post.  Records carry
    their own time, and `read_events` sorts by it."""

    def __init__(self, path: Path | None):
        self._file = open(path, "ab", buffering=0) if path else None
        self._pending: collections.deque[bytes] = collections.deque(maxlen=MAX_PENDING)
        self._writer: int | None = None  # the thread that writes (the worker), once bound

    @classmethod
    def from_env(cls, engine_id: str, role: str, rank: int) -> "EventLog":
        d = os.environ.get("KVPUSH_EVENT_DIR")
        if not d:
            return cls(None)
        Path(d).mkdir(parents=True, exist_ok=True)
        return cls(Path(d) / f"{engine_id.replace('/', '_')}-{role}-r{rank}.jsonl")

    @property
    def on(self) -> bool:
        return self._file is not None

    def bind_writer(self) -> None:
        """The calling thread writes the file from now on (the endpoint's worker, at start)."""
        self._writer = threading.get_ident()

    def __call__(self, ev: str, key, **extra) -> None:
        if self._file is not None:
            rec = {"t": time.time(), "ev": ev, "tid": key.transfer_id, "attempt": key.attempt, **extra}
            self._pending.append(msgspec.json.encode(rec) + b"\n")
            if self._writer is None:  # no worker yet (a test driving steps by hand): write at once
                self.flush()

    def flush(self) -> None:
        """Write what is queued (the writer thread, each step and at close)."""
        if self._file is None or not self._pending:
            return
        lines = []
        while self._pending:
            try:
                lines.append(self._pending.popleft())
            except IndexError:  # drained by another flush
                break
        if lines:
            self._file.write(b"".join(lines))


def read_events(directory: str | Path) -> list[dict]:
    out = []
    for p in sorted(Path(directory).glob("*.jsonl")):
        role = p.stem.rsplit("-", 2)[-2]
        for line in p.read_bytes().splitlines():
            if line.strip():
                out.append({**msgspec.json.decode(line), "role": role, "file": p.name})
    return sorted(out, key=lambda e: e["t"])
