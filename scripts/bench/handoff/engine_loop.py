"""Push vs pull in vLLM-shaped engine loops: a prefill engine on GPU 0, a decode engine on GPU 1.

For every mode (push, kvpush-pull, vllm-pull) and block size, fresh engine processes serve the
same seeded Poisson arrivals over input lengths x rates, 128 output tokens each; the driver plays the
router (push: both legs at arrival; pull: decode leg after the prefill finished, with the prefill's
block ids for vllm-pull).  Per point: TTFT and TPOT p50/p99, the per-request timeline, the exposed
handoff (prefill KV ready -> decode KV usable) next to the raw peer copy of the same bytes measured
in this run, descriptors per transfer, and the decode engine thread's time inside connector hooks
per step.  Warm-up requests (sequential, fresh pools: consecutive blocks) are excluded from the
points and give the contiguous NIXL WRITE time of each size.

    python3 -m scripts.bench.handoff.engine_loop --out docs/benchmarks/h200.json          # two GPUs
    python3 -m scripts.bench.handoff.engine_loop --cpu --lengths 256,512 --rates 2,4 ...  # CPU smoke run
    python3 -m scripts.bench.handoff.engine_loop --p-tp 2 --d-tp 1 --modes push,kvpush-pull ...  # 3+ GPUs

Several ranks per engine (--p-tp / --d-tp): a process per rank in lockstep (engines.py), one GPU
each when there are enough, the model's KV heads split across each side's ranks (a producer rank
writes its heads into every consumer rank that holds them).  vLLM-style pull runs one rank each.

Rates: nominal 1/2/4/8 QPS are scaled per input length so that the top rate loads the single
prefill engine to `--max-util` of its capacity (rate x prefill time); lengths whose prefill is fast
enough run at the nominal rates.  The scale is recorded per point.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from multiprocessing.connection import wait as wait_conns
from pathlib import Path

import msgspec
import numpy as np

from kvpush_common.endpoint.events import read_events
from scripts.bench.handoff import engines
from scripts.bench.handoff.handoff_modes import MODES, MULTI_RANK_MODES
from scripts.bench.handoff.kvslab import QWEN3_32B_RANK, peer_copy_ms
from scripts.bench.handoff.workmodel import StepCost

_enc, _dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


class Engine:
    """Rank 0 of an engine (the driver's pipe) and its other ranks (pipes to rank 0 only)."""

    def __init__(self, ctx, target, opts: dict, tp: int = 1):
        self.conn, child = ctx.Pipe()
        self._ctx = ctx
        pipes = [ctx.Pipe() for _ in range(tp - 1)]
        self._follower_ends = [b for _, b in pipes]
        self.proc = ctx.Process(target=target, args=(child, opts, [a for a, _ in pipes]), daemon=True)
        self.proc.start()
        for end in [child, *(a for a, _ in pipes)]:  # the children hold them: a rank that dies is an EOF
            end.close()
        self.followers: list = []

    def start_followers(self, target, opts_for_rank) -> None:
        """Ranks 1.. (after rank 0 has told what they need, e.g. its port)."""
        for r, end in enumerate(self._follower_ends, start=1):
            proc = self._ctx.Process(target=target, args=(end, opts_for_rank(r)), daemon=True)
            proc.start()
            end.close()
            self.followers.append(proc)

    def send(self, **msg) -> None:
        self.conn.send_bytes(_enc.encode(msg))

    def recv(self, timeout: float) -> dict:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"engine {self.proc.name} silent for {timeout} s (alive={self.proc.is_alive()})")
        return _dec.decode(self.conn.recv_bytes())

    def stop(self) -> None:
        try:
            self.send(op="stop")
        except (OSError, BrokenPipeError):
            pass
        for proc in [self.proc, *self.followers]:  # rank 0 stops its followers
            proc.join(30)
            if proc.is_alive():
                proc.kill()


class Pair:
    """One prefill and one decode engine in `mode` (each of args.p_tp / args.d_tp ranks), handshaken."""

    def __init__(self, mode: str, args, block_size: int, event_dir: Path):
        ctx = mp.get_context("spawn")
        base = dict(mode=mode, block_size=block_size, poll_s=args.poll_ms / 1e3, event_dir=str(event_dir),
                    geometry=args.geometry, cpu_time_scale=args.cpu_time_scale, verify=args.verify)
        bb = block_bytes(args.geometry, block_size, heads=args.heads_per_rank)
        nblocks = int(args.pool_gib * (1 << 30) // bb)
        self.mode = mode
        multi = args.p_tp > 1 or args.d_tp > 1

        def opts(role: str, rank: int, **extra) -> dict:
            tp, devices = (args.p_tp, args.p_devices) if role == "P" else (args.d_tp, args.d_devices)
            ranks = dict(rank=rank, tp_size=tp, total_kv_heads=args.total_heads, **extra) if multi else None
            return dict(base, device=devices[rank], num_blocks=nblocks, ranks=ranks)

        self.p = Engine(ctx, engines.prefill_main, opts("P", 0), args.p_tp)
        self.d = Engine(ctx, engines.decode_main, opts("D", 0), args.d_tp)
        self.d.start_followers(engines.decode_follower_main, lambda r: opts("D", r))
        hello = self.p.recv(600)
        assert hello["ev"] == "hello", hello
        self.p.start_followers(engines.prefill_follower_main, lambda r: opts("P", r, base_port=hello["port"]))
        ready = self.p.recv(600)
        assert ready["ev"] == "ready", ready
        alive = self.d.recv(600)
        self.unit_ms = {"prefill": hello.pop("unit_ms"), "decode": alive["unit_ms"]}
        hello.pop("ev")
        self.d.send(op="hello", **hello)
        ready = self.d.recv(600)
        assert ready["ev"] == "ready", ready

    def stop(self) -> None:
        self.p.stop()
        self.d.stop()


def block_bytes(geometry: dict, block_size: int, heads: int | None = None) -> int:
    """Bytes of one block of one rank (`heads`: the rank's KV heads, default the geometry's)."""
    g = {**QWEN3_32B_RANK, **geometry}
    return g["num_layers"] * 2 * block_size * (heads or g["num_heads"]) * g["head_dim"] * g["dtype_size"]


def run_requests(pair: Pair, reqs: list[dict], out_tokens: int, timeout: float) -> dict[str, dict]:
    """Dispatch `reqs` (each with an absolute `t_arrival`) like the router, until every one ended."""
    recs = {r["tid"]: dict(r) for r in reqs}
    pending = sorted(reqs, key=lambda r: r["t_arrival"])
    ended, deadline = 0, time.time() + timeout
    while ended < len(reqs):
        now = time.time()
        if now > deadline:
            raise TimeoutError(f"{pair.mode}: {len(reqs) - ended} requests did not end within {timeout} s")
        while pending and pending[0]["t_arrival"] <= now:
            r = pending.pop(0)
            pair.p.send(op="prefill", tid=r["tid"], seq=r["seq"], tokens=r["tokens"])
            if pair.mode.startswith("push"):
                recs[r["tid"]]["t_dispatch_decode"] = time.time()
                pair.d.send(op="decode", tid=r["tid"], seq=r["seq"], tokens=r["tokens"], out_tokens=out_tokens)
        wait_s = min(0.05, max(0.0, pending[0]["t_arrival"] - time.time())) if pending else 0.05
        for conn in wait_conns([pair.p.conn, pair.d.conn], wait_s):
            while conn.poll():
                m = _dec.decode(conn.recv_bytes())
                rec = recs[m["tid"]]
                if m["ev"] == "prefilled":
                    rec.update(t_prefill_start=m["t_prefill_start"], t_prefill_done=m["t_prefill_done"])
                    if not pair.mode.startswith("push"):  # the router relays the finished prefill to the decode
                        rec["t_dispatch_decode"] = time.time()
                        pair.d.send(op="decode", tid=m["tid"], seq=rec["seq"], tokens=rec["tokens"],
                                    out_tokens=out_tokens, remote_blocks=m["blocks"])
                elif m["ev"] == "finished":
                    rec.update({k: v for k, v in m.items() if k not in ("ev", "tid")})
                    ended += 1
    return recs


def step_stats(pair: Pair) -> dict:
    pair.d.send(op="stats")
    while True:
        m = pair.d.recv(60)
        if m["ev"] == "stats":
            return m


def add_event_times(recs: dict[str, dict], event_dir: Path) -> None:
    """Protocol times from the endpoints' event logs (wall clock, one host)."""
    for e in read_events(event_dir):
        rec = recs.get(e["tid"])
        if rec is None:
            continue
        if e["ev"] in ("kv_ready", "registered", "received", "write_done", "granted", "read_done") and e["ev"] not in rec:
            rec["ev_" + e["ev"]] = e["t"]
        elif e["ev"] in ("posted", "read_posted"):
            rec["ev_posted"], rec["descs"] = e["t"], e.get("descs")


def usable_time(rec: dict) -> float | None:
    return rec.get("ev_received") or rec.get("t_usable_seen")


def summarize(recs: list[dict], out_tokens: int) -> dict:
    ok = [r for r in recs if r.get("ok")]
    ttft = [(r["t_first"] - r["t_arrival"]) * 1e3 for r in ok]
    tpot = [(r["t_last"] - r["t_first"]) * 1e3 / (out_tokens - 1) for r in ok]
    hand = [(usable_time(r) - r["t_prefill_done"]) * 1e3 for r in ok if usable_time(r)]
    queue = [(r["t_prefill_start"] - r["t_arrival"]) * 1e3 for r in ok]
    gen_delay = [(r["t_gen_start"] - usable_time(r)) * 1e3 for r in ok if usable_time(r)]
    post = [(r["ev_posted"] - r["t_prefill_done"]) * 1e3 for r in ok if "ev_posted" in r]
    descs = [r["descs"] for r in ok if r.get("descs") is not None]
    return {
        "n": len(recs), "failed": len(recs) - len(ok),
        "wrong_bytes": int(sum(max(0, r.get("wrong_bytes", 0)) for r in ok)),
        "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
        "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99),
        "handoff_ms_p50": pct(hand, 50), "handoff_ms_p99": pct(hand, 99),
        "prefill_queue_ms_p50": pct(queue, 50), "gen_start_delay_ms_p50": pct(gen_delay, 50),
        "post_ms_p50": pct(post, 50), "descs_p50": pct(descs, 50), "descs_max": max(descs) if descs else None,
    }


def timeline(rec: dict) -> dict:
    """One request's milestones in ms from its arrival."""
    t0 = rec["t_arrival"]
    keys = {"decode_registered": rec.get("ev_registered") or rec.get("t_started"),
            "prefill_start": rec.get("t_prefill_start"), "prefill_done": rec.get("t_prefill_done"),
            "decode_dispatched": rec.get("t_dispatch_decode"), "handoff_posted": rec.get("ev_posted"),
            "kv_usable": usable_time(rec), "generation_start": rec.get("t_gen_start"),
            "first_token": rec.get("t_first"), "last_token": rec.get("t_last")}
    return {k: round((v - t0) * 1e3, 3) for k, v in keys.items() if v}


def run_mode(mode: str, block_size: int, args, cost: StepCost, seq: list[int], log) -> dict:
    event_dir = Path(tempfile.mkdtemp(prefix=f"kvpush-bench-{mode}-{block_size}-"))
    pair = Pair(mode, args, block_size, event_dir)
    result = {"mode": mode, "block_size": block_size, "unit_ms": pair.unit_ms, "warmup": [], "points": []}
    try:
        warm = []
        for tokens in args.lengths:  # sequential on fresh pools: consecutive blocks on both sides
            for _ in range(args.warmup):
                seq[0] += 1
                r = dict(tid=f"w{seq[0]}", seq=seq[0], tokens=tokens, t_arrival=time.time())
                warm += list(run_requests(pair, [r], args.out_tokens, args.point_timeout).values())
        step_stats(pair)
        add_event_times({r["tid"]: r for r in warm}, event_dir)
        for r in warm:
            result["warmup"].append({"tokens": r["tokens"], "ok": r.get("ok"),
                                     "wire_ms": (r["ev_write_done"] - r["ev_posted"]) * 1e3 if "ev_write_done" in r else None,
                                     "handoff_ms": (usable_time(r) - r["t_prefill_done"]) * 1e3 if usable_time(r) else None,
                                     "descs": r.get("descs")})
        for tokens in args.lengths:
            cap = args.max_util / (cost.prefill_ms(tokens) / 1e3)
            scale = min(1.0, cap / max(args.rates))
            for i, nominal in enumerate(args.rates):
                rate = nominal * scale
                n = max(args.min_requests, round(rate * args.point_seconds))
                rng = np.random.default_rng([args.seed, tokens, i])
                gaps = rng.exponential(1.0 / rate, n)
                t0 = time.time() + 0.05
                reqs = []
                for k in range(n):
                    seq[0] += 1
                    reqs.append(dict(tid=f"{mode[0]}{block_size}-{tokens}-{nominal}-{k}", seq=seq[0], tokens=tokens,
                                     t_arrival=t0 + float(gaps[:k].sum())))
                recs = run_requests(pair, reqs, args.out_tokens, args.point_timeout)
                add_event_times(recs, event_dir)
                steps = step_stats(pair)["steps"]
                hooks = [s[0] for s in steps]
                hooks_admit = [s[0] for s in steps if s[3]]
                point = {"mode": mode, "block_size": block_size, "tokens": tokens, "rate_nominal": nominal,
                         "rate": round(rate, 4), "rate_scale": round(scale, 4),
                         "kv_bytes": tokens * block_bytes(args.geometry, 1, args.p_heads),
                         **summarize(list(recs.values()), args.out_tokens),
                         "hook_us_p50": pct(hooks, 50), "hook_us_p99": pct(hooks, 99),
                         "hook_us_max": max(hooks) if hooks else None,
                         "hook_us_p99_admitting_steps": pct(hooks_admit, 99),
                         "decode_step_ms_p50": pct([s[1] for s in steps if s[2]], 50),
                         "decode_batch_max": max((s[2] for s in steps), default=0),
                         "timelines": [timeline(r) for r in sorted(recs.values(), key=lambda r: r["t_arrival"])[:3]]}
                result["points"].append(point)
                log(f"{mode:11s} bs={block_size:<3d} {tokens:>6d} tok @{rate:6.2f} qps n={n:<3d} "
                    f"TTFT p50/p99 {point['ttft_ms_p50']:8.1f}/{point['ttft_ms_p99']:8.1f}  "
                    f"TPOT {point['tpot_ms_p50']:6.2f}/{point['tpot_ms_p99']:6.2f}  "
                    f"handoff {point['handoff_ms_p50']:7.2f}  hook p99 {point['hook_us_p99']:9.1f} us  "
                    f"failed {point['failed']} wrong {point['wrong_bytes']}")
    finally:
        pair.stop()
    return result


def summary(results: list[dict], raw: dict, args, wire_rows: list[dict] | None = None) -> dict:
    pts = [p for r in results for p in r["points"]]
    top, longest = max(args.rates), max(args.lengths)

    def at(mode, bs, tokens, nominal):
        return next((p for p in pts if (p["mode"], p["block_size"], p["tokens"], p["rate_nominal"]) ==
                     (mode, bs, tokens, nominal)), None)

    out: dict = {}
    bs0 = args.block_sizes[0]
    push, pull = at("push", bs0, longest, top), at("vllm-pull", bs0, longest, top)
    if push and pull:
        out["ttft_pull_over_push_16k_max_load"] = round(pull["ttft_ms_p50"] / push["ttft_ms_p50"], 3)
        out["ttft_p99_pull_over_push_16k_max_load"] = round(pull["ttft_ms_p99"] / push["ttft_ms_p99"], 3)
        out["tpot_push_over_pull_16k_max_load"] = round(push["tpot_ms_p50"] / pull["tpot_ms_p50"], 3)
        out["tpot_p99_push_over_pull_16k_max_load"] = round(push["tpot_ms_p99"] / pull["tpot_ms_p99"], 3)
    le, worst = True, []
    for p in pts:
        if p["mode"] != "push":
            continue
        for other in ("vllm-pull", "kvpush-pull"):
            q = at(other, p["block_size"], p["tokens"], p["rate_nominal"])
            if q is None:
                continue
            for k in ("ttft_ms_p50", "ttft_ms_p99"):
                if p[k] > q[k]:
                    le = False
                    worst.append({"vs": other, "block_size": p["block_size"], "tokens": p["tokens"],
                                  "rate_nominal": p["rate_nominal"], "metric": k, "push": p[k], "pull": q[k]})
    out["push_ttft_le_pull_everywhere"] = le
    out["push_ttft_le_vllm_pull_everywhere"] = not any(w["vs"] == "vllm-pull" for w in worst)
    over = [w["push"] / w["pull"] for w in worst if w["vs"] == "kvpush-pull"]
    out["push_ttft_over_kvpush_pull_max"] = round(max(over), 3) if over else None
    out["push_ttft_gt_pull_points"] = worst
    ratios = [p["handoff_ms_p50"] / raw[str(p["tokens"])] for p in pts
              if p["mode"] == "push" and raw.get(str(p["tokens"])) and p["handoff_ms_p50"]]
    if ratios:
        out["handoff_exposed_over_wire_p50_max"] = round(max(ratios), 3)
    goal = [p for p in pts if p["mode"] == "push" and raw.get(str(p["tokens"]))
            and p["handoff_ms_p50"] > 1.1 * raw[str(p["tokens"])] + 1.0]
    out["handoff_goal_missed_points"] = len(goal)
    hooks = [p["hook_us_p99"] for p in pts if p["mode"] == "push" and p["hook_us_p99"] is not None]
    if hooks:
        out["decode_hook_time_p99_us_push"] = round(max(hooks), 1)
    if wire_rows:  # scripts/bench/probes/nixl_wire.py, same machine: contiguous NIXL WRITE vs raw peer copy
        out["contiguous"] = wire_rows
        out["contiguous_efficiency_min"] = round(min(r["efficiency_wire"] for r in wire_rows
                                                     if r["tokens"] == longest), 3)
        big = max(r["tokens"] for r in wire_rows)
        out["contiguous_efficiency_1gib_min"] = round(min(r["efficiency_wire"] for r in wire_rows
                                                          if r["tokens"] == big), 3)
    out["notes"] = {
        "pull": "ratios use vLLM-style pull (vllm-pull) as the pull baseline; push vs kvpush-pull is in "
                "push_ttft_gt_pull_points",
        "wire": "handoff_exposed_over_wire uses the raw torch peer copy of the same bytes (meta.raw_copy_ms)",
        "contiguous": "scripts/bench/probes/nixl_wire.py: two-process NIXL UCX WRITE of a request's consecutive blocks "
                      "(one descriptor per region), transfer() to DONE, vs raw peer copy"}
    return out


def set_ranks(args) -> None:
    """Heads per rank on each side (a rank of the narrower side holds the heads of several of the other)."""
    from kvpush_common.protocol.topology import local_heads

    if args.p_tp > 1 or args.d_tp > 1:
        bad = [m for m in args.modes if m not in MULTI_RANK_MODES]
        if bad:
            raise SystemExit(f"modes {bad} run one rank per engine; with --p-tp/--d-tp use {MULTI_RANK_MODES}")
    per_rank = {**QWEN3_32B_RANK, **args.geometry}["num_heads"]
    args.total_heads = args.total_heads or per_rank * max(args.p_tp, args.d_tp)
    args.p_heads = local_heads(args.total_heads, args.p_tp, 0)[1]
    args.d_heads = local_heads(args.total_heads, args.d_tp, 0)[1]
    args.heads_per_rank = max(args.p_heads, args.d_heads)
    args.p_devices, args.d_devices = [None] * args.p_tp, [None] * args.d_tp


def place_ranks(args, gpus: int) -> dict:
    """One GPU per rank when there are enough (prefill ranks first); else prefill on GPU 0 and decode on
    GPU 1 (GPU 0 too with one GPU)."""
    if gpus >= args.p_tp + args.d_tp:
        args.p_devices = list(range(args.p_tp))
        args.d_devices = list(range(args.p_tp, args.p_tp + args.d_tp))
    elif gpus:
        args.p_devices, args.d_devices = [0] * args.p_tp, [min(1, gpus - 1)] * args.d_tp
    return {"p_tp": args.p_tp, "d_tp": args.d_tp, "total_kv_heads": args.total_heads, "p_heads_per_rank": args.p_heads,
            "d_heads_per_rank": args.d_heads, "p_devices": args.p_devices, "d_devices": args.d_devices}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--block-sizes", default="16,128")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--rates", default="1,2,4,8", help="nominal QPS (scaled per length, see --max-util)")
    ap.add_argument("--max-util", type=float, default=0.9, help="prefill load at the top rate, at most")
    ap.add_argument("--point-seconds", type=float, default=3.0, help="arrivals per point: rate x this")
    ap.add_argument("--min-requests", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="sequential warm-up requests per length")
    ap.add_argument("--out-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-gib", type=float, default=24.0, help="KV pool per engine")
    ap.add_argument("--poll-ms", type=float, default=0.2, help="kvpush worker poll period while busy")
    ap.add_argument("--verify", default="sample", choices=("sample", "all", ""),
                    help="check the decode blocks hold the prefill's bytes (sample: every 31st plane)")
    ap.add_argument("--point-timeout", type=float, default=300.0)
    ap.add_argument("--cpu", action="store_true", help="DRAM slabs and sleeping steps (smoke run, no GPU)")
    ap.add_argument("--cpu-time-scale", type=float, default=1.0)
    ap.add_argument("--geometry", default="{}", help="JSON overrides of the per-rank KV geometry")
    ap.add_argument("--only-16k-for-block-sizes", default="",
                    help="block sizes that run only the longest length (saves GPU time)")
    ap.add_argument("--p-tp", type=int, default=1, help="prefill ranks (one process, and GPU if enough, each)")
    ap.add_argument("--d-tp", type=int, default=1, help="decode ranks")
    ap.add_argument("--total-heads", type=int, default=0,
                    help="KV heads of the model (default: the geometry's num_heads x max(p-tp, d-tp), so that a rank "
                         "of the wider side holds what one Qwen3-32B TP=8 rank holds)")
    ap.add_argument("--nixl-wire", metavar="JSON", help="probes/nixl_wire.py result: adds the contiguous-bandwidth keys")
    ap.add_argument("--summarize", metavar="JSON", help="recompute the summary of an earlier result (no run)")
    ap.add_argument("--out", default="engine-loop.json")
    args = ap.parse_args(argv)
    args.modes = args.modes.split(",")
    args.block_sizes = [int(x) for x in args.block_sizes.split(",")]
    all_lengths = [int(x) for x in args.lengths.split(",")]
    args.rates = [float(x) for x in args.rates.split(",")]
    args.geometry = json.loads(args.geometry)
    short = {int(x) for x in args.only_16k_for_block_sizes.split(",") if x}
    set_ranks(args)
    wire_rows = json.loads(Path(args.nixl_wire).read_text())["rows"] if args.nixl_wire else None
    if args.summarize:
        doc = json.loads(Path(args.summarize).read_text())
        args.lengths = all_lengths
        args.rates = sorted({p["rate_nominal"] for r in doc["results"] for p in r["points"]})
        args.block_sizes = sorted({r["block_size"] for r in doc["results"]})
        doc["summary"] = summary(doc["results"], doc["meta"]["raw_copy_ms"], args, wire_rows)
        Path(args.out).write_text(json.dumps(doc, indent=1))
        return 0
    cost = StepCost()
    meta: dict = {"argv": sys.argv[1:] if argv is None else argv, "cost_model": cost.__dict__,
                  "geometry": {**QWEN3_32B_RANK, **args.geometry}, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    gpus = 0
    if not args.cpu:
        import torch

        gpus = torch.cuda.device_count()
        meta["gpus"] = [torch.cuda.get_device_name(i) for i in range(gpus)]
    meta["ranks"] = place_ranks(args, gpus)
    args.lengths = all_lengths
    raw = {str(t): None if args.cpu else peer_copy_ms(t * block_bytes(args.geometry, 1, args.p_heads),
                                                      args.p_devices[0], args.d_devices[0])
           for t in all_lengths}
    meta["raw_copy_ms"] = raw

    def log(msg: str) -> None:
        print(msg, flush=True)

    results, seq = [], [0]
    for bs in args.block_sizes:
        args.lengths = [max(all_lengths)] if bs in short else all_lengths
        for mode in args.modes:
            results.append(run_mode(mode, bs, args, cost, seq, log))
            Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    args.lengths = all_lengths
    doc = {"meta": meta, "summary": summary(results, raw, args, wire_rows), "results": results}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
