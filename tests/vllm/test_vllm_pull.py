"""kvpush pull mode inside real vLLM: the router sends the decode leg only after the prefill answered
(late destination choice); the decode instance READs on its connector's worker thread."""

from __future__ import annotations

import pytest

from kvpush_common.endpoint.events import read_events
from kvpush_common.testing.vllm_cluster import Router, VllmServer, free_port_pair, make_model, post_json, scratch_dir, wait_healthy

pytestmark = pytest.mark.timeout(900)

GEN = {"model": "tiny", "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
PULL = {"mode": "pull", "reg_ttl_s": 20, "write_timeout_s": 5, "heartbeat_s": 1, "lease_s": 10}


def test_pull_through_router_matches_a_single_instance():
    work = scratch_dir("kvpush-vllm-pull-")
    env = {"KVPUSH_EVENT_DIR": str(work / "events")}
    model = make_model(work / "tiny", seed=0)
    p = VllmServer("P", model, role="kv_producer", log_dir=work, core="0", env=env,
                   extra={"port": free_port_pair(), **PULL})
    d = VllmServer("D", model, role="kv_consumer", log_dir=work, core="1", env=env, extra=PULL)
    procs = [p, d]
    try:
        wait_healthy(procs, timeout=600)
        r = Router(mode="pull", prefill=[p.url], decode=[d.url], log_dir=work)
        procs.append(r)
        wait_healthy([r], timeout=120)
        block = "def handler(request):\n    return request.json()\n"
        for prompt in ["a", block * 3, block * 12]:
            status, ref = post_json(p.url + "/v1/completions", {**GEN, "prompt": prompt})
            assert status == 200
            status, got = post_json(r.url + "/v1/completions", {**GEN, "prompt": prompt}, timeout=300)
            assert status == 200, got
            assert got["choices"][0]["text"] == ref["choices"][0]["text"]
        ev = read_events(work / "events")
        assert sum(e["ev"] == "read_posted" for e in ev) >= 3  # the consumer really READ the KV
        assert sum(e["ev"] == "received" for e in ev) >= 3
        assert not [e for e in ev if e["ev"] in ("recv_failed", "read_failed")]
    finally:
        for proc in reversed(procs):
            proc.stop()
