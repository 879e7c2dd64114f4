"""One producer rank and one consumer rank (kvpush endpoints in two processes over NIXL UCX), shaped like one
Qwen3-32B rank at TP=8, pushing requests one at a time and timed from the endpoints' event logs: the run loop of
the handoff micro-benchmark (`gpu_handoff.py`) and of the probe `probes/handoff_stages.py` (its CPU twin)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kvpush_common.endpoint.events import read_events
from kvpush_common.testing.procs import PeerProcess

GEO = dict(num_layers=64, num_heads=1, head_dim=128, dtype="bfloat16", dtype_size=2)


def _p50(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def run_case(block: int, tokens: list[int], reps: int, two: bool, poll_s: float = 0.0002, kind: str = "cuda",
             wire_poll_s: float | None = None, cross_layer: bool = False) -> list[dict]:
    """One producer/consumer pair; every size x arrangement `reps` times after a warm-up; rows of medians.
    `kind` "host" puts both slabs in host memory (the CPU twin of the same run); `cross_layer` lays both slabs
    out as vLLM's cross-layer cache (block-major: a run of consecutive blocks is one descriptor)."""
    nblocks = 2 * max(tokens) // block + 8
    events = Path(tempfile.mkdtemp(prefix="kvpush-frag-"))
    env = {"KVPUSH_EVENT_DIR": str(events)}
    cfg = dict(poll_s=poll_s)
    cfg["wire_poll_s"] = wire_poll_s if wire_poll_s is not None else poll_s
    cfg["write_poll_s"] = cfg["wire_poll_s"]  # --wire-poll-ms sets both sides' poll while the bytes move
    p, d = PeerProcess("P", env), PeerProcess("D", env)
    geo = dict(GEO, cross_layer=True) if cross_layer else GEO
    out = []
    try:
        port = p.call("start", role="producer", cfg=dict(engine_id="P", total_kv_heads=1, **cfg),
                      backend=dict(kind=kind, num_blocks=nblocks, block_size=block, **geo,
                                   **({"device": 0} if kind == "cuda" else {})))["port"]
        d.call("start", role="consumer", cfg=dict(engine_id="D", total_kv_heads=1, **cfg),
               backend=dict(kind=kind, num_blocks=nblocks, block_size=block, **geo,
                            **({"device": 1 if two else 0} if kind == "cuda" else {})))
        ref = dict(engine_id="P", host="127.0.0.1", port=port, tp_size=1)
        rng = np.random.default_rng(block)
        n = 0
        for ntok in tokens:
            nb = ntok // block
            for arrangement in ("consecutive", "shuffled"):
                for rep in range(reps + 1):  # rep 0 is warm-up
                    if arrangement == "consecutive":
                        pb, db = list(range(nb)), list(range(nb, 2 * nb))
                    else:
                        pb = [int(x) for x in rng.permutation(nblocks)[:nb]]
                        db = [int(x) for x in rng.permutation(nblocks)[:nb]]
                    tid = f"{arrangement}-{ntok}-{rep}"
                    d.call("expect", tid=tid, attempt=0, producer=ref, blocks=db, num_tokens=ntok)
                    time.sleep(0.05)
                    p.call("ready", tid=tid, attempt=0, blocks=pb, num_tokens=ntok)
                    n += 1
                    got = d.call("wait", n=n, seconds=120, timeout=150)["results"]
                    assert got[-1]["ok"], got[-1]
        by: dict = {}
        for e in read_events(events):
            by.setdefault(e["tid"], {}).setdefault(e["ev"], e)
        for ntok in tokens:
            for arrangement in ("consecutive", "shuffled"):
                s = [by[f"{arrangement}-{ntok}-{r}"] for r in range(1, reps + 1)]
                hand = [(x["received"]["t"] - x["kv_ready"]["t"]) * 1e3 for x in s]
                post = [(x["posted"]["t"] - x["kv_ready"]["t"]) * 1e3 for x in s]
                wire = [(x["write_done"]["t"] - x["posted"]["t"]) * 1e3 for x in s if "write_done" in x]
                out.append({"block_size": block, "desc_kib": block * 256 // 1024, "tokens": ntok,
                            "poll_ms": poll_s * 1e3, "wire_poll_ms": cfg["wire_poll_s"] * 1e3,
                            "layout": "cross-layer" if cross_layer else "per-layer",
                            "bytes": ntok * 128 * 256, "arrangement": arrangement,
                            "descs": s[0]["posted"].get("descs"),
                            "handoff_ms_p50": statistics.median(hand), "handoff_ms_max": max(hand),
                            "post_ms_p50": statistics.median(post),
                            "wire_ms_p50": statistics.median(wire) if wire else None,
                            # where kv_ready -> posted goes (producer's stage timers, issue 15)
                            "stage_ms_p50": {"wake": _p50([x["kv_ready"].get("wake_ms") for x in s]),
                                             **{st: _p50([x["posted"].get(f"{st}_ms") for x in s])
                                                for st in ("fence", "plan", "post")}},
                            "notice_ms_p50": _p50([(x["received"]["t"] - x["write_done"]["t"]) * 1e3
                                                   for x in s if "write_done" in x])})
                print(json.dumps(out[-1]), flush=True)
    finally:
        p.close()
        d.close()
    return out


def handoff_args(ap: argparse.ArgumentParser, out: str) -> None:
    """The options of the one-push handoff runs (`gpu_handoff.py`, and its CPU twin `handoff_stages.py`)."""
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--wire-poll-ms", default="1,0.2",
                    help="the poll period of both sides while the bytes move (write_poll_s on the producer, wire_poll_s on "
                         "the consumer), one pass each (1 = as before)")
    ap.add_argument("--layouts", default="per-layer",
                    help="per-layer (a region per layer's K and V) and/or cross-layer (vLLM's cross-layer cache), "
                         "one pass each")
    ap.add_argument("--out", default=out)


def handoff_passes(args, kind: str = "cuda", two: bool = False) -> list[dict]:
    """Direct pushes, block 16, the endpoints' 1 ms poll: one pass per `--layouts` x `--wire-poll-ms` value."""
    tokens = [int(t) for t in args.tokens.split(",")]
    layouts = args.layouts.split(",")
    if set(layouts) - {"per-layer", "cross-layer"}:
        raise SystemExit(f"--layouts takes per-layer and/or cross-layer, got {args.layouts!r}")
    rows = []
    for layout in layouts:
        for wire_poll_ms in [float(x) for x in args.wire_poll_ms.split(",")]:
            rows += run_case(16, tokens, reps=args.reps, two=two, poll_s=0.001, kind=kind,
                             wire_poll_s=wire_poll_ms / 1e3, cross_layer=layout == "cross-layer")
    return rows
