"""Chaos on the vLLM CPU pair (short, CI): the prefill is paused longer than the decode's whole
bound while a decode leg waits for its KV.  With kv_load_failure_policy=recompute the decode must
end the wait within its bound, recompute, and answer exactly like a single instance; after the
prefill resumes, requests through the router transfer KV again and stay exact.  The long version
(scripts/chaos/chaos_load.py) adds a steady stream, a prefill SIGKILL + restart and load figures."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from kvpush_common.endpoint.events import read_events
from kvpush_common.testing.vllm_chaos import GEN, Pair, TIMEOUTS, complete, env_with_events, text_of
from kvpush_common.testing.vllm_cluster import post_json, prompts, scratch_dir

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # `chaos` comes from the folder

BOUND_S = TIMEOUTS["transfer_timeout_s"] + TIMEOUTS["reg_ttl_s"] + TIMEOUTS["write_timeout_s"] + 5  # fence grace


@pytest.fixture(scope="module")
def pair():
    work = scratch_dir("kvpush-chaos-vllm-")
    p = Pair(work, env=env_with_events(work))
    try:
        yield p.start()
    finally:
        p.stop()


def test_prefill_paused_decode_recomputes_exactly_and_the_pair_recovers(pair):
    prompt = prompts()[3]
    ref = pair.reference(prompt)
    ident = pair.identity()
    before = pair.d_metrics_now()
    tid = uuid.uuid4().hex
    d_leg = {**GEN, "prompt": prompt, "kv_transfer_params": {"kvpush": "decode", "transfer_id": tid, "producer": ident}}
    result = {}
    pair.pause_prefill()  # SIGSTOP the prefill's whole process group
    try:
        t0 = time.monotonic()
        t = threading.Thread(target=lambda: result.update(d=post_json(pair.D.url + "/v1/completions", d_leg,
                                                                      timeout=300)))
        t.start()
        t.join(timeout=BOUND_S + 60)
        elapsed = time.monotonic() - t0
    finally:
        pair.resume_prefill()
    assert not t.is_alive(), "decode request still waiting long after its bound"
    status, body = result["d"]
    assert status == 200 and text_of(body) == ref, body  # recomputed, exactly
    after = pair.d_metrics_now()
    assert after["kvpush_requests_failed_total"] >= before.get("kvpush_requests_failed_total", 0) + 1
    ev = [e for e in read_events(pair.work / "events") if e.get("tid") == tid]
    recv_failed = [e for e in ev if e["ev"] == "recv_failed"]
    assert recv_failed, ev
    # the KV wait ended within D's bound (the recompute itself comes on top)
    registered = min(e["t"] for e in ev if e["ev"] == "registered")
    assert recv_failed[0]["t"] - registered <= BOUND_S + 2, (recv_failed[0]["t"] - registered)
    assert elapsed < BOUND_S + 60
    # the prefill resumed: push works again through the router, token for token
    for p in prompts()[2:]:
        status, body, _ = complete(pair.router.url, p)
        assert status == 200 and text_of(body) == pair.reference(p), body
    ok_after = pair.d_metrics_now()["kvpush_requests_received_total"]
    assert ok_after >= after.get("kvpush_requests_received_total", 0) + 3
