"""Multi-turn chat in real CUDA vLLM on the GPU machine: the GPU twin of scripts/bench/cpu/multiturn.py.

    push-reuse    kvpush push; the decode's local_prefill_max_tokens 256 and the router's
                  --skip-prefill-max-tokens 256 (a follow-up whose history the decode holds goes to it alone)
    push-noreuse  kvpush push; both 0: every turn has both legs and its uncached tail is pushed
    nixl-push     vLLM's own NixlPushConnector
    single        one vLLM instance with prefix caching (the reference), behind `kvpush router --mode single`

Each disaggregated mode is a P + D pair behind `kvpush router`; with one GPU every instance shares GPU 0
(fixed --kv-cache-memory-bytes, as scripts/bench/gpu/vllm_gpu.py, whose process and client helpers this
imports).  Workload (token-id prompts, the same for every mode): N conversations x T turns; turn 1 is a
unique random --first-tokens prompt; each later turn is the previous prompt + the previous answer's token
ids + --new-tokens random ids.  Answers: --answer-tokens tokens, greedy, ignore_eos.  The prompts are fixed
beforehand from a single instance answering each turn alone (token ids from the completions API's
`return_token_ids`), and each mode's answer is compared with that one, token id for token id.  The single
mode runs on the same instance after /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1), or on a fresh one if
that fails.  Conversations start --stagger-s apart; within one, turn n+1 is sent when turn n's answer is in.
TTFT and TPOT are client side, streaming.  Modes run one after another (a mode's servers stop first).

    python3 -m scripts.bench.e2e --device cuda --workload multiturn --eager --out /tmp/mt/out --workdir /tmp/mt

A device call runs at most 10 minutes: start it detached from /tmp/kvpush (gpu_vllm_env.sh copies the tree
there), `(setsid nohup python3 ... > /tmp/mt/bench.log 2>&1 &)`, and collect /tmp/mt/out in later calls.
Writes OUT/NAME.json (per request, per mode, router timelines, summary) and OUT/NAME.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.request
from pathlib import Path

from scripts.bench import rerun_command
from scripts.bench.gpu.vllm_gpu import (ROOT, SHAPES, VOCAB, Cluster, Proc, get, kv_config, make_model, quantile,
                                        scrape, stream_one, wait_healthy)

MODES = ("single", "push-reuse", "push-noreuse", "nixl-push")


# ---- client ---------------------------------------------------------------------------------------

def post_json(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def answer_ids_logprobs(url: str, prompt: list[int], max_tokens: int, limit_s: float) -> list[int]:
    """Fallback when return_token_ids gives nothing: logprobs with return_tokens_as_token_ids ('token_id:N')."""
    out = post_json(url + "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                                              "temperature": 0.0, "ignore_eos": True, "logprobs": 1,
                                              "return_tokens_as_token_ids": True}, limit_s)
    return [int(t.split(":", 1)[1]) for t in out["choices"][0]["logprobs"]["tokens"]]


def build_conversations(url: str, args) -> tuple[list[list[dict]], str]:
    """[{prompt, ids, text}] per turn, per conversation: the single instance answering each turn alone."""
    rng = random.Random(f"multiturn/{args.seed}")
    convs, how = [], "return_token_ids"
    for _ in range(args.conversations):
        prompt, conv = [rng.randrange(16, VOCAB) for _ in range(args.first_tokens)], []
        for _ in range(args.turns):
            r = stream_one(url, prompt, args.answer_tokens, args.limit_s, token_ids=True)
            if r["outcome"] != "ok":
                raise RuntimeError(f"reference request failed: {r['outcome']}")
            ids = r["ids"]
            if not ids:
                ids, how = answer_ids_logprobs(url, prompt, args.answer_tokens, args.limit_s), "logprobs"
            conv.append({"prompt": prompt, "ids": ids, "text": r["text"]})
            prompt = prompt + ids + [rng.randrange(16, VOCAB) for _ in range(args.new_tokens)]
        convs.append(conv)
    return convs, how


# ---- servers --------------------------------------------------------------------------------------

def pair(cluster: Cluster, mode: str) -> tuple[Proc, Proc]:
    """P and D of a mode (as Cluster.pair, but local_prefill_max_tokens goes to the decode only)."""
    base = "nixl-push" if mode == "nixl-push" else "push"
    side, metrics = cluster.ports(4), cluster.ports(4)
    nixl = lambda port: {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}  # noqa: E731
    extra = json.loads(cluster.args.kvpush_extra)
    d_extra = {**extra, "local_prefill_max_tokens": 256 if mode == "push-reuse" else 0}
    p = cluster.server(f"{mode}-P", 0, kv_config(base, "kv_producer", side, metrics, cluster.gpus, extra), nixl(side))
    d = cluster.server(f"{mode}-D", 0, kv_config(base, "kv_consumer", side + 2, metrics + 2, cluster.gpus, d_extra),
                       nixl(side + 2))
    p.metrics_url = f"http://127.0.0.1:{metrics}/metrics" if base == "push" else None
    d.metrics_url = f"http://127.0.0.1:{metrics + 2}/metrics" if base == "push" else None
    return p, d


def router(cluster: Cluster, mode: str, prefill: Proc | None, decode: Proc) -> Proc:
    """`kvpush router` with the mode's extra arguments (Cluster.router passes none)."""
    port = cluster.ports(1)
    rmode = {"push-reuse": "push", "push-noreuse": "push"}.get(mode, mode)
    argv = [sys.executable, "-m", "kvpush_common.ops.cli", "router", "--port", str(port), "--mode", rmode,
            "--decode", decode.url, "--request-timeout", str(cluster.args.limit_s), "--log-level", "WARNING"]
    if prefill is not None:
        argv += ["--prefill", prefill.url]
    if mode.startswith("push"):  # the router's default is 0 (never skips): reuse asks for it
        argv += ["--skip-prefill-max-tokens", "256" if mode == "push-reuse" else "0"]
    p = Proc(f"router-{mode}", argv, {"PYTHONUNBUFFERED": "1"}, cluster.logdir, port)
    cluster.procs.append(p)
    return p


# ---- one mode -------------------------------------------------------------------------------------

def converse_all(url: str, convs: list, args) -> list[dict]:
    rows: list[list[dict]] = [[] for _ in convs]

    def converse(i: int) -> None:
        time.sleep(i * args.stagger_s)
        for t, turn in enumerate(convs[i]):
            r = stream_one(url, turn["prompt"], args.answer_tokens, args.limit_s, token_ids=True)
            exact = r["outcome"] == "ok" and (r["ids"] == turn["ids"] if r["ids"] is not None else r["text"] == turn["text"])
            rows[i].append({"conv": i, "turn": t + 1, "prompt_tokens": len(turn["prompt"]), "outcome": r["outcome"],
                            "exact": exact, "compared": "token_ids" if r["ids"] is not None else "text",
                            "ttft_s": r["ttft_s"], "tpot_s": r["tpot_s"], "e2e_s": r["e2e_s"]})

    t0 = time.monotonic()
    threads = [threading.Thread(target=converse, args=(i,)) for i in range(len(convs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    print(f"[mt] {len(convs)} conversations in {time.monotonic() - t0:.1f} s", flush=True)
    return [x for conv in rows for x in conv]


def mode_stats(mode: str, flat: list[dict], timelines: list[dict], declined: float | None) -> dict:
    ok = [x for x in flat if x["outcome"] == "ok"]
    ms = lambda v: None if v is None else round(v * 1e3, 1)  # noqa: E731
    first = [x["ttft_s"] for x in ok if x["turn"] == 1 and x["ttft_s"] is not None]
    later = [x["ttft_s"] for x in ok if x["turn"] >= 2 and x["ttft_s"] is not None]
    tpot = [x["tpot_s"] for x in ok if x["tpot_s"] is not None]
    return {"mode": mode, "requests": len(flat), "requests_turn2plus": sum(x["turn"] >= 2 for x in flat),
            "ok": len(ok), "failed": sum(x["outcome"] == "failed" for x in flat),
            "hung": sum(x["outcome"] == "hung" for x in flat), "exact": sum(x["exact"] for x in flat),
            "ttft_p50_turn1_ms": ms(quantile(first, 0.5)),
            "ttft_p50_turn2plus_ms": ms(quantile(later, 0.5)), "ttft_p90_turn2plus_ms": ms(quantile(later, 0.9)),
            "tpot_p50_ms": ms(quantile(tpot, 0.5)), "tpot_p90_ms": ms(quantile(tpot, 0.9)),
            "prefill_legs_skipped": sum("prefill_skipped" in t for t in timelines),
            "prefill_legs_cancelled": sum("prefill_cancelled" in t for t in timelines),
            "decode_declined": declined, "router_timelines": len(timelines)}


def run_mode(cluster: Cluster, mode: str, convs: list, args, single: Proc | None, warm: list[int]) -> dict:
    procs: list[Proc] = []
    try:
        if mode == "single":
            procs = [router(cluster, mode, None, single)]
            wait_healthy(procs, 300)
            p = d = None
        else:
            p, d = pair(cluster, mode)
            procs = [p, d]
            wait_healthy(procs, args.startup_s)
            procs.append(router(cluster, mode, p, d))
            wait_healthy(procs[-1:], 300)
        url = procs[-1].url
        w = stream_one(url, warm, 4, args.limit_s, token_ids=True)  # warm-up (NIXL handshakes), not a conversation's prefix
        print(f"[mt] {mode} warm-up {w['outcome']} ttft {w['ttft_s']}", flush=True)
        t_start = time.time()
        flat = converse_all(url, convs, args)
        code, tl = get(url + "/timelines", timeout=10)
        timelines = [t for t in (json.loads(tl) if code == 200 else [])
                     if not t.get("arrival_unix") or t["arrival_unix"] >= t_start]
        declined = None
        metrics = {}
        if d is not None and getattr(d, "metrics_url", None):
            metrics = {"P": scrape(p.metrics_url), "D": scrape(d.metrics_url)}
            declined = sum(v for k, v in metrics["D"].items() if k.startswith("kvpush_requests_declined_total"))
        stats = mode_stats(mode, flat, timelines, declined)
        print(f"[mt] {mode}: {json.dumps(stats)}", flush=True)
        return {**stats, "per_request": flat, "timelines": timelines, "metrics": metrics}
    finally:
        cluster.stop(procs)


# ---- report ---------------------------------------------------------------------------------------

def summary(rows: dict) -> dict:
    def ratio(a: str, b: str, key: str = "ttft_p50_turn2plus_ms") -> float | None:
        x, y = rows.get(a, {}).get(key), rows.get(b, {}).get(key)
        return round(x / y, 3) if x and y else None

    reuse = rows.get("push-reuse", {})
    later = reuse.get("requests_turn2plus", 0)
    total = sum(r["requests"] for r in rows.values())
    return {
        "ttft_p50_turn2plus_over_single": ratio("push-reuse", "single"),
        "ttft_p50_turn2plus_push_over_nixl_push": ratio("push-reuse", "nixl-push"),
        "ttft_p50_turn2plus_noreuse_over_reuse": ratio("push-noreuse", "push-reuse"),
        "tpot_p50_push_reuse_over_single": ratio("push-reuse", "single", "tpot_p50_ms"),
        "prefill_legs_skipped_fraction": round(reuse["prefill_legs_skipped"] / later, 3) if later else None,
        "prefill_legs_cancelled_fraction": round(reuse["prefill_legs_cancelled"] / later, 3) if later else None,
        "exact_fraction": round(sum(r["exact"] for r in rows.values()) / total, 4) if total else None,
        "exact_by_mode": {m: f"{r['exact']}/{r['requests']}" for m, r in rows.items()},
    }


def table(result: dict) -> str:
    lines = ["| mode | ok | exact | TTFT p50 turn 1 ms | TTFT p50 turns >= 2 ms | TTFT p90 turns >= 2 ms | "
             "TPOT p50 ms | prefill legs skipped | prefill legs cancelled | declined by D |", "|" + "---|" * 10]
    for r in result["rows"]:
        lines.append(f"| {r['mode']} | {r['ok']}/{r['requests']} | {r['exact']} | {r['ttft_p50_turn1_ms']} | "
                     f"{r['ttft_p50_turn2plus_ms']} | {r['ttft_p90_turn2plus_ms']} | {r['tpot_p50_ms']} | "
                     f"{r['prefill_legs_skipped']} | {r['prefill_legs_cancelled']} | "
                     f"{'' if r['decode_declined'] is None else int(r['decode_declined'])} |")
    return "\n".join(lines) + "\n"


def write(result: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = {r["mode"]: r for r in result["rows"]}
    result["summary"] = summary(rows)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    m = result["meta"]
    text = (f"# Multi-turn chat, {m['kind']}\n\nCommand: `{m['command']}`\n\n"
            f"{m['conversations']} conversations x {m['turns']} turns, stagger {m['stagger_s']} s; turn 1 "
            f"{m['first_tokens']} random token ids, each later turn + previous answer + {m['new_tokens']} new ids "
            f"(prompts {m.get('prompt_tokens', ['?', '?'])[0]}..{m.get('prompt_tokens', ['?', '?'])[1]} tokens); answers {m['answer_tokens']} tokens, "
            f"greedy, ignore_eos; shape {m['shape']}, dummy weights, bf16; "
            f"{'--enforce-eager' if m['eager'] else 'torch.compile + CUDA graphs'}; answers compared by "
            f"{m.get('reference_ids_from')} token ids with the single instance answering each turn alone.\n\n"
            + table(result) + "\nSummary: `" + json.dumps(result["summary"]) + "`\n")
    if result.get("errors"):
        text += "\n## Errors\n\n" + "\n".join(f"- {e[:600]}" for e in result["errors"]) + "\n"
    (out / f"{name}.md").write_text(text)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-tokens", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--stagger-s", type=float, default=1.0)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--eager", action="store_true", help="--enforce-eager (default: torch.compile + CUDA graphs)")
    ap.add_argument("--kv-cache-gib", type=float, default=16.0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.12)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--limit-s", type=float, default=120.0)
    ap.add_argument("--startup-s", type=float, default=600.0)
    ap.add_argument("--kvpush-extra", default="{}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-port", type=int, default=21000)
    ap.add_argument("--workdir", default="/tmp/kvpush-mt")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--name", default="multiturn-h200")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if bad := set(modes) - set(MODES):
        ap.error(f"unknown modes {sorted(bad)}")
    work, out = Path(args.workdir), Path(args.out)
    logdir = work / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    model = make_model(work / f"model-{args.shape}", args.shape)
    try:
        import torch

        gpus, device = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    except Exception:
        gpus, device = 0, "CPU"
    from importlib.metadata import version

    try:
        vllm_version = version("vllm")
    except Exception:
        vllm_version = None
    cluster = Cluster(args, model, logdir, gpus)
    result = {"meta": {"command": rerun_command(__spec__, sys.argv[1:] if argv is None else argv, prog),
                       "kind": f"real CUDA vLLM {vllm_version} on one H200 (all instances share GPU 0)"
                       if gpus == 1 else f"real vLLM {vllm_version} on {device} x{gpus} (all instances on GPU 0)",
                       "vllm_version": vllm_version, "device": device, "gpus": gpus, "shape": args.shape,
                       "eager": args.eager, "conversations": args.conversations, "turns": args.turns,
                       "first_tokens": args.first_tokens, "new_tokens": args.new_tokens,
                       "answer_tokens": args.answer_tokens, "stagger_s": args.stagger_s,
                       "kv_cache_gib": args.kv_cache_gib, "seed": args.seed, "modes": modes,
                       "started": time.strftime("%Y-%m-%d %H:%M:%S")},
              "rows": [], "errors": []}
    single = cluster.server("single", 0, env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        try:
            wait_healthy([single], args.startup_s)
            t0 = time.monotonic()
            convs, how = build_conversations(single.url, args)
        except Exception as e:  # noqa: BLE001
            result["errors"].append(f"references: {e}"[:20000])
            raise
        lengths = [len(t["prompt"]) for c in convs for t in c]
        result["meta"].update(reference_ids_from=how, prompt_tokens=[min(lengths), max(lengths)],
                              reference_s=round(time.monotonic() - t0, 1))
        print(f"[mt] references: {len(lengths)} answers in {time.monotonic() - t0:.0f} s via {how}", flush=True)
        warm = [random.Random("warm").randrange(16, VOCAB) for _ in range(64)]
        for mode in modes:
            try:
                if mode == "single" and (single is None or single not in cluster.procs):
                    single = cluster.server(f"single-{mode}", 0)  # stopped by an earlier mode: a fresh one
                    wait_healthy([single], args.startup_s)
                    result["meta"]["single_prefix_cache_reset"] = "fresh instance"
                elif mode == "single":
                    code = 0
                    try:
                        req = urllib.request.Request(single.url + "/reset_prefix_cache", data=b"", method="POST")
                        with urllib.request.urlopen(req, timeout=30) as r:
                            code = r.status
                    except Exception as e:  # noqa: BLE001
                        print(f"[mt] reset_prefix_cache: {e}", flush=True)
                    result["meta"]["single_prefix_cache_reset"] = code == 200
                    if code != 200:  # a fresh instance, so turn 1 is not served from the references' cache
                        cluster.stop([single])
                        single = cluster.server("single-fresh", 0)
                        wait_healthy([single], args.startup_s)
                elif single is not None and single in cluster.procs:
                    cluster.stop([single])  # modes run alone on the GPU
                    single = None
                result["rows"].append(run_mode(cluster, mode, convs, args, single, warm))
            except Exception as e:  # noqa: BLE001 - one mode failing must not lose the others' results
                msg = f"{mode}: {e}"
                print(f"[mt] FAILED {msg[:4000]}", flush=True)
                result["errors"].append(msg[:20000])
            write(result, out, args.name)
    finally:
        cluster.stop(list(cluster.procs))
        result["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        write(result, out, args.name)
    print(table(result) + "\n" + json.dumps(result["summary"]), flush=True)
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
