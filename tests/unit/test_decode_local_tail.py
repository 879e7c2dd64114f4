"""Decode-local completion of short tails in the scheduler side (issue 14 item 1): when D's prefix cache
leaves at most `local_prefill_max_tokens` of a prompt uncomputed, D loads nothing, computes the tail itself,
and the step's metadata tells the producer once; otherwise the uncached tail is received as before."""

from types import SimpleNamespace

import pytest

from kvpush_common.vllm.metadata import DeclineOp
from kvpush_common.vllm.scheduler import SchedulerSide
from test_parallel_sampling_scheduler import PRODUCER, blocks, request, settings

LEG = {"kvpush": "decode", "transfer_id": "t", "attempt": 0, "producer": PRODUCER}


def test_a_short_tail_after_a_local_hit_is_computed_here_and_declined_once():
    s = SchedulerSide(settings("consumer", local_prefill_max_tokens=64))
    turn2 = request("r-1", LEG, tokens=300)
    assert s.get_num_new_matched_tokens(turn2, 256) == (0, False)  # 44 tokens left: computed here
    assert s.get_num_new_matched_tokens(turn2, 256) == (0, False)  # asked again (no free blocks): no repeat
    meta = s.build_connector_meta(None)
    assert meta.recvs == [] and len(meta.declines) == 1
    op = meta.declines[0]
    assert isinstance(op, DeclineOp) and (op.req_id, op.transfer_id, op.attempt) == ("r-1", "t", 0)
    assert op.producer.engine_id == "P" and op.reason == "256 prompt tokens cached here, 44 computed here"
    assert s.build_connector_meta(None).declines == []
    s.request_finished(turn2, [1, 2, 3])
    assert not s.has_pending_push_work()


@pytest.mark.parametrize("cached,tokens,limit,expected", [
    (0, 40, 256, (40, True)),  # no local hit: a first turn is P's to compute, however short
    (128, 400, 256, (272, True)),  # the tail is longer than the limit: received (tail only) as before
    (256, 300, 0, (44, True)),  # the feature off
    (256, 300, 44, (0, False)),  # exactly at the limit: computed here
])
def test_when_the_tail_is_received_instead(cached, tokens, limit, expected):
    s = SchedulerSide(settings("consumer", local_prefill_max_tokens=limit))
    assert s.get_num_new_matched_tokens(request("r", LEG, tokens=tokens), cached) == expected
    assert bool(s.build_connector_meta(None).declines) == (expected == (0, False))


def test_pull_mode_always_receives():
    s = SchedulerSide(SimpleNamespace(**{**vars(settings("consumer", 256)), "mode": "pull"}))
    assert s.get_num_new_matched_tokens(request("r", LEG, tokens=300), 256) == (44, True)


def test_a_registered_request_is_never_declined_later():
    s = SchedulerSide(settings("consumer", local_prefill_max_tokens=64))
    r = request("r", LEG, tokens=300)
    assert s.get_num_new_matched_tokens(r, 128) == (172, True)
    s.update_state_after_alloc(r, blocks([4, 5]), 172)
    assert s.get_num_new_matched_tokens(r, 256) == (0, False)  # e.g. a recompute pass after preemption
    meta = s.build_connector_meta(None)
    assert len(meta.recvs) == 1 and meta.declines == []
