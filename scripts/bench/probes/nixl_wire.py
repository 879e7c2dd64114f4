"""Contiguous KV transfer bandwidth through NIXL vs a raw peer copy of the same bytes (one run).

Two processes, as in serving (prefill slab on GPU 0 in this one, decode slab on GPU 1 in a child
that keeps its NIXL agent progressing; Qwen3-32B TP=8 rank layout; UCX in one process does not use
cuda_ipc), a request's consecutive blocks on both sides merged into one descriptor per region (what
kvpush posts), WRITE timed from before `initialize_xfer` to DONE (`total`) and from `transfer()` to
DONE (`wire`), against `torch` copying the same bytes GPU 0 -> GPU 1 in one piece.

    python3 -m scripts.bench.probes.nixl_wire --out nixl-wire.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import msgspec

from kvpush_common.plan.blockplan import merge_runs, plan_blocks
from kvpush_common.protocol.layout import KVLayout
from kvpush_common.protocol.topology import routes
from kvpush_common.transport.nixl import NixlTransport, TransportConfig
from scripts.bench.handoff.kvslab import QWEN3_32B_RANK, peer_copy_ms


def serve_target(conn, bs: int, nblocks: int, device: int) -> None:
    """The decode side: register its slab, keep the agent progressing, check bytes on request."""
    import torch

    from kvpush_cuda.slab import CudaSlab

    torch.cuda.set_device(device)
    dst = CudaSlab(block_size=bs, num_blocks=nblocks, device=device, **QWEN3_32B_RANK)
    b = NixlTransport(f"wire-dst-{bs}", TransportConfig(), progress_thread=True)
    b.register(dst.registration_regions(), "VRAM")
    conn.send_bytes(b.metadata())
    conn.send_bytes(msgspec.msgpack.encode(dst.layout()))
    while True:
        if not conn.poll(0.001):
            b.get_notifs()
            continue
        msg = conn.recv_bytes()
        if msg == b"stop":
            b.close()
            return
        spans = msgspec.msgpack.decode(msg)
        good = all(bool((dst.tensor[a - dst.slab_base:a - dst.slab_base + n] == 7).all()) for a, n in spans)
        conn.send_bytes(b"ok" if good else b"bad")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="1024,4096,16384,32768")
    ap.add_argument("--block-sizes", default="16,128")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="nixl-wire.json")
    args = ap.parse_args()
    import torch

    from kvpush_cuda.slab import CudaSlab

    two = torch.cuda.device_count() > 1
    rows = []
    for bs in [int(x) for x in args.block_sizes.split(",")]:
        tokens = [int(x) for x in args.tokens.split(",")]
        nblocks = max(tokens) // bs + 8
        torch.cuda.set_device(0)
        src = CudaSlab(block_size=bs, num_blocks=nblocks, device=0, fill=7, **QWEN3_32B_RANK)
        a = NixlTransport(f"wire-src-{bs}", TransportConfig(), progress_thread=False)
        a.register(src.registration_regions(), "VRAM")
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        target = ctx.Process(target=serve_target, args=(child, bs, nblocks, 1 if two else 0), daemon=True)
        target.start()
        md, layout_bytes = conn.recv_bytes(), conn.recv_bytes()
        dst_layout = msgspec.msgpack.decode(layout_bytes, type=KVLayout)
        peer = a.add_peer(md)
        route = routes(1, 1, 1)[0]
        print(f"block {bs}: agents ready", file=sys.stderr, flush=True)
        for n in tokens:
            k = -(-n // bs)
            plan = merge_runs(src.layout(), dst_layout, route,
                              plan_blocks(src.layout(), dst_layout, route, list(range(k)), list(range(3, 3 + k)),
                                          num_tokens=n))
            total, wire = [], []
            for rep in range(args.reps + 2):
                t0 = time.perf_counter()
                ld = a._agent.get_xfer_descs(plan.src, "VRAM")
                rd = a._agent.get_xfer_descs(plan.dst, "VRAM")
                h = a._agent.initialize_xfer("WRITE", ld, rd, peer, b"")
                t1 = time.perf_counter()
                state = a._agent.transfer(h)
                deadline = time.perf_counter() + 10
                while state == "PROC":
                    state = a._agent.check_xfer_state(h)
                    if time.perf_counter() > deadline:
                        raise TimeoutError(f"WRITE of {plan.nbytes} bytes not done after 10 s")
                t2 = time.perf_counter()
                assert state == "DONE", state
                a._agent.release_xfer_handle(h)
                if rep >= 2:
                    total.append((t2 - t0) * 1e3)
                    wire.append((t2 - t1) * 1e3)
            raw = peer_copy_ms(plan.nbytes, 0, 1 if two else 0, args.reps)
            row = {"block_size": bs, "tokens": n, "bytes": plan.nbytes, "descs": plan.num_descs,
                   "nixl_total_ms_p50": statistics.median(total), "nixl_wire_ms_p50": statistics.median(wire),
                   "raw_copy_ms_p50": raw}
            row["efficiency_wire"] = row["raw_copy_ms_p50"] / row["nixl_wire_ms_p50"]
            row["efficiency_total"] = row["raw_copy_ms_p50"] / row["nixl_total_ms_p50"]
            conn.send_bytes(msgspec.msgpack.encode([[int(r[0]), int(r[1])] for r in plan.dst[:: max(1, len(plan.dst) // 8)]]))
            assert conn.recv_bytes() == b"ok", "destination bytes differ"
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        conn.send_bytes(b"stop")
        target.join(30)
        a.close()
        del src
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"gpus": torch.cuda.device_count(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
