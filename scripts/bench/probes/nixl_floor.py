"""Bare NIXL's handoff of one push: what a Python program pays with NIXL alone, no kvpush (issue 15's floor).

The same two processes and bytes as the handoff micro-benchmark's `gpu_handoff.py` (one Qwen3-32B TP=8 rank, block 16, the blocks of one
request consecutive on both sides, so one descriptor on a cross-layer cache), the same NIXL backend and
progress-thread choice as kvpush's endpoints, and the same pacing: the producer sleeps 50 ms before each
request (kvpush's writer thread is idle between requests too, so both run cold).  Per request:

  post     the producer's get_xfer_descs x 2 + initialize_xfer + transfer (with the notification)
  done     transfer -> the producer sees DONE, polling every `poll_s`
  handoff  the post starts -> the consumer sees the notification, polling get_notifs every `poll_s`

kvpush's handoff on the same run adds to this its own Python: waking on the KV ready, the rendezvous, the fence
check, the plan, and the consumer's bookkeeping.  A floor for kvpush in Python, not for NIXL in C++.

    python3 -m scripts.bench.probes.nixl_floor --tokens 4096,16384 --out nixl-floor.json
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

from kvpush_common.plan.write import plan_write
from kvpush_common.protocol.layout import KVLayout
from kvpush_common.protocol.topology import routes
from kvpush_common.testing.peer_proc import make_backend
from kvpush_common.transport.nixl import NixlTransport, TransportConfig
from scripts.bench import rerun_command
from scripts.bench.handoff.kvslab import QWEN3_32B_RANK

GEO = dict(QWEN3_32B_RANK, block_size=16, cross_layer=True)  # gpu_handoff.py's cross-layer pass


def _backend(kind: str, num_blocks: int, device: int):
    return make_backend(dict(kind=kind, num_blocks=num_blocks, **GEO, **({"device": device} if kind == "cuda" else {})))


def _mem(kind: str) -> str:
    return "VRAM" if kind == "cuda" else "DRAM"


def consumer(conn, kind: str, num_blocks: int, device: int, poll_s: float) -> None:
    """The decode side: its slab registered, polling get_notifs every `poll_s` as kvpush's consumer does while
    it waits for bytes; the wall time each notification is seen goes back to the producer."""
    backend = _backend(kind, num_blocks, device)
    nixl = NixlTransport("floor-d", TransportConfig(), progress_thread=TransportConfig().progress_thread_for("consumer"))
    nixl.register(backend.registration_regions(), _mem(kind))
    conn.send_bytes(nixl.metadata())
    conn.send_bytes(msgspec.msgpack.encode(backend.layout()))
    while True:
        if conn.poll(0):
            msg = conn.recv_bytes()
            if msg == b"stop":
                nixl.close()
                return
        for frames in nixl.get_notifs().values():
            for frame in frames:
                conn.send_bytes(msgspec.msgpack.encode([frame.decode(), time.time()]))
        time.sleep(poll_s)


def bare_nixl_handoff(tokens: list[int], reps: int, poll_s: float, kind: str = "cuda", two: bool = False) -> list[dict]:
    """Rows per request size: medians of `reps` requests after one warm-up (ms)."""
    num_blocks = 2 * max(tokens) // GEO["block_size"] + 8
    backend = _backend(kind, num_blocks, 0)
    nixl = NixlTransport("floor-p", TransportConfig(), progress_thread=TransportConfig().progress_thread_for("producer"))
    nixl.register(backend.registration_regions(), _mem(kind))
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=consumer, args=(child, kind, num_blocks, 1 if two else 0, poll_s), daemon=True)
    proc.start()
    rows = []
    try:
        peer = nixl.add_peer(conn.recv_bytes())
        dst = msgspec.msgpack.decode(conn.recv_bytes(), type=KVLayout)
        route = routes(1, 1, 1)[0]
        for ntok in tokens:
            nb = -(-ntok // GEO["block_size"])
            plan = plan_write(backend.layout(), dst, route, list(range(nb)), list(range(nb, 2 * nb)), num_tokens=ntok)
            post, done, handoff = [], [], []
            for rep in range(reps + 1):  # rep 0 is warm-up
                time.sleep(0.05)
                tag = f"{ntok}-{rep}"
                t0 = time.time()
                handle = nixl.post("WRITE", peer, plan.src, plan.dst, _mem(kind), _mem(kind), tag.encode())
                t1 = time.time()
                while (state := nixl.state(handle)) == "PROC":
                    time.sleep(poll_s)
                t2 = time.time()
                if state != "DONE":
                    raise RuntimeError(f"WRITE {tag} ended {state}")
                nixl.release(handle)
                if not conn.poll(10):
                    raise TimeoutError(f"the consumer never saw notification {tag}")
                seen_tag, seen_at = msgspec.msgpack.decode(conn.recv_bytes())
                if seen_tag != tag:
                    raise RuntimeError(f"expected notification {tag}, got {seen_tag}")
                if rep:
                    post.append((t1 - t0) * 1e3)
                    done.append((t2 - t1) * 1e3)
                    handoff.append((seen_at - t0) * 1e3)
            rows.append({"tokens": ntok, "bytes": plan.nbytes, "descs": plan.num_descs, "poll_ms": poll_s * 1e3,
                         "post_ms_p50": round(statistics.median(post), 3), "done_ms_p50": round(statistics.median(done), 3),
                         "handoff_ms_p50": round(statistics.median(handoff), 3)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        conn.send_bytes(b"stop")
        proc.join(30)
        nixl.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--poll-ms", type=float, default=0.05)
    ap.add_argument("--kind", default="cuda", choices=["cuda", "host"])
    ap.add_argument("--out", default="nixl-floor.json")
    args = ap.parse_args()
    rows = bare_nixl_handoff([int(t) for t in args.tokens.split(",")], args.reps, args.poll_ms / 1e3, args.kind)
    Path(args.out).write_text(json.dumps({"command": rerun_command(__spec__, sys.argv[1:]), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
