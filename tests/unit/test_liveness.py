"""Consumer liveness (common/endpoint/liveness.py): a producer rank is gone only when NIXL cannot reach it AND its
side channel refuses connections; then every key waiting on it ends at once, naming it.  Driven by hand on an
endpoint that is not started (a stub transport, the probes run inline)."""

from __future__ import annotations

import socket

import pytest

from kvpush_common.device.host import HostBackend
from kvpush_common.endpoint.base import Peer
from kvpush_common.endpoint.config import EndpointConfig
from kvpush_common.endpoint.consumer import ConsumerEndpoint
from kvpush_common.endpoint.inbox import ProbeResult
from kvpush_common.endpoint.liveness import probe_side_channel
from kvpush_common.protocol.identity import TransferKey
from kvpush_common.protocol.wire import Heartbeat
from kvpush_common.state.completion import Received
from kvpush_common.transport.nixl import TransportError

PROD = ("P", 0)
K = TransferKey("t", 0)


class StubTransport:
    def __init__(self):
        self.down = False
        self.removed: list[str] = []
        self.sent: list[str] = []

    def send_notif(self, agent, msg):
        if self.down:
            raise TransportError("NIXL send_notif failed: nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT")
        self.sent.append(agent)

    def remove_peer(self, agent):
        self.removed.append(agent)


class InlinePool:
    def __init__(self):
        self.submitted = []

    def submit(self, fn, *args):
        self.submitted.append((fn.__name__, args))

    def shutdown(self, **kw):
        pass


@pytest.fixture
def ep():
    backend = HostBackend(num_layers=1, num_heads=1, head_dim=4, block_size=4, num_blocks=4)
    e = ConsumerEndpoint(EndpointConfig(engine_id="D"), backend)
    e._pool.shutdown()
    e._pool = InlinePool()
    e.transport = StubTransport()
    e._peers[PROD] = Peer("P", 0, 1, "P/r0", backend.layout())
    e._addr[PROD] = ("127.0.0.1", 1)
    assert e.completion.start(K, frozenset({PROD}), 0.0) == []
    e.completion.on_registered(K, PROD)
    return e


def heartbeat(e):
    return e._send(e._peers[PROD], Heartbeat(consumer_engine="D", consumer_rank=0, keys=[]))


def test_a_refused_side_channel_after_a_nixl_failure_ends_the_keys_at_once(ep):
    ep.transport.down = True
    assert heartbeat(ep) is False and PROD in ep._unreachable
    ep._check_liveness()
    assert ep._pool.submitted == [("_probe", (PROD, ("127.0.0.1", 1)))]
    ep._check_liveness()  # one probe at a time per rank
    assert len(ep._pool.submitted) == 1
    out = ep._on_probe(ProbeResult(PROD, True, "its side channel refuses connections (the process exited)"), 1.0)
    assert len(out) == 1 and isinstance(out[0], Received) and out[0].key == K and not out[0].ok
    assert "producer rank 0 is gone" in out[0].reason and "NIXL_ERR_REMOTE_DISCONNECT" in out[0].reason
    assert "refuses connections" in out[0].reason
    assert PROD not in ep._peers and ep.transport.removed == ["P/r0"]  # the next request handshakes anew
    assert len(ep.completion) == 0 and ep.stats.peers_gone._value.get() == 1


def test_an_accepting_side_channel_keeps_the_keys_and_asks_who_is_there(ep):
    ep.transport.down = True
    heartbeat(ep)
    ep._expects[K] = type("E", (), {"producer": type("R", (), {"engine_id": "P"})()})()
    assert ep._on_probe(ProbeResult(PROD, False, "its side channel accepts connections"), 1.0) == []
    assert K in ep.completion and PROD in ep._peers  # a paused or live process may still write: no early end
    assert PROD in ep._suspect
    assert [name for name, _ in ep._pool.submitted] == ["_handshake"]  # a successor there would be found


def test_no_nixl_failure_no_probe_and_a_refusal_alone_proves_nothing(ep):
    assert heartbeat(ep) is True
    ep._check_liveness()
    assert ep._pool.submitted == []
    # reached again between the failed send and the probe's answer: the refusal is not acted on
    ep.transport.down = True
    heartbeat(ep)
    ep.transport.down = False
    heartbeat(ep)
    assert ep._on_probe(ProbeResult(PROD, True, "refused"), 1.0) == [] and K in ep.completion


def test_ranks_no_key_waits_on_are_not_probed(ep):
    ep.transport.down = True
    heartbeat(ep)
    ep.completion.abort(K, "engine gave up", 1.0)  # now failing: it still waits for P's last word
    ep._check_liveness()
    assert len(ep._pool.submitted) == 1
    ep._pool.submitted.clear()
    ep._probing.clear()
    ep.completion.on_revoke_ack(K, PROD, 2.0)  # answered: nothing waits on P any more
    ep._check_liveness()
    assert ep._pool.submitted == []


def test_probe_tells_a_closed_port_from_a_listening_one():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        assert probe_side_channel(("127.0.0.1", port), 2.0)[0] is False
    finally:
        listener.close()
    refused, detail = probe_side_channel(("127.0.0.1", port), 2.0)
    assert refused and "refuses connections" in detail


def test_a_rank_that_owes_only_a_revoke_ack_is_still_heartbeaten(ep):
    ep.completion.abort(K, "engine gave up", 1.0)  # failing, P in doubt: no key waits for its bytes any more
    assert ep.completion.waiting_keys() == {}
    ep._heartbeat()
    assert ep.transport.sent == ["P/r0"]  # a send is what tells whether NIXL can still reach it


def test_a_producer_whose_worker_did_not_stop_keeps_its_side_channel_open():
    """Consumers take a refused side channel as proof that nothing can be written: it must not close while the
    worker (and its NIXL agent) may still run."""
    import threading

    from kvpush_common.endpoint.producer import ProducerEndpoint

    backend = HostBackend(num_layers=1, num_heads=1, head_dim=4, block_size=4, num_blocks=4)
    p = ProducerEndpoint(EndpointConfig(engine_id="P"), backend)
    closed = []
    p.server = type("S", (), {"close": lambda self: closed.append(True)})()
    stuck = threading.Event()
    p._thread = threading.Thread(target=stuck.wait, daemon=True)
    p._thread.start()
    p._before_close()
    assert closed == []
    stuck.set()
    p._thread.join()
    p._before_close()
    assert closed == [True]


def test_a_pull_read_of_ours_still_posted_keeps_its_key_until_it_settles(ep):
    from kvpush_common.endpoint.consumer_pull import _Read

    ep.transport.down = True
    heartbeat(ep)
    ep._reads.append(_Read(K, PROD, object(), 0.0, 30.0))
    assert ep._on_probe(ProbeResult(PROD, True, "refused"), 1.0) == [] and K in ep.completion
