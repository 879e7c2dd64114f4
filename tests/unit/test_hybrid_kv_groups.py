"""Hybrid KV cache groups (issue 50): a Mamba / SSM state group is refused naming the fix; a sliding-window-only
model (one SlidingWindowSpec KV cache group) on the CPU / CUDA scheduler side.

Both instances' block lists are built here as vLLM builds them, with vLLM's own window bound
(`SlidingWindowManager.get_num_skipped_tokens`, the installed release's code): the decode is handed the blocks from
the first one not padded with the null block (`add_local_computed_blocks`; `get_unhashed_block_ids_all_groups` leaves
null blocks out), the prefill's list has the null block (id 0) where `remove_skipped_blocks` freed its head before
`request_finished`.  Before the fix the decode registered those blocks from token 0, which the producer refused
(`bad_registration: dst has 2 block ids but blocks [0, 4) need 4`).
"""

from types import SimpleNamespace

import pytest

from kvpush_common.plan.planner import PlanError, check_block_ids
from kvpush_common.vllm.kv_groups import (MAMBA_FIX, kv_group_problem, sliding_window_of, window_block_missing,
                                          window_registration)
from kvpush_common.vllm.scheduler import SchedulerSide
from test_parallel_sampling_scheduler import PRODUCER, blocks, request, settings

DECODE = {"kvpush": "decode", "transfer_id": "t", "attempt": 0, "producer": PRODUCER}
NULL = 0


def _skipped(num_computed_tokens: int, window: int) -> int:
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    return SlidingWindowManager.get_num_skipped_tokens(
        SimpleNamespace(sliding_window=window, extra_retained_tokens=0), num_computed_tokens)


def kv_cache_config(window: int, bs: int):
    spec = type("SlidingWindowSpec", (), {"sliding_window": window, "block_size": bs})()
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l.0"])])


def vllm_lists(n: int, window: int, bs: int, hit_blocks: int = 0) -> tuple[list[int], list[int]]:
    """(decode's unhashed non-null block ids, prefill's block ids at request_finished) for an n-token prompt."""
    total = -(-n // bs)
    nulls = _skipped(n, window) // bs
    decode = [100 + i for i in range(max(nulls, hit_blocks), total)]
    prefill = [NULL if i < nulls else 500 + i for i in range(total)]
    return decode, prefill


@pytest.mark.parametrize("window,bs", [(64, 32), (96, 32), (64, 128), (128, 16)])
def test_the_decode_registers_exactly_the_in_window_blocks_at_every_remainder(window, bs):
    declined = set()
    for n in range(2, window + 4 * bs):
        s = SchedulerSide(settings("consumer"), kv_cache_config(window, bs))
        r = request("r", dict(DECODE), tokens=n)
        asked = s.get_num_new_matched_tokens(r, 0)
        if asked == (0, False):
            declined.add(n % bs)
            [op] = s.build_connector_meta(None).declines
            assert f"block of token {n - window}" in op.reason
            continue
        assert asked == (n, True)
        d_ids, p_ids = vllm_lists(n, window, bs)
        s.update_state_after_alloc(r, blocks(d_ids), n)
        [op] = s.build_connector_meta(None).recvs
        assert op.block_ids == tuple(d_ids) and op.first_token % bs == 0
        # the planner's own check, both sides: D's ids cover [first, n) exactly, P's hold no null block there
        nblk = -(-(n - op.first_token) // bs)
        layout = SimpleNamespace(num_blocks=10_000, block_size=bs)
        check_block_ids(op.block_ids, 0, nblk, layout, "dst", "")
        src = check_block_ids(p_ids, op.first_token // bs, nblk, layout, "src", "")
        assert NULL not in src.tolist(), (n, op.first_token, p_ids)
        # and the recompute of token n - 1 reads from token n - window: that block was received
        assert op.first_token <= max(0, n - window), (n, op.first_token)
    assert declined == {(window - 1) % bs}  # only where vLLM's bound N - window + 1 falls at a block start


def test_before_the_window_block_ids_start_at_token_0_and_a_prefix_hit_stays():
    assert window_registration(40, 0, (7, 8), 64, 32) == (0, (7, 8))
    assert window_registration(400, 0, (7, 8), 64, 128) == (256, (7, 8))  # issue 50's 400-token prompt
    d_ids, _ = vllm_lists(300, 64, 32, hit_blocks=9)  # 9 blocks (288 tokens) cached here, past the window's first
    assert window_registration(300, 288, tuple(d_ids), 64, 32) == (288, tuple(d_ids))


def test_the_registration_before_the_fix_is_the_one_the_producer_refused():
    """Issue 50: D registered from token 0 with the window's blocks only."""
    d_ids, _ = vllm_lists(400, 64, 128)
    with pytest.raises(PlanError, match=r"dst has 2 block ids but blocks \[0, 4\) need 4"):
        check_block_ids(d_ids, 0, 4, SimpleNamespace(num_blocks=10_000, block_size=128), "dst",
                        "blocks [0, 4)")


def test_a_full_attention_model_is_left_as_it_was():
    assert sliding_window_of(SimpleNamespace(kv_cache_groups=[SimpleNamespace(
        kv_cache_spec=type("FullAttentionSpec", (), {"block_size": 32})(), layer_names=["l.0"])])) is None
    s = SchedulerSide(settings("consumer"), None)
    r = request("r", dict(DECODE), tokens=300)
    assert s.get_num_new_matched_tokens(r, 0) == (300, True)
    s.update_state_after_alloc(r, blocks(range(1, 11)), 300)
    [op] = s.build_connector_meta(None).recvs
    assert (op.first_token, op.block_ids) == (0, tuple(range(1, 11)))
    assert window_block_missing(64, 32, 127, 100) is None  # a prefix hit holds the window's first block


def test_a_mamba_hybrid_is_refused_naming_a_fix_that_works():
    """A Mamba hybrid keeps attention and state groups even with vLLM's hybrid manager off (vLLM promotes only
    sliding-window and chunked-local specs), so "drop --no-disable-hybrid-kv-cache-manager" would not help."""
    def group(names, kind):
        return SimpleNamespace(layer_names=names, kv_cache_spec=type(kind, (), {"block_size": 64})())

    cfg = SimpleNamespace(kv_cache_groups=[group(["model.layers.3.self_attn"], "FullAttentionSpec"),
                                           group([f"model.layers.{i}.mixer" for i in (0, 1, 2)], "MambaSpec")])
    problem = kv_group_problem(cfg)
    assert problem.startswith("model.layers.0.mixer, model.layers.1.mixer, model.layers.2.mixer keep a recurrent")
    assert problem.endswith(MAMBA_FIX) and "--no-disable-hybrid-kv-cache-manager" not in problem
    from vllm.v1.kv_cache_interface import MambaSpec  # the name kvpush reads is vLLM's class

    assert MambaSpec.__name__ == "MambaSpec"
