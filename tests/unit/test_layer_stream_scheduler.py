"""The scheduler side of layer streaming: one StreamOp per step for each prefill leg being prefilled, with
the request's blocks so far (vLLM hands new blocks per step) and the tokens computed once the step ends."""

from types import SimpleNamespace

from kvpush_common.vllm.metadata import StreamOp
from kvpush_common.vllm.scheduler import SchedulerSide
from test_parallel_sampling_scheduler import request, settings

LEG = {"kvpush": "prefill", "transfer_id": "t", "attempt": 0}


def step(new=(), cached=(), scheduled=None, resumed=()):
    """A SchedulerOutput with the fields the connector reads: new requests (req_id, blocks, computed) and
    cached ones (req_id, new blocks or None, computed)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached],
                                              new_block_ids=[(list(b),) if b else None for _, b, _ in cached],
                                              num_computed_tokens=[c for _, _, c in cached], resumed_req_ids=set(resumed)),
        num_scheduled_tokens=scheduled or {})


def producer(stream_layers=True):
    return SchedulerSide(SimpleNamespace(**{**vars(settings("producer")), "stream_layers": stream_layers}))


def test_a_chunked_prefill_streams_step_by_step_and_stops_after_its_last_chunk():
    s = producer()
    r = request("r", LEG, tokens=300)
    s.update_state_after_alloc(r, None, 0)
    assert s.build_connector_meta(step(new=[("r", [7, 8], 0)], scheduled={"r": 128})).streams == [
        StreamOp("r", "t", 0, (7, 8), 128)]
    assert s.build_connector_meta(step(cached=[("r", [9], 128)], scheduled={"r": 128})).streams == [
        StreamOp("r", "t", 0, (7, 8, 9), 256)]
    assert s.build_connector_meta(step(cached=[("r", [10, 11], 256)], scheduled={"r": 64})).streams == [
        StreamOp("r", "t", 0, (7, 8, 9, 10, 11), 300)]  # capped at the prompt: its last chunk
    assert s.build_connector_meta(step(cached=[("r", None, 300)], scheduled={"r": 1})).streams == []


def test_a_prefix_hit_counts_as_computed_and_a_preempted_request_stops_streaming():
    s = producer()
    s.update_state_after_alloc(request("r", LEG, tokens=300), None, 0)
    assert s.build_connector_meta(step(new=[("r", [1, 2, 3], 128)], scheduled={"r": 64})).streams == [
        StreamOp("r", "t", 0, (1, 2, 3), 192)]
    assert s.build_connector_meta(step(cached=[("r", [4], 0)], scheduled={"r": 64}, resumed={"r"})).streams == []
    assert s.build_connector_meta(step(cached=[("r", None, 64)], scheduled={"r": 64})).streams == []


def test_nothing_streams_when_off_for_plain_requests_or_after_the_request_ended():
    off = producer(stream_layers=False)
    off.update_state_after_alloc(request("r", LEG, tokens=300), None, 0)
    assert off.build_connector_meta(step(new=[("r", [1], 0)], scheduled={"r": 64})).streams == []
    s = producer()
    s.update_state_after_alloc(request("plain", None, tokens=300), None, 0)
    r = request("r", LEG, tokens=300)
    s.update_state_after_alloc(r, None, 0)
    s.request_finished(r, [1])  # e.g. aborted between steps
    assert s.build_connector_meta(step(new=[("plain", [1], 0), ("r", [2], 0)], scheduled={"plain": 64, "r": 64})
                                  ).streams == []
