"""kvpush pull mode inside real vLLM: the decode leg goes out only after the prefill answered (late destination
choice); the decode instance READs on its connector's worker thread.  Driven by kvpush's router and by a serial
proxy written from vLLM's NixlConnector contract alone (common/testing/nixl_proxy.py, as vLLM's toy_proxy_server.py:
P's answer's kv_transfer_params, as they came, are D's), one P + D pair for both."""

from __future__ import annotations

import json
import sys
import urllib.request

import pytest

from kvpush_common.endpoint.events import read_events
from kvpush_common.testing.vllm_cluster import (Process, Router, VllmServer, free_port, free_port_pair, make_model,
                                                post_json, scratch_dir, wait_healthy)

pytestmark = pytest.mark.timeout(900)

GEN = {"model": "tiny", "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
PULL = {"mode": "pull", "reg_ttl_s": 20, "write_timeout_s": 5, "heartbeat_s": 1, "lease_s": 10}
BLOCK = "def handler(request):\n    return request.json()\n"


@pytest.fixture(scope="module")
def pair():
    work = scratch_dir("kvpush-vllm-pull-")
    env = {"KVPUSH_EVENT_DIR": str(work / "events")}
    model = make_model(work / "tiny", seed=0)
    p = VllmServer("P", model, role="kv_producer", log_dir=work, core="0", env=env,
                   extra={"port": free_port_pair(), **PULL})
    d = VllmServer("D", model, role="kv_consumer", log_dir=work, core="1", env=env, extra=PULL)
    state = {"P": p, "D": d, "work": work, "procs": [p, d]}
    try:
        wait_healthy([p, d], timeout=600)
        yield state
    finally:
        for proc in reversed(state["procs"]):
            proc.stop()


def reference(pair, prompt: str) -> str:
    status, ref = post_json(pair["P"].url + "/v1/completions", {**GEN, "prompt": prompt})
    assert status == 200
    return ref["choices"][0]["text"]


def test_pull_through_router_matches_a_single_instance(pair):
    r = Router(mode="pull", prefill=[pair["P"].url], decode=[pair["D"].url], log_dir=pair["work"])
    pair["procs"].append(r)
    wait_healthy([r], timeout=120)
    for prompt in ["a", BLOCK * 3, BLOCK * 12]:
        ref = reference(pair, prompt)
        status, got = post_json(r.url + "/v1/completions", {**GEN, "prompt": prompt}, timeout=300)
        assert status == 200, got
        assert got["choices"][0]["text"] == ref
    ev = read_events(pair["work"] / "events")
    assert sum(e["ev"] == "read_posted" for e in ev) >= 3  # the consumer really READ the KV
    assert sum(e["ev"] == "received" for e in ev) >= 3
    assert not [e for e in ev if e["ev"] in ("recv_failed", "read_failed")]


def test_a_serial_nixl_pull_proxy_drives_kvpush_in_pull_mode(pair):
    """vLLM's pull contract end to end with kvpush in mode pull: P answers transfer_mode pull and the proxy hands its
    answer to D, which READs the KV under P's remote_request_id (no transfer_id: the proxy sends none).  Exact
    answers, and a READ received for each request's key (no silent recompute)."""
    port = free_port()
    px = Process("proxy-pull", [sys.executable, "-m", "kvpush_common.testing.nixl_proxy", "--mode", "pull", "--port",
                                str(port), "--prefill", pair["P"].url, "--decode", pair["D"].url],
                 {"PYTHONUNBUFFERED": "1"}, pair["work"])
    px.url = f"http://127.0.0.1:{port}"
    pair["procs"].append(px)
    wait_healthy([px], timeout=60)
    keys = set()
    for prompt in [BLOCK * 4, BLOCK * 10]:
        ref = reference(pair, prompt)
        req = urllib.request.Request(px.url + "/v1/completions", data=json.dumps({**GEN, "prompt": prompt}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:  # an error status raises: the test fails with it
            status, got, headers = resp.status, json.loads(resp.read()), resp.headers
        assert status == 200 and got["choices"][0]["text"] == ref, got
        assert headers["X-Dispatch"] == "serial" and headers["X-Transfer-Ids"] == ""
        keys.add(f"cmpl-{headers['X-Request-Id']}-0")  # P's request id without vLLM's random suffix
    ev = [e for e in read_events(pair["work"] / "events") if e["tid"] in keys]
    for ev_name in ("read_posted", "received"):
        assert {e["tid"] for e in ev if e["ev"] == ev_name and e["role"] == "consumer"} == keys, ev_name
    assert not [e for e in ev if e["ev"] in ("recv_failed", "read_failed")]
