"""What a producer rank's worker does once per new consumer rank, timed on this CPU machine (host memory, NIXL UCX).

`ProducerEndpoint._prepare_peer` runs on the worker thread at a consumer's handshake: NIXL `add_remote_agent`,
then `prep_xfer_dlist` of the per-block lists (our own once, the consumer's per peer), one entry per
(region, block).  A push handed over meanwhile waits for that step (docs/benchmarks/h200-wake-asleep.json: one
36 ms wake behind a 45 ms step).  Shapes: Qwen3-8B's 36 layers with K and V regions, per-block entries for
`--blocks` blocks (the count matters, not the bytes: one head of 16 elements per block row).  A CPU
measurement of NIXL's call costs, not of a GPU's.

    .venv/bin/python -m scripts.bench.probes.peer_prep --out docs/benchmarks/peer-prep-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvpush_common.device.host import HostBackend
from kvpush_common.plan.blockplan import unit_table
from kvpush_common.transport.nixl import NixlTransport, TransportConfig
from scripts.bench import rerun_command


def one(blocks: int, layers: int, tag: str) -> dict:
    shape = dict(num_layers=layers, num_heads=1, head_dim=16, block_size=16, num_blocks=blocks)
    src, dst = HostBackend(**shape), HostBackend(**shape)
    ours = NixlTransport(f"prep-p-{tag}", TransportConfig(), progress_thread=False)
    theirs = NixlTransport(f"prep-d-{tag}", TransportConfig(), progress_thread=False)
    try:
        ours.register(src.registration_regions(), "DRAM")
        theirs.register(dst.registration_regions(), "DRAM")
        t0 = time.perf_counter()
        peer = ours.add_peer(theirs.metadata())
        t1 = time.perf_counter()
        local_table, remote_table = unit_table(src.layout(), 0, 1), unit_table(dst.layout(), 0, 1)
        t2 = time.perf_counter()
        ours.prep(None, local_table, "DRAM")
        t3 = time.perf_counter()
        ours.prep(peer, remote_table, "DRAM")
        t4 = time.perf_counter()
    finally:
        ours.close()
        theirs.close()
    ms = lambda a, b: (b - a) * 1e3  # noqa: E731
    return {"add_peer_ms": ms(t0, t1), "tables_ms": ms(t1, t2), "local_prep_ms": ms(t2, t3),
            "remote_prep_ms": ms(t3, t4), "total_ms": ms(t0, t4), "entries": int(len(remote_table))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", default="1000,7000")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="peer-prep-cpu.json")
    args = ap.parse_args()
    rows = []
    for blocks in (int(b) for b in args.blocks.split(",")):
        runs = [one(blocks, args.layers, f"{blocks}-{r}") for r in range(args.reps)]
        row = {"blocks": blocks, "layers": args.layers, "entries_per_list": runs[0]["entries"]}
        row |= {f"{k}_p50": round(statistics.median(r[k] for r in runs), 2) for k in runs[0] if k.endswith("_ms")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    doc = {"meta": {"machine": "CPU only (this workplace's 2-core machine), host memory, NIXL UCX", "simulated": False,
                    "gpu": None, "reps": args.reps,
                    "command": rerun_command(__spec__, ["--out", args.out])},
           "rows": rows, "summary": {"total_ms_p50_max": max(r["total_ms_p50"] for r in rows)}}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
