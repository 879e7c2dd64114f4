"""The engine-loop benchmark keeps working: a tiny CPU sweep over real NIXL in every handoff mode, and with
several ranks per engine."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_sweep_serves_every_request_with_the_right_bytes(tmp_path):
    out = tmp_path / "el.json"
    subprocess.run([sys.executable, "-m", "scripts.bench.handoff.engine_loop", "--cpu", "--lengths", "256",
                    "--rates", "4", "--block-sizes", "16", "--geometry", '{"num_layers": 2, "head_dim": 64}',
                    "--pool-gib", "0.02", "--out-tokens", "4", "--point-seconds", "0.5", "--min-requests", "3",
                    "--warmup", "1", "--cpu-time-scale", "0.3", "--verify", "all", "--out", str(out)],
                   check=True, timeout=240, capture_output=True, cwd=ROOT)
    doc = json.loads(out.read_text())
    points = [p for r in doc["results"] for p in r["points"]]
    assert sorted(p["mode"] for p in points) == ["kvpush-pull", "push", "vllm-pull"]
    for p in points:
        assert p["n"] == 3 and p["failed"] == 0 and p["wrong_bytes"] == 0, p
        assert p["ttft_ms_p50"] > 0 and p["handoff_ms_p50"] >= 0 and p["timelines"]
        assert p["timelines"][0]["first_token"] >= p["timelines"][0]["prefill_done"]
    assert next(p for p in points if p["mode"] == "push")["descs_p50"] == 4  # 2 layers x K/V, one run each
    assert {"ttft_pull_over_push_16k_max_load", "tpot_push_over_pull_16k_max_load", "push_ttft_le_pull_everywhere",
            "decode_hook_time_p99_us_push"} <= set(doc["summary"])


@pytest.mark.parametrize("p_tp,d_tp", [(2, 2), (2, 1), (1, 2)])
def test_cpu_sweep_with_several_ranks_per_engine(tmp_path, p_tp, d_tp):
    """Prefill and decode engines of several ranks (a process each, heads split or gathered across
    ranks): every request is served with every rank's bytes checked."""
    out = tmp_path / "el.json"
    subprocess.run([sys.executable, "-m", "scripts.bench.handoff.engine_loop", "--cpu", "--modes", "push",
                    "--p-tp", str(p_tp), "--d-tp", str(d_tp), "--lengths", "256", "--rates", "4",
                    "--block-sizes", "16", "--geometry", '{"num_layers": 2, "head_dim": 64}', "--pool-gib", "0.02",
                    "--out-tokens", "4", "--point-seconds", "0.5", "--min-requests", "3", "--warmup", "1",
                    "--cpu-time-scale", "0.3", "--verify", "all", "--out", str(out)],
                   check=True, timeout=240, capture_output=True, cwd=ROOT)
    doc = json.loads(out.read_text())
    ranks = doc["meta"]["ranks"]
    assert (ranks["p_tp"], ranks["d_tp"], ranks["total_kv_heads"]) == (p_tp, d_tp, max(p_tp, d_tp))
    assert len(ranks["p_devices"]) == p_tp and len(ranks["d_devices"]) == d_tp
    [point] = [p for r in doc["results"] for p in r["points"]]
    assert point["n"] == 3 and point["failed"] == 0 and point["wrong_bytes"] == 0, point
    # a producer rank moves its own heads: 2 layers x K/V x 64 dims x 2 bytes per head and token
    assert point["kv_bytes"] == 256 * 2 * 2 * 64 * 2 * (max(p_tp, d_tp) // p_tp)
    # a head slice of a wider block is one descriptor per block and region; whole blocks merge per region
    assert point["descs_p50"] == (4 if p_tp == d_tp else 4 * 16)
