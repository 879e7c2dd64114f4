"""A prefill instance restarted on the same side channel under a new engine id (issue 31, drop-in contract).

A leg in vLLM's NIXL contract names the producer by its address (the engine id is what a proxy cached from an
earlier answer): the decode follows the address to the engine answering there now.  A kvpush leg names the
engine `kvpush router` verified: it fails at the handshake as before (the router asks D and retries).  Nothing
registered with the old engine is ever re-pointed, and the old process's keys end at once.  The consumer runs
its real handshake against a real side channel on 127.0.0.1 (ZMQ); NIXL is faked.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest
from vllm.v1.request import RequestStatus

from kvpush_common.device.host import HostBackend
from kvpush_common.endpoint.config import EndpointConfig
from kvpush_common.endpoint.consumer import ConsumerEndpoint
from kvpush_common.endpoint.handshake import HandshakeServer
from kvpush_common.protocol.identity import TransferKey
from kvpush_common.protocol.legs import ProducerIdentity
from kvpush_common.protocol.wire import Codec, Register, WriteDone
from kvpush_common.state.completion import Completion
from kvpush_common.vllm.scheduler import SchedulerSide

SECRET = b"k"


class FakeNixl:
    """What the consumer asks of NIXL here: peers by metadata, notifications out and in."""

    def __init__(self):
        self.sent: list[tuple[str, object]] = []
        self.inbox: dict[str, list[bytes]] = {}
        self.removed: list[str] = []
        self.dead: set[str] = set()  # agents whose process exited: a notification to one raises, as NIXL's does

    def add_peer(self, md: bytes) -> str:
        return md.decode()

    def remove_peer(self, name: str) -> None:
        self.removed.append(name)

    def send_notif(self, peer: str, msg: bytes) -> None:
        if peer in self.dead:
            raise RuntimeError("NIXL send_notif failed: nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT")
        self.sent.append((peer, Codec(SECRET).decode(msg)))

    def get_notifs(self):
        out, self.inbox = self.inbox, {}
        return out


def backend():
    return HostBackend(num_layers=1, num_heads=1, head_dim=4, block_size=4, num_blocks=8)


@pytest.fixture
def side():
    """D (not started: fake NIXL) and a producer side channel on 127.0.0.1 whose engine id a test sets."""
    d = ConsumerEndpoint(EndpointConfig(engine_id="D", secret=SECRET, handshake_timeout_s=5), backend())
    d.transport = FakeNixl()
    who = {"engine": "P-old"}

    def hello():
        h = d.local_hello()
        name = f"{who['engine']}/r0"
        return msgspec.structs.replace(h, engine_id=who["engine"], role="producer", agent_name=name,
                                       agent_metadata=name.encode())

    server = HandshakeServer("127.0.0.1", 0, SECRET, hello, lambda h: None).start()
    yield SimpleNamespace(d=d, who=who, port=server.port,
                          ref=lambda engine: ProducerIdentity(engine_id=engine, host="127.0.0.1", port=server.port,
                                                              tp_size=1))
    server.close()
    d.close()


def steps(d: ConsumerEndpoint, until, limit_s: float = 5.0):
    """Worker steps (handshakes run on its pool) until `until()` holds."""
    deadline = time.monotonic() + limit_s
    while not until():
        assert time.monotonic() < deadline, "condition not reached"
        d._step()
        time.sleep(0.01)


def registrations(d):
    return [(peer, m.transfer_id) for peer, m in d.transport.sent if isinstance(m, Register)]


def write_done(d, engine: str, tid: str):
    msg = WriteDone(transfer_id=tid, attempt=0, producer_engine=engine, producer_rank=0, nbytes=1, num_descs=1)
    d.transport.inbox.setdefault(f"{engine}/r0", []).append(Codec(SECRET).encode(msg))


def test_a_nixl_leg_follows_its_producers_address_to_the_restarted_engine(side):
    d = side.d
    side.who["engine"] = "P-new"  # P restarted; the proxy still names the engine it learned before
    d.expect("t1", 0, side.ref("P-old"), [0, 1], 8, follow_address=True)
    steps(d, lambda: registrations(d))
    assert registrations(d) == [("P-new/r0", "t1")]  # registered with the engine serving the address
    write_done(d, "P-old", "t1")  # a claim in the old engine's name is no sender D knows: dropped
    write_done(d, "P-new", "t1")
    finished = []
    steps(d, lambda: finished.extend(d.take_finished()) or finished)
    assert [(r.key, r.ok) for r in finished] == [(TransferKey("t1", 0), True)]
    # a later leg still naming the old engine goes straight to the new one: no second handshake, and the event log
    # says it followed, as for the first
    logged = []
    d.event = lambda ev, key, **kw: logged.append((ev, key.transfer_id, kw))
    d.expect("t2", 0, side.ref("P-old"), [2], 4, follow_address=True)
    d._step()
    assert registrations(d)[-1] == ("P-new/r0", "t2")
    assert ("followed", "t2", {"old_engine": "P-old", "new_engine": "P-new"}) in logged, logged


def test_a_nixl_leg_whose_registration_could_not_reach_the_dead_engine_follows_too(side):
    """D knew the old engine (a peer it talked to): the registration's send to it raises (the process is gone),
    the handshake again finds the new engine there, and the request follows it."""
    d = side.d
    d.expect("t0", 0, side.ref("P-old"), [0], 4, follow_address=True)
    steps(d, lambda: registrations(d))
    write_done(d, "P-old", "t0")
    steps(d, lambda: d.take_finished())
    d.transport.dead.add("P-old/r0")
    side.who["engine"] = "P-new"
    d.expect("t1", 0, side.ref("P-old"), [1, 2], 8, follow_address=True)
    steps(d, lambda: len(registrations(d)) == 2)
    assert registrations(d)[-1] == ("P-new/r0", "t1") and not d.take_finished()  # still waiting for its bytes
    assert ("P-old", 0) not in d._peers


def test_a_kvpush_leg_naming_a_replaced_engine_fails_at_the_handshake_as_before(side):
    d = side.d
    side.who["engine"] = "P-new"
    d.expect("t1", 0, side.ref("P-old"), [0, 1], 8)  # kvpush contract: the router's verified identity
    finished = []
    steps(d, lambda: finished.extend(d.take_finished()) or finished)
    [r] = finished
    assert not r.ok and "expected producer P-old rank 0 of TP 1, found P-new rank 0 of TP 1" in r.reason
    assert not registrations(d)


def test_keys_owed_by_the_old_process_end_at_once_and_nothing_registered_with_it_moves(side):
    d = side.d
    d.expect("before", 0, side.ref("P-old"), [0, 1], 8, follow_address=True)
    steps(d, lambda: registrations(d))  # registered with P-old, which then dies before writing
    side.who["engine"] = "P-new"  # it comes back on the same side channel
    d.expect("after", 0, side.ref("P-new"), [2], 4, follow_address=True)  # a proxy that re-learned already
    finished = []
    steps(d, lambda: finished.extend(d.take_finished()) or finished)
    [r] = finished
    assert r.key == TransferKey("before", 0) and not r.ok and "replaced" in r.reason  # no fence wait, no re-point
    assert registrations(d) == [("P-old/r0", "before"), ("P-new/r0", "after")]
    assert "P-old/r0" in d.transport.removed and ("P-old", 0) not in d._peers


def test_completion_repoints_only_a_key_nothing_was_registered_for():
    c = Completion(transfer_timeout_s=10, fence_wait_s=5)
    k, old, new = TransferKey("t", 0), frozenset({("A", 0)}), frozenset({("B", 0)})
    c.start(k, old, 0.0)
    assert c.repoint(k, new) and c.on_done(k, ("A", 0), 1.0) == []  # the old engine counts no more
    c.on_registered(k, ("B", 0))
    assert not c.repoint(k, old)  # registered: bytes may come from B, it stays B's
    assert [r.ok for r in c.on_done(k, ("B", 0), 2.0)] == [True]


def nixl_decode_params(engine: str, tid: str) -> dict:
    return {"do_remote_prefill": True, "remote_engine_id": engine, "remote_host": "10.0.0.7", "remote_port": 5700,
            "tp_size": 1, "remote_request_id": "r", "transfer_id": tid}


def test_the_scheduler_marks_nixl_legs_to_follow_the_address_and_serves_a_resent_leg_from_its_cache():
    """llm-d resends the decode leg with P's answer (same transfer_id) when P answered as another engine: the
    second request finds the key's receive ended and computes what its prefix cache lacks, never fails."""
    s = SchedulerSide(SimpleNamespace(role="consumer", engine_id="D", mode="push", host="h", port=1, tp_size=1,
                                      local_prefill_max_tokens=0, stream_layers=False))
    first = SimpleNamespace(request_id="cmpl-a-0-11111111", kv_transfer_params=nixl_decode_params("P-old", "x1"),
                            num_prompt_tokens=40, status=RequestStatus.RUNNING)
    assert s.get_num_new_matched_tokens(first, 0) == (40, True)
    s.update_state_after_alloc(first, SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: [[1, 2, 3]]), 40)
    (op,) = s.build_connector_meta(None).recvs
    assert op.follow_address and op.producer.engine_id == "P-old"
    s.update_connector_output(SimpleNamespace(finished_recving={first.request_id}, finished_sending=set(),
                                              failed_recving=set(), invalid_block_ids=set()))
    again = SimpleNamespace(request_id="cmpl-a-0-22222222", kv_transfer_params=nixl_decode_params("P-new", "x1"),
                            num_prompt_tokens=40, status=RequestStatus.RUNNING)
    assert s.get_num_new_matched_tokens(again, 32) == (0, False)  # its cached blocks, the rest computed here
    kvpush = {"kvpush": "decode", "transfer_id": "k1", "producer": {"engine_id": "P", "host": "h", "port": 1,
                                                                   "tp_size": 1}}
    r = SimpleNamespace(request_id="cmpl-b-0-33333333", kv_transfer_params=kvpush, num_prompt_tokens=8,
                        status=RequestStatus.RUNNING)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: [[4, 5]]), 8)
    (op,) = s.build_connector_meta(None).recvs
    assert not op.follow_address
