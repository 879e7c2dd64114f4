"""Local push demo of the protocol core: one producer rank and one consumer rank in their own
processes over real NIXL (UCX, 127.0.0.1), and this script as the router.

For each request the router dispatches both legs at once: the consumer registers its destination
blocks while the producer is still "prefilling" (a sleep standing in for the model), the producer's
worker thread pushes the KV when it is ready, and the consumer reports it usable.  Every
destination byte is compared with the source.  Prints a per-request timeline.
"""

from __future__ import annotations

import argparse
import base64
import random
import sys
import threading
import time

import numpy as np

from kvpush_common.testing.procs import PeerProcess  # noqa: E402

GEO = dict(num_layers=4, num_heads=2, head_dim=64, dtype="bfloat16", dtype_size=2, block_size=16, num_blocks=2048)


def view(proc, blocks, n):
    r = proc.call("logical", blocks=blocks, num_tokens=n)
    return np.frombuffer(base64.b64decode(r["data"]), dtype=np.uint8).reshape(r["shape"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    p, d = PeerProcess("producer"), PeerProcess("consumer")
    try:
        port = p.call("start", role="producer", cfg=dict(engine_id="prefill-0", total_kv_heads=2),
                      backend=dict(kind="host", **GEO))["port"]
        d.call("start", role="consumer", cfg=dict(engine_id="decode-0", total_kv_heads=2),
               backend=dict(kind="host", **GEO))
        p.call("fill", seed=args.seed)
        d.call("poison", byte=0xAB)
        ref = dict(engine_id="prefill-0", host="127.0.0.1", port=port, tp_size=1)
        free_p, free_d = list(range(GEO["num_blocks"])), list(range(GEO["num_blocks"]))
        rng.shuffle(free_p), rng.shuffle(free_d)
        reqs, lock = [], threading.Lock()
        print(f"producer side channel 127.0.0.1:{port}; dispatching {args.requests} requests (both legs at once)")
        for i in range(args.requests):
            n = rng.choice([100, 700, 2000, 4000])
            nb = -(-n // GEO["block_size"])
            pb, db = [free_p.pop() for _ in range(nb)], [free_d.pop() for _ in range(nb)]
            prefill_s = 0.05 + n / 20000  # stand-in for the model's prefill time
            tid = f"req-{i}"
            t0 = time.monotonic()
            with lock:
                d.call("expect", tid=tid, attempt=0, producer=ref, blocks=db, num_tokens=n)  # decode leg
            t_reg = time.monotonic()
            time.sleep(prefill_s)  # prefill leg runs meanwhile
            with lock:
                p.call("ready", tid=tid, attempt=0, blocks=pb, num_tokens=n)
            reqs.append(dict(tid=tid, n=n, pb=pb, db=db, t0=t0, t_reg=t_reg, t_ready=time.monotonic()))
        res = d.call("wait", n=args.requests, seconds=60, timeout=90)["results"]
        p.call("wait", n=args.requests, seconds=30, timeout=60)
        done_at = {tid: t for tid, _, t in d.call("times")["times"]}
        ok = {r["tid"]: r["ok"] for r in res}
        print(f"{'request':<8} {'tokens':>6} {'reg sent':>9} {'prefill done':>13} {'KV usable':>10} {'handoff':>8}  bytes")
        bad = 0
        for r in reqs:
            same = ok.get(r["tid"]) and np.array_equal(view(p, r["pb"], r["n"]), view(d, r["db"], r["n"]))
            bad += not same
            ms = lambda t: f"{(t - r['t0']) * 1e3:8.1f}ms"  # noqa: E731
            print(f"{r['tid']:<8} {r['n']:>6} {ms(r['t_reg']):>9} {ms(r['t_ready']):>13} {ms(done_at[r['tid']]):>10} "
                  f"{(done_at[r['tid']] - r['t_ready']) * 1e3:6.1f}ms  {'verified' if same else 'MISMATCH'}")
        stats = p.call("stats")["counters"]
        print(f"producer: {int(stats['kvpush_writes_done_total'])} WRITEs, "
              f"{int(stats['kvpush_bytes_written_total'])} bytes, {int(stats['kvpush_descriptors_posted_total'])} descriptors")
        print("handoff = prefill done -> KV usable on the consumer (includes this router's polling)")
        print("ALL VERIFIED" if not bad else f"{bad} MISMATCHED")
        return 1 if bad else 0
    finally:
        p.close()
        d.close()


if __name__ == "__main__":
    sys.exit(main())
