"""How long bytes of a NIXL WRITE keep landing after the initiator released the running transfer (issue 16
item 4: the residual window behind the consumer's clock fence).  Two processes on this host over UCX: the
initiator posts one WRITE of N x 1 MiB descriptors, releases it after `--release-after-ms`, and the target
watches one byte per MiB of its buffer until nothing changes for a second.

    .venv/bin/python -m scripts.bench.probes.release_window --mib 1024 --release-after-ms 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np

from kvpush_common.transport.nixl import NixlTransport, TransportConfig

MIB = 1 << 20


def target(conn, mib: int) -> None:
    buf = np.zeros(mib * MIB, np.uint8)
    t = NixlTransport("target", TransportConfig())
    t.register(np.array([[buf.ctypes.data, buf.nbytes, 0]], np.uint64), "DRAM")
    conn.send((t.metadata(), buf.ctypes.data))
    conn.recv()  # the initiator posted
    probe = buf[MIB - 1::MIB]  # the last byte of each descriptor: it lands when that descriptor is done
    seen, last_change, t0 = 0, time.monotonic(), None
    while time.monotonic() - last_change < 1.0:
        t.get_notifs()  # lets UCX progress here as a consumer's worker would
        n = int(np.count_nonzero(probe))
        if n != seen:
            seen, last_change = n, time.monotonic()
        if conn.poll():
            t0 = conn.recv()  # the initiator's release time (CLOCK_MONOTONIC, shared by both processes)
    conn.send({"landed_mib": seen, "last_change": last_change})
    t.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--release-after-ms", type=float, default=5.0)
    ap.add_argument("--out")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(theirs, args.mib))
    proc.start()
    meta, remote_addr = mine.recv()
    src = np.full(args.mib * MIB, 7, np.uint8)
    t = NixlTransport("initiator", TransportConfig())
    t.register(np.array([[src.ctypes.data, src.nbytes, 0]], np.uint64), "DRAM")
    peer = t.add_peer(meta)
    offs = np.arange(args.mib, dtype=np.uint64) * MIB
    local = np.stack([src.ctypes.data + offs, np.full(args.mib, MIB, np.uint64), np.zeros(args.mib, np.uint64)], 1)
    remote = np.stack([remote_addr + offs, np.full(args.mib, MIB, np.uint64), np.zeros(args.mib, np.uint64)], 1)
    for _ in range(200):  # the peer's metadata may take a moment to be usable
        try:
            handle = t.post("WRITE", peer, local, remote, "DRAM", "DRAM", b"")
            break
        except Exception:
            time.sleep(0.01)
    t_post = time.monotonic()
    mine.send("posted")
    while time.monotonic() - t_post < args.release_after_ms / 1000:
        state = t.state(handle)
        if state != "PROC":
            break
    state_at_release = t.state(handle)
    released = t.release(handle)
    t_release = time.monotonic()
    mine.send(t_release)
    got = mine.recv()
    proc.join()
    result = {"mib": args.mib, "release_after_ms": args.release_after_ms, "state_at_release": state_at_release,
              "released": released, "landed_mib": got["landed_mib"],
              "last_byte_after_release_ms": round((got["last_change"] - t_release) * 1000, 2),
              "post_to_release_ms": round((t_release - t_post) * 1000, 2)}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    t.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
