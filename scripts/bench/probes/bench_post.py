"""Cost of turning one request into a postable NIXL WRITE, kvpush's two ways, side by side in one run:

  merged    plan_transfer (numpy, merges contiguous runs) -> get_xfer_descs x2 -> initialize_xfer.
            Works for any pair of layouts (block sizes, head slices, orders).
  prepped   blockplan: per peer, prep one descriptor per (region, block) once and cache it; per
            request plan_blocks (index arrays) -> make_prepped_xfer.  Same block geometry only.

Only preparation is timed (the bytes moved are the same either way).  Shape: a Qwen3-32B rank at
TP=8 (64 layers, 1 KV head, head_dim 128, bf16), block 16, a 16k-token request, with the source
and destination blocks either consecutive or shuffled.  Run: .venv/bin/python -m scripts.bench.probes.bench_post
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

os.environ.setdefault("UCX_MODULES", "^ib")
from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402

from kvpush_common.plan.blockplan import plan_blocks, unit_table  # noqa: E402
from kvpush_common.protocol.layout import contiguous_layout, slab_bytes  # noqa: E402
from kvpush_common.plan.planner import plan_transfer  # noqa: E402
from kvpush_common.plan.write import plan_write  # noqa: E402
from kvpush_common.protocol.topology import HeadRoute  # noqa: E402


def median_ms(fn, reps):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    nb_req = -(-args.tokens // args.block)
    num_blocks = 2 * nb_req
    geo = dict(num_layers=args.layers, num_heads=1, head_dim=128, block_size=args.block, num_blocks=num_blocks)
    size = slab_bytes(contiguous_layout(0, **geo))
    # Registration needs addresses, not touched pages: np.empty does not fault the slab in.
    src_buf, dst_buf = np.empty(size, np.uint8), np.empty(size, np.uint8)
    src = contiguous_layout(src_buf.ctypes.data, **geo)
    dst = contiguous_layout(dst_buf.ctypes.data, **geo)
    conf = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    a, b = nixl_agent("bench-P", conf), nixl_agent("bench-D", conf)
    for ag, buf in ((a, src_buf), (b, dst_buf)):
        ag.register_memory(ag.get_reg_descs(np.array([[buf.ctypes.data, buf.nbytes, 0]], np.uint64), "DRAM"))
    peer = a.add_remote_agent(b.get_agent_metadata())
    route = HeadRoute(0, 0, 0, 0, 1)

    t = time.perf_counter()
    local_h = a.prep_xfer_dlist("NIXL_INIT_AGENT", unit_table(src, 0, 1), "DRAM")
    remote_h = a.prep_xfer_dlist(peer, unit_table(dst, 0, 1), "DRAM")
    prep_once_ms = (time.perf_counter() - t) * 1e3

    rng = np.random.default_rng(0)
    results = {"shape": {**geo, "tokens": args.tokens, "regions": 2 * args.layers}, "prep_once_ms": prep_once_ms}
    for name, order in (("consecutive", np.arange(num_blocks)), ("shuffled", rng.permutation(num_blocks))):
        sblk, dblk = order[:nb_req], np.roll(order, 7)[:nb_req]

        def merged():
            plan = plan_transfer(src, dst, route, sblk, dblk, num_tokens=args.tokens)
            h = a.initialize_xfer("WRITE", a.get_xfer_descs(plan.src, "DRAM"), a.get_xfer_descs(plan.dst, "DRAM"),
                                  peer, b"n")
            a.release_xfer_handle(h)
            return plan.num_descs

        def prepped():
            bp = plan_blocks(src, dst, route, sblk, dblk, num_tokens=args.tokens)
            h = a.make_prepped_xfer("WRITE", local_h, bp.local_idx, remote_h, bp.remote_idx, b"n")
            a.release_xfer_handle(h)

        def planned():  # what the producer's `plan` stage runs: the cheapest valid plan, no NIXL call
            plan_write(src, dst, route, sblk, dblk, num_tokens=args.tokens, prepped=True)

        ndesc = merged()
        m, p = median_ms(merged, args.reps), median_ms(prepped, args.reps)
        results[name] = {"merged_ms": round(m, 3), "prepped_ms": round(p, 3), "merged_over_prepped": round(m / p, 3),
                         "merged_descriptors": ndesc, "prepped_descriptors": int(2 * args.layers * nb_req),
                         "plan_write_ms": round(median_ms(planned, args.reps), 3)}
        print(f"{name:<12} merged {m:8.2f} ms ({ndesc} descs)   prepped {p:8.2f} ms "
              f"({2 * args.layers * nb_req} descs)   merged/prepped {m / p:5.2f}")
    print(f"prepped lists, one-time per peer: {prep_once_ms:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    os._exit(0)


if __name__ == "__main__":
    main()
