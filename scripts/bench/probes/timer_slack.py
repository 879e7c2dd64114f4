"""How long a short `threading.Event.wait` really sleeps, with the kernel's default timer slack and with the worker's
1 us (`set_timer_slack`, what each endpoint's worker thread sets at start): the reason for `timer_slack_s`.

    python3 -m scripts.bench.probes.timer_slack --out docs/benchmarks/timer-slack-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from kvpush_common.endpoint.base import set_timer_slack
from scripts.bench import rerun_command


def waits_us(timeout_s: float, n: int) -> dict:
    ev, took = threading.Event(), []
    for _ in range(n):
        t = time.perf_counter()
        ev.wait(timeout_s)
        took.append((time.perf_counter() - t) * 1e6)
    return {"p50_us": round(statistics.median(took), 1), "p90_us": round(statistics.quantiles(took, n=10)[-1], 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--timeouts-ms", default="0.05,0.2")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--out", default="timer-slack-cpu.json")
    args = ap.parse_args()
    rows = []
    for slack_ns in (0, 1000):  # 0: the thread's default (50 us unless changed)
        if not set_timer_slack(slack_ns):
            raise SystemExit("prctl(PR_SET_TIMERSLACK) is not available here")
        for ms in [float(x) for x in args.timeouts_ms.split(",")]:
            rows.append({"slack": "default" if slack_ns == 0 else f"{slack_ns} ns", "wait_ms": ms, **waits_us(ms / 1e3, args.n)})
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"command": rerun_command(__spec__, sys.argv[1:]), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
