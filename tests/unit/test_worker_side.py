"""WorkerSide's bookkeeping of finished requests: a producer reports a send finished only once vLLM named the
request finished and the push released its blocks (either order); ids of requests with no send are not
kept (vLLM names every finished request on every rank: a decode instance would otherwise hold them all)."""

from collections import deque

from kvpush_common.endpoint.metrics import EndpointStats
from kvpush_common.protocol.identity import TransferKey
from kvpush_common.state.rendezvous import Outcome, Release
from kvpush_common.testing.vllm_config import parallel_config
from kvpush_common.vllm.metadata import KVPushMetadata, SendOp
from kvpush_common.vllm.worker import WorkerSide


class StubEndpoint:
    def __init__(self):
        self.results = deque()
        self.stats = EndpointStats("P", "producer")

    def event(self, *a, **k):
        pass

    def kv_ready(self, *a, **k):
        pass

    def engine_step(self):
        self.steps = getattr(self, "steps", 0) + 1

    def take_finished(self):
        out, self.results = list(self.results), deque()
        return out


def worker():
    w = WorkerSide(settings=type("S", (), {"kv_fence": "step"})(), rank=0, make_backend=None)
    w._bind(StubEndpoint())
    return w


def send(w, req, tid):
    w.start_load_kv(KVPushMetadata(sends=[SendOp(req, tid, 0, (1, 2), 32)]))


def test_a_send_is_reported_after_both_its_release_and_its_finish_in_either_order():
    w = worker()
    send(w, "a", "ta")
    send(w, "b", "tb")
    assert w.transfer_results({"a"}).finished_sending == set()  # finished, not released yet
    w.endpoint.results += [Release(TransferKey("ta", 0), Outcome.DONE), Release(TransferKey("tb", 0), Outcome.DONE)]
    assert w.transfer_results(set()).finished_sending == {"a"}  # b released, not named finished yet
    assert w.transfer_results({"b"}).finished_sending == {"b"}
    assert not (w._finished_reqs or w._released or w._sending)
    # the engine thread's time in each hook is observed once per call (kvpush_engine_hook_seconds)
    counts = {s.labels["hook"]: s.value for m in w.endpoint.stats.registry.collect() for s in m.samples
              if s.name == "kvpush_engine_hook_seconds_count"}
    assert counts == {"start_load_kv": 2.0, "transfer_results": 3.0}
    assert w.endpoint.steps == 2  # each step offers the endpoint its wake-up (a waiting consumer fetches then)


def test_requests_with_no_send_are_forgotten():
    w = worker()
    for i in range(100):
        w.transfer_results({f"decode-{i}"})
    assert w._finished_reqs == set() and w._finished_unsent == {"decode-99"}  # one step's grace, no more
    w.transfer_results(set())
    assert not (w._finished_reqs or w._finished_unsent)


def test_an_id_named_finished_one_step_before_its_send_is_still_reported():
    w = worker()
    w.transfer_results({"a"})
    send(w, "a", "ta")
    w.endpoint.results.append(Release(TransferKey("ta", 0), Outcome.DONE))
    assert w.transfer_results(set()).finished_sending == {"a"}


def test_poll_periods_come_from_the_connector_configs_tuning():
    from types import SimpleNamespace

    from kvpush_common.vllm.settings import ConnectorSettings

    kt = SimpleNamespace(kv_role="kv_producer", engine_id="p0",
                         kv_connector_extra_config={"tuning": {"wire_poll_s": 0.0005, "write_poll_s": 0.0001,
                                                               "poll_s": 0.002}})
    model = SimpleNamespace(served_model_name="m", model="m", get_total_num_kv_heads=lambda: 8)
    cfg = SimpleNamespace(kv_transfer_config=kt, model_config=model, parallel_config=parallel_config(1))
    ep = ConnectorSettings.from_vllm(cfg).endpoint_config(0)
    assert (ep.wire_poll_s, ep.write_poll_s, ep.poll_s, ep.idle_poll_s) == (0.0005, 0.0001, 0.002, 0.01)


def test_a_hook_call_over_the_goal_is_logged_with_what_the_step_handed_over(monkeypatch):
    """The event log names the slow steps (`slow_hook`), so a GPU run can tell receive/send steps from others."""
    import kvpush_common.vllm.worker as worker_module

    w = worker()
    seen = []
    w.endpoint.event = lambda ev, key, **extra: seen.append((ev, key, extra))
    monkeypatch.setattr(worker_module, "SLOW_HOOK_S", 1e9)  # no call is slow
    send(w, "a", "ta")
    assert not [e for e in seen if e[0] == "slow_hook"]
    monkeypatch.setattr(worker_module, "SLOW_HOOK_S", -1.0)  # every call counts as slow
    send(w, "b", "tb")
    w.start_load_kv(KVPushMetadata())
    slow = [(key, extra) for ev, key, extra in seen if ev == "slow_hook"]
    assert slow[0][0] == TransferKey("tb", 0) and slow[0][1]["sends"] == 1 and slow[0][1]["recvs"] == 0
    assert slow[0][1]["hook"] == "start_load_kv" and slow[0][1]["us"] >= 0
    assert slow[1][0] == TransferKey("-", 0) and slow[1][1]["sends"] == 0
