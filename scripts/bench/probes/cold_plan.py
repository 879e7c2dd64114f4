"""`plan_write` for one request, hot (back to back) and cold (after a sleep, as the writer thread runs between
requests), by its one-run path (block ids as Python lists) and by its numpy path (the same ids as arrays):
why `plan_one_run` exists.  One Qwen3-32B TP=8 rank as vLLM's cross-layer cache, consecutive blocks.

    python3 -m scripts.bench.probes.cold_plan --out docs/benchmarks/cold-plan-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kvpush_common.plan.write import plan_write
from kvpush_common.protocol.layout import contiguous_layout
from kvpush_common.protocol.topology import routes
from scripts.bench import rerun_command

GEO = dict(num_layers=64, num_heads=1, head_dim=128, dtype="bfloat16", dtype_size=2, block_size=16, cross_layer=True)


def plan_ms(tokens: int, sleep_s: float, as_arrays: bool, reps: int) -> float:
    nb = tokens // GEO["block_size"]
    src = contiguous_layout(1 << 30, num_blocks=2 * nb + 8, **GEO)
    dst = contiguous_layout(1 << 40, num_blocks=2 * nb + 8, **GEO)
    route = routes(1, 1, 1)[0]
    took = []
    for _ in range(reps + 5):  # the first 5 warm the caches of the layouts
        sb, db = list(range(nb)), list(range(nb, 2 * nb))
        if as_arrays:
            sb, db = np.array(sb), np.array(db)
        time.sleep(sleep_s)
        t = time.perf_counter()
        plan_write(src, dst, route, sb, db, num_tokens=tokens, prepped=True)
        took.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(took[5:]), 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sleep-ms", type=float, default=20.0)
    ap.add_argument("--out", default="cold-plan-cpu.json")
    args = ap.parse_args()
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for path, as_arrays in (("one-run", False), ("numpy", True)):
            rows.append({"tokens": tokens, "path": path, "hot_ms_p50": plan_ms(tokens, 0.0, as_arrays, args.reps),
                         "cold_ms_p50": plan_ms(tokens, args.sleep_ms / 1e3, as_arrays, args.reps)})
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"command": rerun_command(__spec__, sys.argv[1:]), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
