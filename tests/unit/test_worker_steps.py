"""A worker step never loses work to an unexpected exception: each unit (inbox item, notification,
action) is guarded, and what the step already decided is still acted on."""

from kvpush_common.endpoint.config import EndpointConfig
from kvpush_common.endpoint.consumer import ConsumerEndpoint
from kvpush_common.protocol.legs import ProducerIdentity
from kvpush_common.endpoint.base import Peer
from kvpush_common.device.host import HostBackend
from kvpush_common.protocol.identity import TransferKey
from kvpush_common.endpoint.producer import ProducerEndpoint


class Flaky:
    """A transport whose send_notif and get_notifs raise unexpected errors on demand."""

    def __init__(self):
        self.fail_fetch = False
        self.fail_send = False
        self.sent = []

    def get_notifs(self):
        if self.fail_fetch:
            raise RuntimeError("bug in fetch")
        return {}

    def send_notif(self, peer, msg):
        if self.fail_send:
            raise RuntimeError("bug in send")
        self.sent.append(msg)

    def remove_peer(self, name):
        pass


def backend():
    return HostBackend(num_layers=1, num_heads=1, head_dim=4, block_size=4, num_blocks=8)


def test_consumer_results_decided_before_an_exception_are_delivered():
    ep = ConsumerEndpoint(EndpointConfig(engine_id="D", handshake_timeout_s=0.2), backend())
    ep.transport = t = Flaky()
    ep._peers[("P", 0)] = Peer("P", 0, 1, "P/r0", ep.layout)
    ref = ProducerIdentity(engine_id="P", host="127.0.0.1", port=1, tp_size=1)
    t.fail_send = True  # the first registration's send raises something unexpected
    ep.expect("a", 0, ref, [0], 4)
    ep.expect("b", 0, ref, [1], 4)
    ep.expect("bad", 0, ref, [2], 4, first_token=8)  # refused at once: Received(ok=False) in this step
    t.fail_fetch = True  # and the fetch after the drain raises too
    try:
        ep._step()
    except RuntimeError:
        pass
    # every inbox item was handled (none dropped with the step) ...
    assert TransferKey("a", 0) in ep.completion and TransferKey("b", 0) in ep.completion
    # ... and the result decided before the fetch raised reached the engine
    assert [(r.key.transfer_id, r.ok) for r in ep.take_finished()] == [("bad", False)]
    ep.close()


def test_producer_start_write_that_raises_still_gets_a_result():
    p = ProducerEndpoint(EndpointConfig(engine_id="P"), backend())
    p.transport = t = Flaky()
    d = backend()
    p._peers[("D", 0)] = Peer("D", 0, 1, "D/r0", d.layout())

    def boom(*a, **k):
        raise RuntimeError("bug in planning")

    p._post_if_fenced = boom
    from kvpush_common.protocol.wire import Codec, Register

    reg = Register(transfer_id="t", attempt=0, consumer_engine="D", consumer_rank=0, consumer_tp=1, block_ids=[0],
                   first_token=0, num_tokens=4, ttl_ms=5000)
    t.get_notifs = lambda: {"D/r0": [Codec().encode(reg)]}
    p.kv_ready("t", 0, [1], 4)
    p._step()
    t.get_notifs = lambda: {}
    p._step()
    out = p.take_finished()
    assert [r.outcome.value for r in out] == ["failed"]  # blocks released, not held for ever
    assert any(b"post_failed" in m for m in t.sent)  # and the consumer is told
    assert p.stats.worker_errors._value.get() == 1


def test_the_producer_polls_faster_only_while_its_write_is_on_the_wire():
    """NIXL completes a WRITE, and notifies the consumer, only from the producer's progress calls: while one
    is on the wire the worker steps every `write_poll_s`, otherwise at its usual periods (`wire_poll_s` is the
    consumer's)."""
    import pytest

    from kvpush_common.endpoint.transfers import AwaitingFence, DirectWrite

    cfg = EndpointConfig(engine_id="P", poll_s=0.001, idle_poll_s=0.01, wire_poll_s=0.0003, write_poll_s=0.0002)
    p = ProducerEndpoint(cfg, backend())
    assert p._poll_period(False) == 0.01 and p._poll_period(True) == 0.001
    p._inflight.append(AwaitingFence(None, 0.0, 1.0))  # waiting for the device: nothing on the wire yet
    assert p._poll_period(True) == 0.001
    p._inflight.append(DirectWrite(None, 0.0, 1.0))
    assert p._poll_period(True) == 0.0002
    for name in ("wire_poll_s", "write_poll_s"):
        with pytest.raises(ValueError, match=name):
            EndpointConfig(engine_id="P", **{name: 0}).validate()


def test_a_consumer_waiting_for_bytes_is_woken_by_each_engine_step():
    """While a key waits for its WriteDone the engine's per-step hook (`engine_step`) wakes the worker to fetch
    notifications, as vLLM's own decode checks them once per step; between steps it sleeps `wire_poll_s` (no 0.2
    ms poll taking the GIL beside every decode step).  With nothing open the hook wakes nothing."""
    ep = ConsumerEndpoint(EndpointConfig(engine_id="D", wire_poll_s=0.005, poll_s=0.001, idle_poll_s=0.01), backend())
    ep.transport = Flaky()
    ep._peers[("P", 0)] = Peer("P", 0, 1, "P/r0", ep.layout)
    assert ep._step() is False and ep._poll_period(False) == 0.01
    ep.engine_step()
    assert not ep._wake.is_set()
    ep.expect("a", 0, ProducerIdentity(engine_id="P", host="127.0.0.1", port=1, tp_size=1), [0], 4)
    ep._wake.clear()
    assert ep._step() is True and ep._poll_period(True) == 0.005  # not shortened to poll_s
    ep.engine_step()
    assert ep._wake.is_set()
    ep.close()


def test_a_producer_waiting_only_for_its_engines_kv_does_not_poll():
    """A registration waiting for KV needs no fast poll: kv_ready wakes the worker.  Ready KV waiting for its
    registration (a notification) does, at poll_s."""
    from kvpush_common.protocol.wire import Register

    p = ProducerEndpoint(EndpointConfig(engine_id="P", poll_s=0.001, idle_poll_s=0.01), backend())
    p.transport = Flaky()
    reg = Register(transfer_id="a", attempt=0, consumer_engine="D", consumer_rank=0, consumer_tp=1, block_ids=[0],
                   first_token=0, num_tokens=4, ttl_ms=30000)
    p.rendezvous.on_register(reg, 0.0, 0.0)
    assert p.rendezvous.has_unmatched() and p._step() is False and p._poll_period(False) == 0.01
    q = ProducerEndpoint(EndpointConfig(engine_id="P", poll_s=0.001, idle_poll_s=0.01), backend())
    q.transport = Flaky()
    q.kv_ready("b", 0, [1], 4, written=True)
    assert q._step() is True and q._poll_period(True) == 0.001
