"""Fragmented vs contiguous pushes on GPUs, direct vs staged, side by side in one run (issue 7).

A producer rank and a consumer rank (kvpush endpoints in two processes, CudaSlab KV in VRAM, GPU 0 ->
GPU 1), a Qwen3-32B TP=8 rank (64 layers, K/V planes: 128 regions, 1 KV head of dim 128, bf16).
Block sizes 16, 64, 256 make per-region descriptors of 4, 16 and 64 KiB.  For 16k-token (512 MiB)
and 32k-token (1 GiB) requests, blocks consecutive or shuffled on both sides, each once direct (one
NIXL WRITE of the merged descriptors) and once staged (gather -> chunk WRITEs -> scatter).  Reported
per row: handoff (producer KV ready -> consumer KV usable, from the endpoints' event logs) and a raw
peer copy of the same bytes; `summary.fragmented_over_contiguous_max` is the worst ratio, over block
sizes and sizes, of the staged shuffled handoff to the direct consecutive handoff.

    python3 -m scripts.bench.probes.fragmentation --out h200-fragmentation.json

The run loop is the handoff micro-benchmark's (scripts/bench/handoff/push_pair.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scripts.bench.handoff.kvslab import peer_copy_ms
from scripts.bench.handoff.push_pair import GEO, run_case


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--block-sizes", default="16,64,256")
    ap.add_argument("--tokens", default="16384,32768")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk-mib", type=int, default=128)
    ap.add_argument("--out", default="h200-fragmentation.json")
    args = ap.parse_args()
    import torch

    two = torch.cuda.device_count() > 1
    tokens = [int(t) for t in args.tokens.split(",")]
    raw = {t: peer_copy_ms(t * 128 * 256) for t in tokens}
    rows = []
    for block in [int(b) for b in args.block_sizes.split(",")]:
        for staged in (False, True):
            rows += run_case(block, tokens, staged, args.reps, args.chunk_mib, two)
    for r in rows:
        r["raw_copy_ms"] = raw[r["tokens"]]
    ratios = []
    for r in rows:
        if r["path"] == "staged" and r["arrangement"] == "shuffled":
            base = next(x for x in rows if x["path"] == "direct" and x["arrangement"] == "consecutive"
                        and x["block_size"] == r["block_size"] and x["tokens"] == r["tokens"])
            ratios.append({"block_size": r["block_size"], "tokens": r["tokens"],
                           "staged_shuffled_ms": r["handoff_ms_p50"], "direct_contiguous_ms": base["handoff_ms_p50"],
                           "ratio": r["handoff_ms_p50"] / base["handoff_ms_p50"]})
    summary = {"fragmented_over_contiguous_max": round(max(x["ratio"] for x in ratios), 3), "ratios": ratios}
    meta = {"gpus": torch.cuda.device_count(), "device": torch.cuda.get_device_name(0), "geometry": GEO,
            "reps": args.reps, "chunk_mib": args.chunk_mib}
    Path(args.out).write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
