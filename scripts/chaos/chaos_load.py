"""Load under faults: the vLLM CPU pair (prefill P, decode D with kv_load_failure_policy=recompute)
behind the kvpush router, a steady stream of streamed requests for --duration seconds, and a seeded
schedule of faults on the prefill: short pauses, pauses longer than the decode's bound (the decode
recomputes), SIGKILL + restart, and clients that hang up mid-request (the decode leg is aborted).

Reports requests served (exact vs a single instance), served wrong (must be 0), failed, recomputed
(the decode's failed KV receives), p50/p99 TTFT, and resident memory of P and D at start and end.

    .venv/bin/python scripts/chaos/chaos_load.py --duration 240 --seed 1 --out runs/chaos/load.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from kvpush_common.testing.vllm_chaos import GEN, TIMEOUTS, Pair, env_with_events, rss_mib  # noqa: E402
from kvpush_common.testing.vllm_cluster import prompts  # noqa: E402
from kvpush_common.testing.vllm_cluster import scratch_dir, sse_chunks  # noqa: E402

BOUND_S = TIMEOUTS["transfer_timeout_s"] + TIMEOUTS["reg_ttl_s"] + TIMEOUTS["write_timeout_s"] + 5


def pct(values, q):
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=240)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--fault-every", type=float, default=25.0)
    ap.add_argument("--restarts", type=int, default=1, help="how many SIGKILL + restart of the prefill")
    ap.add_argument("--out", default=str(ROOT / "runs" / "chaos" / "load.json"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = scratch_dir("kvpush-chaos-load-")
    pair = Pair(work, env=env_with_events(work))
    say = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", flush=True)  # noqa: E731
    try:
        say(f"starting the pair (logs in {work})")
        pair.start()
        ps = prompts()
        refs = {p: pair.reference(p) for p in ps}
        for p in ps:  # warm
            list(sse_chunks(pair.router.url + "/v1/completions", {**GEN, "prompt": p}, timeout=120))
        m0 = pair.d_metrics_now()
        rss0 = {"P": rss_mib(pair.P), "D": rss_mib(pair.D), "router": rss_mib(pair.router)}
        say(f"warm; RSS MiB {rss0}")
        records: list[dict] = []
        lock = threading.Lock()
        stop = threading.Event()

        def client(cid: int) -> None:
            crng = random.Random(args.seed * 100 + cid)
            while not stop.is_set():
                p = crng.choice(ps)
                hang_up = crng.random() < 0.05
                rec = {"t": time.monotonic(), "prompt": len(p), "hang_up": hang_up}
                t0 = time.monotonic()
                try:
                    text, first = "", None
                    for chunk in sse_chunks(pair.router.url + "/v1/completions", {**GEN, "prompt": p},
                                            timeout=0.3 if hang_up else 120):
                        if first is None:
                            first = time.monotonic() - t0
                        text += chunk["choices"][0].get("text") or ""
                    rec.update(status="ok" if text == refs[p] else "wrong", ttft=first, e2e=time.monotonic() - t0)
                except Exception as e:  # noqa: BLE001 - an HTTP error, a timeout or a hang-up
                    rec.update(status="hung_up" if hang_up else "failed", error=repr(e)[:200],
                               e2e=time.monotonic() - t0)
                with lock:
                    records.append(rec)
                time.sleep(crng.uniform(0.05, 0.3) + (1.0 if rec["status"] == "failed" else 0.0))  # back off

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        faults: list[dict] = []
        t_end = time.monotonic() + args.duration
        last_fault_by = t_end - 45  # no fault in the last 45 s: the pair must be seen serving again
        restarts_left = args.restarts
        cycle = ["pause_short", "pause_long", "kill_restart"][: 3 if args.restarts else 2]
        rng.shuffle(cycle)  # every kind once, in a seeded order, then seeded picks
        next_fault = time.monotonic() + args.fault_every / 2
        while time.monotonic() < t_end:
            time.sleep(0.5)
            if time.monotonic() < next_fault or time.monotonic() > last_fault_by:
                continue
            kinds = ["pause_short", "pause_long"] + (["kill_restart"] if restarts_left else [])
            kind = cycle.pop(0) if cycle else rng.choice(kinds)
            f = {"kind": kind, "t": time.monotonic()}
            say(f"fault: {kind}")
            if kind == "pause_short":
                pair.pause_prefill()
                time.sleep(rng.uniform(1.0, 3.0))
                pair.resume_prefill()
            elif kind == "pause_long":
                pair.pause_prefill()
                time.sleep(BOUND_S + 2)
                pair.resume_prefill()
            else:
                restarts_left -= 1
                pair.restart_prefill()
            f["took_s"] = round(time.monotonic() - f["t"], 1)
            faults.append(f)
            next_fault = time.monotonic() + args.fault_every
        stop.set()
        for t in threads:
            t.join(timeout=180)
        time.sleep(BOUND_S + 2)  # anything still in flight on D ends within its bound
        m1 = pair.d_metrics_now()
        rss1 = {"P": rss_mib(pair.P), "D": rss_mib(pair.D), "router": rss_mib(pair.router)}
        after_restart = None
        restarts = [f for f in faults if f["kind"] == "kill_restart"]
        if restarts:
            t_back = restarts[-1]["t"] + restarts[-1]["took_s"]
            later = [r for r in records if r["t"] >= t_back]
            oks = [r["t"] - t_back for r in later if r["status"] == "ok"]
            after_restart = {"requests": len(later), "ok": len(oks),
                             "failed": sum(r["status"] == "failed" for r in later),
                             "first_ok_after_s": round(min(oks), 2) if oks else None}
        ttfts = [r["ttft"] for r in records if r["status"] == "ok" and r.get("ttft") is not None]
        served = sum(r["status"] == "ok" for r in records)
        wrong = sum(r["status"] == "wrong" for r in records)
        failed = sum(r["status"] == "failed" for r in records)
        recomputed = m1.get("kvpush_requests_failed_total", 0) - m0.get("kvpush_requests_failed_total", 0)
        received = m1.get("kvpush_requests_received_total", 0) - m0.get("kvpush_requests_received_total", 0)
        summary = {
            "duration_s": args.duration, "seed": args.seed, "clients": args.clients,
            "requests": len(records), "served_exact": served, "served_wrong": wrong, "failed": failed,
            "client_hang_ups": sum(r["status"] == "hung_up" for r in records),
            "decode_kv_received": received, "decode_kv_failed_recomputed": recomputed,
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1) if ttfts else None,
            "ttft_p99_ms": round(1000 * pct(ttfts, 99), 1) if ttfts else None,
            "rss_mib_start": {k: round(v, 1) for k, v in rss0.items()},
            "rss_mib_end": {k: round(v, 1) for k, v in rss1.items()},
            "faults": faults, "prefill_restarts": pair.restarts,
            "failed_examples": [r.get("error") for r in records if r["status"] == "failed"][:5],
            "after_restart": after_restart,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"summary": summary, "records": records}, indent=1))
        print(json.dumps(summary, indent=1))
        return 0 if wrong == 0 else 1
    finally:
        pair.stop()


if __name__ == "__main__":
    sys.exit(main())
