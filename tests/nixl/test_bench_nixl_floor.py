"""The bare-NIXL floor benchmark keeps working: on host memory over real NIXL UCX, each request's WRITE completes
and its notification reaches the consumer process, in one descriptor for a cross-layer cache."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bare_nixl_push_is_timed_from_post_to_notification(tmp_path):
    out = tmp_path / "floor.json"
    subprocess.run([sys.executable, "-m", "scripts.bench.probes.nixl_floor", "--kind", "host", "--tokens", "256,512",
                    "--reps", "2", "--out", str(out)], check=True, timeout=240, capture_output=True, cwd=ROOT)
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [256, 512]
    for r in rows:
        assert r["descs"] == 1 and r["bytes"] == r["tokens"] * 64 * 2 * 128 * 2  # 64 layers x K/V, one run
        assert r["post_ms_p50"] > 0 and r["handoff_ms_p50"] > 0  # seen after its post began (same clock)
