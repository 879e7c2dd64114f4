"""Step cost of a Qwen3-32B rank at TP=8 on H200, and device work that takes that long.

The model (milliseconds) is fitted to step times measured on one H200 (a Qwen3-32B TP=8 layer stack, and
vLLM's decode steps); the fit and the run it serves are described in docs/benchmarks/h200.md ("Step cost",
the engine-loop-h200 row of docs/benchmarks/README.md):
- prefill of n tokens: a*n + b*n^2 (n in thousands) through 1k -> 16.5 ms and 16k -> 292.5 ms
  (eager layer stack measured on one H200; 4k predicts 67 ms against 61.7 measured);
- decode step: 5.6 ms at light load (vLLM with CUDA graphs, the seed's TPOT) plus attention that
  grows with the batch's total context: 0.0275 ms per 1k context tokens, the slope between the
  measured batch-32 and batch-64 steps at 16k context (17.3 -> 31.4 ms for +512k tokens).
`GpuWork` burns that long on the GPU with back-to-back bf16 matmuls whose unit time it measures at
start-up; `SleepWork` sleeps it (scaled) for the CPU smoke run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    prefill_a_ms: float = 16.38
    prefill_b_ms: float = 0.119
    decode_base_ms: float = 5.6
    decode_ctx_ms_per_k: float = 0.0275

    def prefill_ms(self, tokens: int) -> float:
        k = tokens / 1024
        return self.prefill_a_ms * k + self.prefill_b_ms * k * k

    def decode_ms(self, batch: int, context_tokens: int) -> float:
        return 0.0 if batch == 0 else self.decode_base_ms + self.decode_ctx_ms_per_k * context_tokens / 1024


class SleepWork:
    """CPU stand-in: the step takes `ms * scale` of wall time."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale
        self.unit_ms = 0.0

    def run(self, ms: float) -> None:
        if ms > 0:
            time.sleep(ms * self.scale / 1e3)

    def sync(self) -> None:
        pass


class GpuWork:
    """Real GPU work: `run(ms)` enqueues about `ms` of matmuls on the current stream; `sync` waits."""

    def __init__(self, device: int, rows: int = 1024, dim: int = 4096):
        import torch

        self.torch = torch
        self.device = device
        self.a = torch.randn(rows, dim, dtype=torch.bfloat16, device=f"cuda:{device}")
        self.b = torch.randn(dim, dim, dtype=torch.bfloat16, device=f"cuda:{device}")
        self.c = torch.empty(rows, dim, dtype=torch.bfloat16, device=f"cuda:{device}")
        self.unit_ms = self._calibrate()

    def _calibrate(self, reps: int = 400) -> float:
        for _ in range(50):
            self.torch.mm(self.a, self.b, out=self.c)
        self.sync()
        t = time.perf_counter()
        for _ in range(reps):
            self.torch.mm(self.a, self.b, out=self.c)
        self.sync()
        return (time.perf_counter() - t) * 1e3 / reps

    def run(self, ms: float) -> None:
        for _ in range(max(0, round(ms / self.unit_ms))):
            self.torch.mm(self.a, self.b, out=self.c)

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.device)
