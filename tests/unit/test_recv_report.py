"""The decode scheduler side's word on a failed KV receive (issue 31): vLLM drops a failed request's
kv_transfer_params, so the router asks afterwards with an identity probe naming the transfer attempt, and the
answer's `kvpush_recv` (RecvReport) says whether that receive failed here and which producer it expected."""

from types import SimpleNamespace

import msgspec
import pytest
from vllm.v1.request import RequestStatus

from kvpush_common.protocol.legs import IdentityProbe, RecvReport, parse_leg
from kvpush_common.vllm import compat, scheduler
from kvpush_common.vllm.scheduler import SchedulerSide

PRODUCER = {"engine_id": "P-old", "host": "127.0.0.1", "port": 5700, "tp_size": 1}


def side() -> SchedulerSide:
    settings = SimpleNamespace(role="consumer", engine_id="D", mode="push", local_prefill_max_tokens=0,
                               identity=lambda: SimpleNamespace(engine_id="D", host="127.0.0.1", port=5800, tp_size=1))
    return SchedulerSide(settings)


def request(req_id, params, status=RequestStatus.FINISHED_LENGTH_CAPPED):
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params, num_prompt_tokens=40, status=status)


def receive(s: SchedulerSide, req_id: str, tid: str, blocks=(1, 2, 3)) -> None:
    leg = {"kvpush": "decode", "transfer_id": tid, "attempt": 0, "producer": PRODUCER}
    r = request(req_id, leg)
    assert s.get_num_new_matched_tokens(r, 0) == (40, True)
    s.update_state_after_alloc(r, SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: [list(blocks)]), 40)


def report(s: SchedulerSide, tid: str, attempt: int = 0) -> RecvReport:
    probe = request("probe", {"kvpush": "identity", "transfer_id": tid, "attempt": attempt})
    hold, params = s.request_finished(probe, [])
    assert not hold and params["kvpush_identity"]["engine_id"] == "D"
    return msgspec.convert(params["kvpush_recv"], RecvReport)


@pytest.mark.parametrize("release", [(0, 32, 0), (0, 29, 0)])
def test_a_failed_receive_is_reported_to_the_routers_probe(monkeypatch, release):
    """0.30 and later name failed receives (failed_recving); 0.29 only their blocks (invalid_block_ids)."""
    features = compat.Features.of(release)
    monkeypatch.setattr(scheduler, "VLLM", features)
    s = side()
    receive(s, "r-ok", "t-ok", blocks=(4, 5))
    receive(s, "r-bad", "t-bad", blocks=(1, 2, 3))
    output = SimpleNamespace(finished_sending=None, finished_recving={"r-ok", "r-bad"})
    if features.transfer_results:
        output.failed_recving = {"r-bad"}
    else:
        output.invalid_block_ids = {2, 3}
    # kv_load_failure_policy=fail: vLLM finishes the request (its params are dropped) before the connector
    # output reaches update_connector_output
    s.request_finished(request("r-bad", {"kvpush": "decode", "transfer_id": "t-bad", "producer": PRODUCER},
                               RequestStatus.FINISHED_ERROR), [1, 2, 3])
    s.update_connector_output(output)
    assert report(s, "t-bad") == RecvReport("t-bad", 0, True, "P-old")
    assert report(s, "t-ok") == RecvReport("t-ok", 0, False, None)
    assert report(s, "t-bad", attempt=1).failed is False  # another attempt is another key
    assert report(s, "never-seen").failed is False


def test_the_failed_receives_remembered_are_bounded(monkeypatch):
    monkeypatch.setattr(scheduler, "FAILED_KEPT", 3)
    s = side()
    for i in range(5):
        receive(s, f"r-{i}", f"t-{i}")
        s.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving={f"r-{i}"},
                                                  failed_recving={f"r-{i}"}, invalid_block_ids=set()))
    assert [report(s, f"t-{i}").failed for i in range(5)] == [False, False, True, True, True]


def test_a_plain_identity_probe_is_answered_as_before():
    s = side()
    hold, params = s.request_finished(request("probe", {"kvpush": "identity"}), [])
    assert params == {"kvpush_identity": {"engine_id": "D", "host": "127.0.0.1", "port": 5800, "tp_size": 1}}
    assert parse_leg({"kvpush": "identity", "transfer_id": "t", "attempt": 2}) == IdentityProbe("t", 2)
    assert parse_leg({"kvpush": "identity", "transfer_id": "bad id!"}) is None  # malformed: logged, ignored
