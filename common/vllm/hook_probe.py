"""Where a slow engine hook's time went (only while the event log is on, for `slow_hook` events).

A decode instance's `start_load_kv` can pass its 50 us budget once per received request (engine-thread work in
the block-id hand-over was such a case).  It tells the
candidates apart: the engine thread's own CPU time during the call (wall time far above it means the
thread waited: for the GIL or for a core), the cyclic garbage collector running inside the call, and the
hand-over's phases.
"""

from __future__ import annotations

import gc
import time


class GcClock:
    """Time this process spends in the cyclic garbage collector (`gc.callbacks`), summed."""

    def __init__(self):
        self.seconds = 0.0
        self.collections = 0
        self._since: float | None = None

    def install(self) -> "GcClock":
        gc.callbacks.append(self._on_gc)
        return self

    def remove(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._since = time.perf_counter()
        elif self._since is not None:
            self.seconds += time.perf_counter() - self._since
            self.collections += 1
            self._since = None


class HookProbe:
    """One hook call at a time (the engine thread): `begin`, `mark` after each phase, `detail` if slow."""

    def __init__(self, gc_clock: GcClock):
        self.gc = gc_clock
        self._cpu = 0.0
        self._gc_s = 0.0
        self._gcs = 0
        self._marks: list[tuple[str, float]] = []

    def begin(self) -> None:
        self._cpu = time.thread_time()
        self._gc_s, self._gcs = self.gc.seconds, self.gc.collections
        self._marks.clear()

    def mark(self, phase: str) -> None:
        self._marks.append((phase, time.perf_counter()))

    def detail(self, started: float, ended: float) -> dict:
        """Microseconds: `cpu_us` (this thread's CPU time), `gc_us` / `gcs` (collections inside the call),
        and `<phase>_us` for each marked phase (from the previous mark, or the call's start)."""
        out = {"cpu_us": round((time.thread_time() - self._cpu) * 1e6, 1),
               "gc_us": round((self.gc.seconds - self._gc_s) * 1e6, 1), "gcs": self.gc.collections - self._gcs}
        last = started
        for phase, at in self._marks:
            out[f"{phase}_us"] = round((at - last) * 1e6, 1)
            last = at
        out["rest_us"] = round((ended - last) * 1e6, 1)
        return out
