"""Where one push's handoff goes, stage by stage, on this CPU machine (host memory, real NIXL UCX).

The CPU twin of `scripts/bench/handoff/gpu_handoff.py` (same run loop, `push_pair.run_case`, with both
slabs in host memory): a producer rank and a consumer rank in two processes, shaped like one Qwen3-32B
rank at TP=8 (64 layers, 1 KV head, head_dim 128, bf16, block 16), the endpoints' default 1 ms poll, the
consumer registering first.  Per request size and block arrangement, medians of `--reps` requests of:

  handoff  producer's kv_ready call -> consumer's KV usable
  wake     kv_ready call -> the writer thread takes it          (kv_ready event's wake_ms)
  fence    -> the device fence seen done (host memory: none)    (posted event's fence_ms)
  plan     -> index arrays / descriptor lists built             (posted event's plan_ms)
  post     -> NIXL's make_prepped_xfer + transfer returned      (posted event's post_ms)
  wire     WRITE posted -> the producer sees it DONE
  notice   producer sees DONE -> consumer's KV usable (its notification poll; may be < 0)

next to one numpy copy of the same bytes (the memory-bandwidth floor).  A CPU measurement: it says
where kvpush's own Python and NIXL's call costs go, not what an H200 or EFA wire costs.  On host memory
UCX copies the bytes inside the transfer call, so here `post` holds the copy and `wire` is near zero.

    .venv/bin/python -m scripts.bench.probes.handoff_stages --out docs/benchmarks/handoff-stages-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from scripts.bench import rerun_command
from scripts.bench.handoff.push_pair import handoff_args, handoff_passes

STAGES = ("wake", "fence", "plan", "post")


def copy_ms(nbytes: int, reps: int = 5) -> float:
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 3)


def table(rows: list[dict]) -> str:
    head = ("| layout | wire poll | tokens | blocks | descriptors | handoff p50 | wake | fence | plan | post | wire | notice | "
            "numpy copy |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        st = r["stage_ms_p50"]
        lines.append(f"| {r['layout']} | {r['wire_poll_ms']:g} ms | {r['tokens']:,} | {r['arrangement']} | {r['descs']:,} | "
                     f"{r['handoff_ms_p50']:.2f} ms | " + " | ".join(f"{st[s]:.3f}" for s in STAGES)
                     + f" | {r['wire_ms_p50']:.2f} | {r['notice_ms_p50']:.2f} | {r['raw_copy_ms']:.2f} ms |")
    return head + "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    handoff_args(ap, "handoff-stages-cpu.json")
    args = ap.parse_args()
    rows = handoff_passes(args, "host")
    for row in rows:
        row["raw_copy_ms"] = copy_ms(row["bytes"])
        row["handoff_over_raw"] = round(row["handoff_ms_p50"] / row["raw_copy_ms"], 2)
    consecutive = [r for r in rows if r["arrangement"] == "consecutive"]
    summary = {}  # kvpush's own part before the post, and the whole handoff, for consecutive blocks
    for lay, w in dict.fromkeys((r["layout"], r["wire_poll_ms"]) for r in rows):
        mine = [r for r in consecutive if (r["layout"], r["wire_poll_ms"]) == (lay, w)]
        at = f"@wire_poll_ms={w}" if lay == "per-layer" else f"@{lay},wire_poll_ms={w}"
        summary[f"before_post_ms_p50_max{at}"] = round(max(
            sum(r["stage_ms_p50"][s] or 0.0 for s in STAGES) for r in mine), 3)
        summary[f"handoff_ms_p50_max{at}"] = round(max(r["handoff_ms_p50"] for r in mine), 3)
    meta = {"machine": "CPU only (this workplace's 2-core machine), host memory, NIXL UCX on 127.0.0.1",
            "simulated": False, "gpu": None, "reps": args.reps,
            "command": rerun_command(__spec__, sys.argv[1:])}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text("# Handoff stages on CPU (host memory, NIXL UCX)\n\n"
                                      f"`{meta['command']}`\n\n" + table(rows))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
