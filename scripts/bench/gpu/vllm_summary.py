"""What a real-vLLM benchmark result says (scripts/bench/gpu/vllm_gpu.py): per-point statistics, the summary's
ratios measured side by side in one run, where the time went (the endpoints' event logs, kvpush's and vLLM's
metrics), and the markdown report.  Pure functions of the result; no processes."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

# the issue-35 goals, checked at every point of a run: kvpush push / vLLM NixlPushConnector
GOALS = {"ttft_p50": 0.8, "ttft_p99": 0.8, "tpot_p50": 1.0}


def input_key(spec) -> tuple[int, int]:
    """Sort key of an input spec: a token count (8192) or a log-uniform range ("1024-16384"), by its top."""
    if isinstance(spec, str) and "-" in spec:
        lo, hi = (int(x) for x in spec.split("-"))
        return hi, lo
    return int(spec), int(spec)


def label(mode: str, runner: str | None) -> str:
    """A mode's name in the result: `push@v1` for vLLM's model runner V1 (plain `push` in one-runner results)."""
    return f"{mode}@{runner}" if runner else mode


def split_label(name: str) -> tuple[str, str | None]:
    mode, _, runner = name.partition("@")
    return mode, runner or None


def quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def alone(rows: list[dict], arrivals: list[float]) -> list[dict]:
    """The answered requests whose decode (first token to last) overlapped no other request's wait for its first
    token: on one shared GPU their TPOT is the decode's own, with no prefill of another request beside it."""
    span = [(a, a + r["ttft_s"], a + r["e2e_s"]) if r["outcome"] == "ok" and r["ttft_s"] is not None
            and r.get("e2e_s") is not None else None for r, a in zip(rows, arrivals)]
    out = []
    for i, (r, own) in enumerate(zip(rows, span)):
        if own is None or r["tpot_s"] is None:
            continue
        _, start, end = own
        if not any(j != i and other is not None and other[0] < end and start < other[1]
                   for j, other in enumerate(span)):
            out.append(r)
    return out


def point_stats(rows: list[dict], refs: list[str], arrivals: list[float] | None = None) -> dict:
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
            "tpot_p50_ms": r1(quantile(tpot, 0.5)), "tpot_p99_ms": r1(quantile(tpot, 0.99)),
            **({} if arrivals is None else alone_stats(alone(rows, arrivals)))}


def alone_stats(rows: list[dict]) -> dict:
    """`decode_alone` (how many) and their TPOT p50, of the rows `alone` kept."""
    tpot = [r["tpot_s"] * 1e3 for r in rows]
    return {"decode_alone": len(rows), "tpot_alone_p50_ms": round(quantile(tpot, 0.5), 2) if tpot else None}


def ttft_mean(point: dict) -> float | None:
    """A point's mean TTFT (ms), from its answered requests where an older result lacks the key.  At a load
    where about half the requests queue behind another prefill the TTFTs fall in two groups, and the p50 jumps
    between them from run to run; the mean does not."""
    if point.get("ttft_mean_ms") is not None:
        return point["ttft_mean_ms"]
    xs = [r["ttft_s"] * 1e3 for r in point.get("per_request", []) if r.get("outcome") == "ok" and r.get("ttft_s")]
    return round(statistics.mean(xs), 1) if xs else None


def slow_hooks(events: list[dict]) -> dict[str, int]:
    """Engine hook calls over 50 us (the worker side's `slow_hook` events), counted by role, hook and what
    the step handed over: a receive, a send, something else, or nothing."""
    out: dict[str, int] = {}
    for e in events:
        if e.get("ev") == "slow_hook":
            key = slow_hook_key(e)
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def slow_hook_key(e: dict) -> str:
    """`<role> <hook>: <what the step handed over>` of one `slow_hook` event (the first kind it had)."""
    what = next((name for name in ("recvs", "sends", "other") if e.get(name)), "nothing")
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
    descs = [e["descs"] for e in events if e.get("ev") == "posted" and e.get("descs")]
    if not descs:
        return {}
    return {"writes": len(descs), "p50": statistics.median(descs), "min": min(descs), "max": max(descs)}


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
    for p in sorted(result["points"], key=lambda p: (input_key(p["input_len"]), p["rate"], p["mode"])):
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
        lens = sorted({p["input_len"] for p in result["points"]}, key=input_key)
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


def summarize(result: dict) -> dict:
    """The comparison keys, each runner's modes paired point by point: kvpush push / vLLM push (worst point), vLLM
    pull / push (best), every point's ratios with the goals checked at each, and where time went."""
    by = {(p["mode"], p["input_len"], p["rate"]): {**p, "ttft_mean_ms": ttft_mean(p)} for p in result["points"]}
    modes = sorted({m for m, _, _ in by})
    runners = sorted({split_label(m)[1] or "" for m in modes})

    def pairs(a: str, b: str, key: str) -> list[tuple[str, object, float, float]]:
        out = []
        for runner in runners:
            for (m, n, r), p in by.items():
                q = by.get((label(b, runner or None), n, r))
                if m == label(a, runner or None) and q and p.get(key) and q.get(key):
                    out.append((runner, n, r, p[key] / q[key]))
        return out

    def ratios(a: str, b: str, key: str) -> list[float]:
        return [x for *_, x in pairs(a, b, key)]

    def r3(xs, f):
        return round(f(xs), 3) if xs else None

    exact, answered = {}, {}
    for m in modes:
        pts = [p for (mm, _, _), p in by.items() if mm == m]
        total = sum(p["requests"] - p.get("cut", 0) for p in pts)  # cut: the point's budget ended first
        exact[m] = round(sum(p["exact"] for p in pts) / total, 4) if total else None
        total_all = sum(p["requests"] for p in pts)
        answered[m] = round(sum(p["ok"] for p in pts) / total_all, 4) if total_all else None
    per_point: dict = {}
    for name, (a, b, key) in {"ttft_p50_push_over_nixl_push": ("push", "nixl-push", "ttft_p50_ms"),
                              "ttft_p99_push_over_nixl_push": ("push", "nixl-push", "ttft_p99_ms"),
                              "tpot_p50_push_over_nixl_push": ("push", "nixl-push", "tpot_p50_ms")}.items():
        for runner, n, r, x in pairs(a, b, key):
            row = per_point.setdefault((runner, str(n), r), {"runner": runner or None, "input": n, "rate": r})
            row[name] = round(x, 3)
    rows = [per_point[k] for k in sorted(per_point, key=lambda k: (k[0], input_key(k[1]), k[2]))]
    goals = {f"{k}_push_over_nixl_push_max <= {v:g}": all(row.get(f"{k}_push_over_nixl_push", 0) <= v for row in rows)
             for k, v in GOALS.items()} if any("ttft_p50_push_over_nixl_push" in row for row in rows) else {}
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
        "goals_met": goals,
        "per_point": rows,
        # every mode against plain push (of its runner) by mean TTFT (worst point)
        "ttft_mean_over_push_max": {m: r3(xs, max) for m in modes if split_label(m)[0] != "push"
                                    for xs in [[x for runner, n, r, x in pairs(split_label(m)[0], "push", "ttft_mean_ms")
                                                if (runner or None) == split_label(m)[1]]] if xs},
        "exposed_after_prefill_ms_p50_max": exposed_after_prefill(result.get("stages", {})),
        "engine_hook_p99_us_at_most": engine_hook_p99(result.get("metrics", {})),
        "vllm_engine_means_ms": engine_means(result.get("metrics", {})),
        "producer_write_stage_means_ms": write_stage_means(result.get("metrics", {})),
        "worker_load": worker_load(result.get("metrics", {}), result.get("mode_wall_s", {})),
        "slow_engine_hooks": result.get("slow_hooks", {}),
        "producer_wake_ms": result.get("wake", {}),
        "posted_descs": result.get("posted_descs", {}),
        "cross_layer_cache": result.get("cross_layer_cache", {}),
    }


WORKER_SERIES = {"steps": "kvpush_worker_steps_total", "cpu_s": "kvpush_worker_cpu_seconds_total",
                 "nixl_cpu_s": "kvpush_worker_nixl_cpu_seconds_total"}


def worker_load(metrics: dict, wall_s: dict) -> dict:
    """Per mode and instance, what kvpush's worker thread took from its process over the mode's run: steps
    (wake-ups) and CPU seconds, of which inside NIXL (GIL released) and the rest (Python, GIL held), and per
    second of the mode's wall time (its points, start to end) where that is known."""
    out: dict = {}
    for mode, per_instance in metrics.items():
        for inst, series in (per_instance.items() if isinstance(per_instance, dict) else ()):
            if not isinstance(series, dict):
                continue
            got = {k: sum(v for name, v in series.items() if name.split("{", 1)[0] == s)
                   for k, s in WORKER_SERIES.items()}
            if not got["steps"]:
                continue
            row = {"steps": int(got["steps"]), "cpu_s": round(got["cpu_s"], 3),
                   "gil_cpu_s": round(got["cpu_s"] - got["nixl_cpu_s"], 3),
                   "us_per_step": round(got["cpu_s"] / got["steps"] * 1e6, 1)}
            wall = wall_s.get(mode)
            if wall:
                row["steps_per_s"] = round(got["steps"] / wall, 1)
                row["gil_cpu_share"] = round((got["cpu_s"] - got["nixl_cpu_s"]) / wall, 4)
            out.setdefault(mode, {})[inst] = row
    return out
