"""Does the writer thread stall the engine thread's per-layer hand-over?  (issue 15: `save_kv_layer` cost 62 us
per call in real vLLM on the H200, twice the layer-streaming micro-benchmark's 30-40 us p50.)

Hypothesis: torch's `Event.record` releases the GIL, and a writer thread that is runnable at that moment (woken
by the previous layer, or polling every 0.2 ms while a batch is on the wire) takes the GIL and keeps it for its
Python work between NIXL calls, so the engine thread waits to get it back.

The engine thread runs steps of `--layers` layers: each layer launches GPU work (a bf16 matmul), then does what
`ProducerEndpoint.layers_ready` does: one fence (a CUDA event recorded; `--fence sleep0` stands in for it on a
machine without CUDA: also a call that releases the GIL), one small record, a SimpleQueue put and, as the
variant says, a threading.Event set.  The writer thread waits on that Event, then drains the queue, asks each
fence, and runs `--work-us` of Python with a GIL-releasing call in the middle (its planning around a NIXL post).
Variants, interleaved round by round so that all see the same machine:

  none        no writer thread (the hand-over alone)
  every       the writer is woken by every layer, polls every `--poll-us` while it has fences not passed
  first_last  as `every`, but only a step's first and last layer wake the writer

Per variant: the hand-over's p50 / p99 / mean (us) and the engine's wall time per step (ms).

    python3 scripts/bench/gpu/hook_gil.py --out $OUT/h200-hook-gil.json
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import threading
import time

VARIANTS = ("none", "every", "first_last")


def spin(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


class Writer:
    def __init__(self, poll_s: float, work_us: float, passed):
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.stop = False
        self.poll_s, self.work_us, self.passed = poll_s, work_us, passed
        self.steps = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        pending = []
        while not self.stop:
            self.wake.wait(self.poll_s if pending else 0.01)
            self.wake.clear()
            while True:
                try:
                    pending.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            if not pending:
                continue
            self.steps += 1
            spin(self.work_us / 2)  # planning
            time.sleep(0)  # a NIXL call (post / status / notifications release the GIL)
            spin(self.work_us / 2)
            pending = [p for p in pending if not self.passed(p[-1])]


def run(args) -> dict:
    import torch

    cuda = args.fence == "cuda"
    if cuda:
        dev = torch.device("cuda", 0)
        a = torch.randn(args.dim, args.dim, device=dev, dtype=torch.bfloat16)
        b = torch.randn(args.dim, args.dim, device=dev, dtype=torch.bfloat16)

        def layer_work():
            torch.matmul(a, b)

        def fence():
            ev = torch.cuda.Event()
            ev.record()
            return ev

        def passed(ev):
            return ev.query()

        sync = torch.cuda.synchronize
    else:
        a = torch.randn(args.dim, args.dim)

        def layer_work():
            a.sum()

        def fence():
            time.sleep(0)
            return None

        def passed(ev):
            return True

        def sync():
            pass

    chunks = tuple((("t" * 32, 0), tuple(range(256)), 4096) for _ in range(args.requests))
    times = {v: [] for v in VARIANTS}
    steps = {v: [] for v in VARIANTS}
    writers = {}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for variant in VARIANTS:
            w = None
            if variant != "none":
                w = Writer(args.poll_us / 1e6, args.work_us, passed)
                w.thread.start()
            for _ in range(args.steps):
                t_step = time.perf_counter()
                for layer in range(args.layers):
                    layer_work()
                    t0 = time.perf_counter()
                    item = (chunks, layer, layer + 1, fence())
                    if w is not None:
                        w.inbox.put(item)
                        if variant == "every" or layer in (0, args.layers - 1):
                            w.wake.set()
                    dt = time.perf_counter() - t0
                    if rnd:
                        times[variant].append(dt * 1e6)
                sync()
                if rnd:
                    steps[variant].append((time.perf_counter() - t_step) * 1e3)
            if w is not None:
                w.stop = True
                w.wake.set()
                w.thread.join()
                writers[variant] = writers.get(variant, 0) + w.steps
    out = {}
    for v in VARIANTS:
        xs = sorted(times[v])
        out[v] = {"handover_us_p50": round(xs[len(xs) // 2], 2), "handover_us_p99": round(xs[int(len(xs) * 0.99)], 2),
                  "handover_us_mean": round(statistics.fmean(xs), 2), "handovers": len(xs),
                  "step_ms_p50": round(statistics.median(steps[v]), 3), "writer_steps": writers.get(v, 0)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fence", choices=("cuda", "sleep0"), default=None, help="default: cuda when available")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--steps", type=int, default=40, help="steps per variant per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2, help="requests per step in each hand-over record")
    ap.add_argument("--dim", type=int, default=2048, help="matmul size per layer (the layer's GPU work)")
    ap.add_argument("--poll-us", type=float, default=200.0, help="writer poll while fences are pending")
    ap.add_argument("--work-us", type=float, default=60.0, help="writer Python work per wake")
    ap.add_argument("--out", default="hook-gil.json")
    args = ap.parse_args()
    if args.fence is None:
        import torch

        args.fence = "cuda" if torch.cuda.is_available() else "sleep0"
    result = {"command": "python3 scripts/bench/gpu/hook_gil.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "switch_interval_s": sys.getswitchinterval(), "variants": run(args)}
    if args.fence == "cuda":
        import torch

        result["device"] = torch.cuda.get_device_name(0)
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
