"""n > 1 in the scheduler side: vLLM runs each sample as a child request carrying the parent's
kv_transfer_params, so several requests share one transfer key.  On D one receives and its siblings wait,
then use the prefix cache; on P one sends and the others send nothing."""

from types import SimpleNamespace

from vllm.v1.request import RequestStatus

from kvpush_common.vllm.scheduler import SchedulerSide

PRODUCER = {"engine_id": "P", "host": "127.0.0.1", "port": 5700, "tp_size": 1}


def settings(role, local_prefill_max_tokens=0):
    return SimpleNamespace(role=role, engine_id=role, mode="push", local_prefill_max_tokens=local_prefill_max_tokens)


def request(req_id, params, tokens=40):
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params, num_prompt_tokens=tokens,
                           status=RequestStatus.FINISHED_LENGTH_CAPPED)


def blocks(ids):
    return SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: [list(ids)])


def test_decode_siblings_wait_for_the_one_receive_then_use_the_prefix_cache():
    s = SchedulerSide(settings("consumer"))
    leg = {"kvpush": "decode", "transfer_id": "t", "attempt": 0, "producer": PRODUCER}
    a, b = request("r-0", leg), request("r-1", leg)
    assert s.get_num_new_matched_tokens(a, 0) == (40, True)
    assert s.get_num_new_matched_tokens(b, 0) == (40, True)  # nobody receives yet: either may go first
    s.update_state_after_alloc(a, blocks([1, 2, 3]), 40)
    assert [op.req_id for op in s.build_connector_meta(None).recvs] == ["r-0"]
    assert s.get_num_new_matched_tokens(b, 0) == (None, False)  # not schedulable while r-0 receives
    s.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving={"r-0"}))
    assert s.get_num_new_matched_tokens(b, 32) == (0, False)  # the prompt's full blocks are cached now
    assert s.build_connector_meta(None).recvs == []  # exactly one registration for the key
    retry = request("r-2", {**leg, "attempt": 1})  # another attempt is another key
    assert s.get_num_new_matched_tokens(retry, 0) == (40, True)


def test_prefill_siblings_send_once():
    s = SchedulerSide(settings("producer"))
    leg = {"kvpush": "prefill", "transfer_id": "t", "attempt": 0}
    hold_a, params_a = s.request_finished(request("r-0", leg), [1, 2, 3])
    hold_b, params_b = s.request_finished(request("r-1", leg), [4, 5, 6])
    assert hold_a and params_a["kvpush_transfer"]["transfer_id"] == "t"
    assert (hold_b, params_b) == (False, None)  # its blocks are freed at once, nothing sent twice
    assert [op.req_id for op in s.build_connector_meta(None).sends] == ["r-0"]
    s.update_connector_output(SimpleNamespace(finished_sending={"r-0"}, finished_recving=None))
    assert not s.has_pending_push_work()
