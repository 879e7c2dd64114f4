"""Exposed handoff of one push, next to the wire time of the same bytes, on GPUs (one run, side by side).

A producer rank and a consumer rank (separate processes, kvpush endpoints over NIXL UCX, CudaSlab
KV in VRAM) shaped like one Qwen3-32B rank at TP=8: 64 layers, 1 KV head, head_dim 128, bf16,
block 16.  For each request size and block arrangement (consecutive or shuffled block ids), the
consumer registers first, the producer then reports the KV ready, and we read from the endpoints'
event logs:
  handoff  = producer kv_ready -> consumer KV usable (what the request waits for after prefill)
  wire     = producer WRITE posted -> WRITE done
  post     = kv_ready -> WRITE posted (planning + posting, on the writer thread)
Also a raw torch copy of the same number of bytes in one piece (the floor).

    python3 scripts/bench/gpu_handoff.py --out runs/gpu-handoff.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from procs import PeerProcess  # noqa: E402

from kvpush_common.events import read_events  # noqa: E402

GEO = dict(num_layers=64, num_heads=1, head_dim=128, dtype="bfloat16", dtype_size=2, block_size=16)


def raw_copy_ms(nbytes: int, reps: int = 10) -> float:
    import torch

    n = torch.cuda.device_count()
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{1 if n > 1 else 0}")
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="gpu-handoff.json")
    args = ap.parse_args()
    import torch

    tokens = [int(t) for t in args.tokens.split(",")]
    num_blocks = 2 * max(tokens) // GEO["block_size"]
    events = Path(tempfile.mkdtemp(prefix="kvpush-ev-"))
    env = {"KVPUSH_EVENT_DIR": str(events)}
    two = torch.cuda.device_count() > 1
    p, d = PeerProcess("P", env), PeerProcess("D", env)
    rows = []
    try:
        port = p.call("start", role="producer", cfg=dict(engine_id="P", total_kv_heads=1),
                      backend=dict(kind="cuda", num_blocks=num_blocks, device=0, **GEO))["port"]
        d.call("start", role="consumer", cfg=dict(engine_id="D", total_kv_heads=1),
               backend=dict(kind="cuda", num_blocks=num_blocks, device=1 if two else 0, **GEO))
        ref = dict(engine_id="P", host="127.0.0.1", base_port=port, tp_size=1)
        rng = np.random.default_rng(0)
        n = 0
        for ntok in tokens:
            nb = ntok // GEO["block_size"]
            for arrangement in ("consecutive", "shuffled"):
                for rep in range(args.reps + 1):  # first rep is warm-up
                    if arrangement == "consecutive":
                        pb, db = list(range(nb)), list(range(nb, 2 * nb))
                    else:
                        pb, db = [int(x) for x in rng.permutation(num_blocks)[:nb]], \
                                 [int(x) for x in rng.permutation(num_blocks)[:nb]]
                    tid = f"{arrangement}-{ntok}-{rep}"
                    d.call("expect", tid=tid, attempt=0, producer=ref, blocks=db, num_tokens=ntok)
                    time.sleep(0.05)
                    p.call("ready", tid=tid, attempt=0, blocks=pb, num_tokens=ntok)
                    n += 1
                    got = d.call("wait", n=n, seconds=60, timeout=90)["results"]
                    assert got[-1]["ok"], got[-1]
        ev = read_events(events)
        by = {}
        for e in ev:
            by.setdefault(e["tid"], {}).setdefault(e["ev"], e)
        for ntok in tokens:
            nbytes = 2 * GEO["num_layers"] * ntok * GEO["head_dim"] * GEO["dtype_size"]
            raw = raw_copy_ms(nbytes)
            for arrangement in ("consecutive", "shuffled"):
                sample = [by[f"{arrangement}-{ntok}-{r}"] for r in range(1, args.reps + 1)]
                hand = [(s["received"]["t"] - s["kv_ready"]["t"]) * 1e3 for s in sample]
                wire = [(s["write_done"]["t"] - s["posted"]["t"]) * 1e3 for s in sample]
                post = [(s["posted"]["t"] - s["kv_ready"]["t"]) * 1e3 for s in sample]
                row = {"tokens": ntok, "arrangement": arrangement, "bytes": nbytes,
                       "descriptors": sample[0]["posted"].get("descs"),
                       "handoff_ms_p50": round(statistics.median(hand), 3),
                       "wire_ms_p50": round(statistics.median(wire), 3),
                       "post_ms_p50": round(statistics.median(post), 3),
                       "raw_copy_ms": round(raw, 3),
                       "handoff_over_raw": round(statistics.median(hand) / raw, 2)}
                rows.append(row)
                print(json.dumps(row))
    finally:
        p.close()
        d.close()
    meta = {"gpus": torch.cuda.device_count(), "device": torch.cuda.get_device_name(0), "geometry": GEO,
            "reps": args.reps, "note": "producer and consumer on the same GPU" if not two else "GPU 0 -> GPU 1"}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
