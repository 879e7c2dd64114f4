"""vLLM's NIXL contract as kvpush legs (protocol.legs.read_leg), the scheduler side serving them, and P's answer in
NixlConnector's shape: the leg shapes are those vLLM's proxies and llm-d's sidecar send (common/testing/nixl_proxy.py
cites them); bad params become a failed load that frees its blocks."""

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings as settings_, strategies as st
from vllm.v1.request import RequestStatus

from kvpush_common.protocol.legs import (BadLeg, DecodeLeg, IdentityProbe, PrefillLeg, ProducerIdentity, check_role,
                                         parse_leg, read_leg, request_key, transfer_key)
from kvpush_common.testing.nixl_proxy import identity_of, prefill_body
from kvpush_common.vllm import compat
from kvpush_common.vllm.compat import Features, LoadErrors
from kvpush_common.vllm.connector import KVPushConnector
from kvpush_common.vllm.metadata import KVPushMetadata
from kvpush_common.vllm.parallel import ParallelSizes
from kvpush_common.vllm.scheduler import SchedulerSide

P_ID = "cmpl-3f1c-0-1a2b3c4d"  # vLLM's request id: "cmpl-" + X-Request-Id + prompt index + 8 random hex
D_ID = "cmpl-3f1c-0-9e8d7c6b"  # the same X-Request-Id on D: another random suffix
COORDS = {"remote_engine_id": "prefill-0", "remote_host": "10.0.0.7", "remote_port": 5700, "tp_size": 2}
IDENT = ProducerIdentity(engine_id="prefill-0", host="10.0.0.7", port=5700, tp_size=2)


def settings(role, mode="push"):
    return SimpleNamespace(role=role, engine_id="prefill-0" if role == "producer" else "decode-0", mode=mode,
                           host="10.0.0.7", port=5700, tp_size=2, local_prefill_max_tokens=0, parallel=ParallelSizes())


def request(req_id, params, tokens=40, status=RequestStatus.FINISHED_LENGTH_CAPPED):
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params, num_prompt_tokens=tokens, status=status)


def blocks(ids):
    return SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: [list(ids)])


def p_leg(**kw):
    return prefill_body({"prompt": "x"}, kw.pop("transfer_id", None))["kv_transfer_params"] | kw


def test_prefill_legs_are_keyed_by_transfer_id_or_the_base_request_id():
    assert read_leg(p_leg(transfer_id="xfer-1"), P_ID) == PrefillLeg("xfer-1", contract="nixl")
    assert read_leg(p_leg(), P_ID) == PrefillLeg("cmpl-3f1c-0", contract="nixl")  # vLLM's get_base_request_id
    # a transfer_id is never stripped: two retries differing only in a hex tail stay two keys
    assert read_leg(p_leg(transfer_id="t-1a2b3c4d"), P_ID).transfer_id == "t-1a2b3c4d"
    odd = "x" * 300
    assert transfer_key(odd).startswith("sha256:") and transfer_key(odd) == transfer_key(odd) != transfer_key(odd + "y")


@pytest.mark.parametrize("shape, params, want_key", [
    # llm-d's sidecar, parallel: the cached identity + do_remote_prefill, remote_request_id, transfer_id
    ("llm-d parallel", {**COORDS, "transfer_mode": "push", "pp_size": 1, "do_remote_prefill": True,
                        "do_remote_decode": False, "remote_request_id": "3f1c", "transfer_id": "xfer-9"}, "xfer-9"),
    # its serial first request and vLLM's push demo: P's whole answer (+ transfer_id)
    ("answer forwarded", {**COORDS, "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
                          "remote_request_id": P_ID, "transfer_mode": "push", "transfer_id": "xfer-9"}, "xfer-9"),
    # vLLM's toy push proxy: a subset of P's answer, no transfer_id: vLLM's push pairs by the base request id
    ("toy push proxy", {**COORDS, "do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": P_ID},
     "cmpl-3f1c-0"),
])
def test_decode_legs_of_every_proxy_shape(shape, params, want_key):
    leg = read_leg(params, D_ID, "push")
    assert leg == DecodeLeg(want_key, IDENT, contract="nixl"), shape
    assert read_leg(p_leg(**({"transfer_id": want_key} if want_key.startswith("xfer") else {})), P_ID).transfer_id \
        == leg.transfer_id  # P and D agree on the key


def test_pull_pairs_by_remote_request_id_as_nixl_pull_does():
    params = {**COORDS, "do_remote_prefill": True, "remote_request_id": P_ID, "transfer_mode": "pull"}
    assert read_leg(params, "cmpl-other-0-00000000", "pull").transfer_id == "cmpl-3f1c-0"


@pytest.mark.parametrize("params, mode, match", [
    ({**COORDS, "do_remote_prefill": True, "do_remote_decode": True}, "push", "both true"),
    ({"do_remote_prefill": True, "remote_engine_id": "p"}, "push", "remote_host, remote_port, tp_size"),
    ({**COORDS, "do_remote_prefill": True, "remote_port": "5700"}, "push", r"\$.remote_port"),
    ({**COORDS, "do_remote_prefill": True, "remote_port": 70000}, "push", r"\$.remote_port"),
    ({**COORDS, "do_remote_prefill": True, "remote_host": "a b"}, "push", r"\$.remote_host"),
    ({**COORDS, "do_remote_prefill": True, "pp_size": 2}, "push", "pp_size 2"),
    ({**COORDS, "do_remote_prefill": True, "transfer_mode": "pull"}, "push", "runs kvpush in 'push' mode"),
    ({**COORDS, "do_remote_prefill": True, "transfer_id": ""}, "push", r"\$.transfer_id"),
    ({"do_remote_decode": "yes"}, "push", r"\$.do_remote_decode"),
    ({"do_remote_decode": True, "transfer_id": 7}, "push", r"\$.transfer_id"),
])
def test_malformed_or_inconsistent_params_are_bad_legs_naming_the_problem(params, mode, match):
    leg = read_leg(params, D_ID, mode)
    assert isinstance(leg, BadLeg)
    assert re.search(match, leg.reason), leg.reason


def test_no_transfer_asked_and_kvpush_legs_unchanged():
    for params in (None, {}, {"do_remote_prefill": False, "do_remote_decode": False}, {"foo": 1}):
        assert read_leg(params, D_ID) is None
    assert read_leg({"kvpush": "decode", "transfer_id": "t", "producer": {"engine_id": "p", "host": "h", "port": 1,
                                                                            "tp_size": 1}}).contract == "kvpush"
    assert isinstance(read_leg({"kvpush": "decode"}), BadLeg)
    assert parse_leg({"kvpush": "decode"}) is None  # the router's view: logged and ignored, as before


def test_role_mismatches_are_bad_legs():
    assert isinstance(check_role(read_leg(p_leg(), P_ID), "consumer"), BadLeg)
    assert isinstance(check_role(read_leg({**COORDS, "do_remote_prefill": True}, D_ID), "producer"), BadLeg)
    assert isinstance(check_role(read_leg(p_leg(), P_ID), "producer"), PrefillLeg)


def vllm_answer_keys() -> set[str]:
    """The keys vLLM 0.32's NixlPushConnectorScheduler.request_finished answers with (read from its source)."""
    import vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler as push

    tree = ast.parse(Path(push.__file__).read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "request_finished")
    call = next(n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "dict")
    return {k.arg for k in call.keywords}


def test_the_producer_answers_a_nixl_leg_in_nixl_pushconnector_shape():
    s = SchedulerSide(settings("producer"))
    hold, answer = s.request_finished(request(P_ID, p_leg(transfer_id="xfer-1")), [4, 5, 6])
    assert hold and vllm_answer_keys() <= set(answer)  # every field vLLM answers, plus transfer_id
    assert answer["transfer_mode"] == "push" and answer["transfer_id"] == "xfer-1"
    assert (answer["remote_engine_id"], answer["remote_host"], answer["remote_port"], answer["tp_size"]) == \
        ("prefill-0", "10.0.0.7", 5700, 2)
    assert answer["remote_request_id"] == P_ID and answer["remote_block_ids"] == [[4, 5, 6]]
    assert identity_of(answer) == {**COORDS, "transfer_mode": "push", "pp_size": 1, "dcp_size": 1}  # llm-d caches it
    assert [op.transfer_id for op in s.build_connector_meta(None).sends] == ["xfer-1"]
    # kvpush's own legs keep their own answer
    hold, answer = SchedulerSide(settings("producer")).request_finished(
        request("r", {"kvpush": "prefill", "transfer_id": "t"}), [1])
    assert hold and answer == {"kvpush_transfer": {"transfer_id": "t", "attempt": 0, "engine_id": "prefill-0"}}


def test_the_answer_forwarded_to_a_consumer_registers_under_the_same_key():
    answer = SchedulerSide(settings("producer")).request_finished(request(P_ID, p_leg()), [4, 5, 6])[1]
    c = SchedulerSide(settings("consumer"))
    r = request(D_ID, answer)
    assert c.get_num_new_matched_tokens(r, 0) == (40, True)
    c.update_state_after_alloc(r, blocks([7, 8, 9]), 40)
    (op,) = c.build_connector_meta(None).recvs
    assert (op.transfer_id, op.attempt, op.producer, op.block_ids) == ("cmpl-3f1c-0", 0, IDENT, (7, 8, 9))


@pytest.mark.parametrize("role, params", [
    ("consumer", {**COORDS, "do_remote_prefill": True, "pp_size": 4}),
    ("consumer", p_leg()),  # a prefill leg sent to D
    ("producer", {**COORDS, "do_remote_prefill": True}),  # a decode leg sent to P
    ("producer", {"do_remote_decode": True, "transfer_id": ["x"]}),
])
def test_bad_params_fail_as_a_load_at_once_and_free_their_blocks(role, params):
    s = SchedulerSide(settings(role))
    r = request(D_ID, params)
    assert s.get_num_new_matched_tokens(r, 8) == (32, True)  # the uncached tokens, loaded "asynchronously"
    s.update_state_after_alloc(r, blocks([3, 4]), 32)
    meta = s.build_connector_meta(None)
    assert [op.req_id for op in meta.rejects] == [D_ID] and not meta.recvs and not meta.sends
    assert meta.rejects[0].block_ids == (3, 4) and meta.rejects[0].reason
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)  # recompute policy: computed here, asked once
    assert s.request_finished(r, [3, 4]) == (False, None)
    assert not s._rejecting and D_ID not in s._handled and not s.has_pending_push_work()
    cached = SchedulerSide(settings(role))  # everything cached here: nothing to claim
    assert cached.get_num_new_matched_tokens(request("x", params), 40) == (0, False)


class FakeWorker:
    def transfer_results(self, finished_req_ids):
        return compat.TransferResults()


@pytest.mark.parametrize("version, blocks_reported", [((0, 24, 0), {3, 4}), ((0, 32, 0), set())])
def test_the_connector_reports_a_rejected_load_failed_on_either_release(version, blocks_reported):
    from kvpush_common.vllm.metadata import RejectOp

    conn = object.__new__(KVPushConnector)
    conn._connector_metadata = None
    conn._worker, conn._load_errors = FakeWorker(), LoadErrors(Features.of(version))
    conn.bind_connector_metadata(KVPushMetadata(rejects=[RejectOp("bad", (3, 4), "malformed")]))
    res = conn.get_transfer_results(set())
    assert res.finished_recving == {"bad"} and res.failed_recving == {"bad"}
    assert conn.get_transfer_results(set()).finished_recving == set()  # reported once
    conn.bind_connector_metadata(KVPushMetadata(rejects=[RejectOp("bad2", (3, 4), "malformed")]))
    assert conn.get_finished(set()) == (None, {"bad2"})
    assert conn.get_block_ids_with_load_errors() == blocks_reported


def test_request_key_strips_only_vllms_suffix():
    assert request_key("cmpl-abc-0-deadbeef") == "cmpl-abc-0"
    assert request_key("chatcmpl-abc-deadbeef") == "chatcmpl-abc"
    assert request_key("cmpl-abc-0") == "cmpl-abc-0"  # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION



def _json_values():
    leaf = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=40)
    return st.recursive(leaf, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                                         max_size=4), max_leaves=12)


KEYS = ["do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_host", "remote_port", "tp_size", "pp_size",
        "dcp_size", "remote_request_id", "transfer_id", "transfer_mode", "kvpush", "producer", "attempt"]


@settings_(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), _json_values(), max_size=8),
       st.sampled_from(["push", "pull", None]))
def test_any_json_params_give_a_leg_a_bad_leg_or_none_never_an_exception(params, mode):
    leg = read_leg(params, D_ID, mode)
    assert leg is None or isinstance(leg, (PrefillLeg, DecodeLeg, IdentityProbe, BadLeg))
    for role in ("producer", "consumer"):
        check_role(leg, role)
