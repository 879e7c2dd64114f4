"""README's commands run as printed (issue 46): the demo's control run must say MISMATCH, and the P, D and router
lines of "Using it with vLLM" (parsed out of README.md) serve the tiny model.

The serve lines are changed only where README leaves the value to the reader: MODEL, the hosts (both here on
127.0.0.1) and the ports (free ones here).  P and D share this host, so each gets what README's CPU note says
for that: its own core (VLLM_CPU_OMP_THREADS_BIND), a KV space (VLLM_CPU_KVCACHE_SPACE), --enforce-eager and,
for hosts with AMX, --dtype float32.  Nothing else is added (no tests/vllm_site hook): what runs is what a
reader runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpush_common.endpoint.events import read_events
from kvpush_common.testing import readme
from kvpush_common.testing.vllm_cluster import (ROOT, Process, completion_text, free_port, free_port_pair, make_model,
                                                post_json, scratch_dir, wait_healthy)

pytestmark = pytest.mark.timeout(900)

# README's CPU note, for P and D on one host
CPU_ONE_HOST_ARGS = ["--enforce-eager", "--dtype", "float32"]
CPU_ONE_HOST_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def test_demo_control_run_reports_the_mismatch():
    """`demo.py --control` gives P other weights (seed 1): D decodes from KV it could not compute itself, so the
    demo's check must fail, naming where each answer parts from the reference.  Had D recomputed the prompts
    (no KV used), its answers would equal the reference and this would fail."""
    work = scratch_dir("kvpush-demo-control-")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo" / "demo.py"), "--control", "--workdir", str(work)],
                         capture_output=True, text=True, timeout=840, cwd=ROOT)
    out = run.stdout
    assert run.returncode == 1, out + run.stderr[-4000:]
    assert out.splitlines()[-2:] == ["MISMATCH", "stopping servers ..."], out[-3000:]
    parted = [ln for ln in out.splitlines() if "parts from the reference at token" in ln]
    assert len(parted) >= 3, out  # the three longer prompts at least
    assert out.count("  reference (decode instance alone): ") == len(parted)
    assert out.count("  through the router (pushed KV):    ") == len(parted)


def _as_here(argv: list[str], ports: dict[str, str]) -> list[str]:
    """README's line with this host's values: MODEL, hosts and ports as `ports` maps them, `python` and
    `kvpush` from this environment."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, ports)) + r")\b")
    out = [pattern.sub(lambda m: ports[m.group(1)], arg) for arg in argv]
    if out[0] == "python":
        out[0] = sys.executable
    elif out[0] == "kvpush":
        out[0] = str(Path(sys.executable).with_name("kvpush"))
    return out


@pytest.fixture(scope="module")
def readme_pair():
    work = scratch_dir("kvpush-readme-")
    model = make_model(work / "tiny", seed=0)
    p_port, d_port, r_port, side = free_port(), free_port(), free_port(), free_port_pair()
    ports = {"MODEL": str(model), "10.0.0.1": "127.0.0.1", "10.0.0.2": "127.0.0.1", "8100": str(p_port),
             "8200": str(d_port), "5700": str(side)}
    lines = readme.commands(readme.bash_blocks("Using it with vLLM")[0])
    p_line, d_line, r_line = lines
    assert '"kv_producer"' in p_line[-1] and '"kv_consumer"' in d_line[-1] and r_line[:2] == ["kvpush", "router"]
    env = {**CPU_ONE_HOST_ENV, "PYTHONUNBUFFERED": "1", "KVPUSH_EVENT_DIR": str(work / "events")}
    procs = []
    try:
        for name, line, port, core in (("P", p_line, p_port, "0"), ("D", d_line, d_port, "1")):
            proc = Process(name, _as_here(line, ports) + CPU_ONE_HOST_ARGS,
                           {**env, "VLLM_CPU_OMP_THREADS_BIND": core}, work)
            proc.url = f"http://127.0.0.1:{port}"
            procs.append(proc)
        wait_healthy(procs, timeout=600)
        router = Process("router", _as_here(r_line, ports) + ["--port", str(r_port)], {"PYTHONUNBUFFERED": "1"}, work)
        router.url = f"http://127.0.0.1:{r_port}"
        procs.append(router)
        wait_healthy([router], timeout=180)
        yield {"P": procs[0], "D": procs[1], "router": router, "model": str(model), "work": work}
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_readme_lines_serve_a_pushed_completion(readme_pair):
    """A completion through README's router equals D computing the prompt alone, and D received the KV."""
    body = {"model": readme_pair["model"], "prompt": "def handler(request):\n    return request.json()\n" * 6,
            "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    want = completion_text(readme_pair["D"].url, {**body, "cache_salt": "reference"})
    status, got = post_json(readme_pair["router"].url + "/v1/completions", body, timeout=300)
    assert status == 200, got
    assert got["choices"][0]["text"] == want
    received = [e for e in read_events(readme_pair["work"] / "events")
                if e["ev"] == "received" and not e["tid"].startswith("warmup-")]  # not D's start-up warm-up
    assert len(received) == 1, received


def test_readme_prefill_answers_with_its_engine_id(readme_pair):
    """vLLM's push proxy is told P's engine id (--prefill-engine-id); README's P line sets it and P answers it."""
    status, body = post_json(readme_pair["P"].url + "/v1/completions",
                             {"model": readme_pair["model"], "prompt": "ping", "max_tokens": 1,
                              "kv_transfer_params": {"kvpush": "identity"}})
    assert status == 200, body
    engine_id = json.loads(readme.commands(readme.bash_blocks("Using it with vLLM")[0])[0][-1])["engine_id"]
    assert body["kv_transfer_params"]["kvpush_identity"]["engine_id"] == engine_id == "prefill-0"
