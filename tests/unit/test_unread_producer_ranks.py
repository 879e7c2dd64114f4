"""Issue 16 item 1: a prefill rank that no decode rank reads from (head replication: prefill TP above the
model's KV heads, decode TP smaller) releases its KV at once when it knows the decode TP, instead of
holding it until the lease ends (vLLM frees a request's blocks only when every TP worker is done)."""

import pytest

from kvpush_common.device.host import HostBackend
from kvpush_common.endpoint.config import EndpointConfig
from kvpush_common.endpoint.producer import ProducerEndpoint
from kvpush_common.protocol.identity import TransferKey
from kvpush_common.protocol.topology import local_heads, routes_from
from kvpush_common.state.rendezvous import Outcome, ReadyKV, Release, Rendezvous, SendFailed
from kvpush_common.protocol.wire import Register

K = TransferKey("t", 0)


class Quiet:
    def get_notifs(self):
        return {}


def producer(rank: int, tp: int, kv_heads: int) -> ProducerEndpoint:
    cfg = EndpointConfig(engine_id="P", rank=rank, tp_size=tp, total_kv_heads=kv_heads, lease_s=30.0)
    first, count = local_heads(kv_heads, tp, rank)
    p = ProducerEndpoint(cfg, HostBackend(num_layers=1, num_heads=count, head_dim=4, block_size=4, num_blocks=8,
                                          head_offset=first))
    p.transport = Quiet()
    return p


@pytest.mark.parametrize("kv_heads,p_tp,d_tp", [(2, 4, 2), (8, 16, 8), (1, 4, 1), (2, 8, 1), (4, 8, 2)])
def test_unread_ranks_release_at_once_and_read_ranks_wait(kv_heads, p_tp, d_tp):
    unread = [r for r in range(p_tp) if not routes_from(kv_heads, p_tp, d_tp, r)]
    assert unread, "the case must replicate heads and leave some prefill rank unread"
    for rank in range(p_tp):
        p = producer(rank, p_tp, kv_heads)
        p.kv_ready("t", 0, [1, 2], 8, written=True, consumer_tp=d_tp)
        p._step()
        out = p.take_finished()
        if rank in unread:
            assert [(r.key, r.outcome) for r in out] == [(K, Outcome.DONE)], rank
            assert p.rendezvous.entry_state(K) is None
        else:  # waits for the registration of the decode rank that reads from it
            assert out == [] and p.rendezvous.entry_state(K)["ready"], rank


def test_without_the_decode_tp_an_unread_rank_holds_its_kv_until_the_lease():
    p = producer(1, 4, 2)
    p.kv_ready("t", 0, [1, 2], 8, written=True)
    p._step()
    assert p.take_finished() == [] and p.rendezvous.entry_state(K)["ready"]


def reg(rank=0, tp=2):
    return Register(transfer_id="t", attempt=0, consumer_engine="D", consumer_rank=rank, consumer_tp=tp,
                    block_ids=[1], first_token=0, num_tokens=8, ttl_ms=5000)


def test_rendezvous_on_unread_ends_the_key_and_refuses_a_late_registration():
    rv = Rendezvous(expected_dests=lambda engine, tp: frozenset(), lease_s=10.0)
    assert rv.on_unread(K, ReadyKV((1,), 8, None), 0.0, "no reader") == [Release(K, Outcome.DONE, "no reader")]
    assert len(rv) == 0
    late = rv.on_register(reg(), 1.0)
    assert [type(a) for a in late] == [SendFailed] and late[0].code == "stale"


def test_rendezvous_on_unread_with_a_live_entry_takes_the_normal_path():
    rv = Rendezvous(expected_dests=lambda engine, tp: frozenset({("D", 0)}), lease_s=10.0)
    rv.on_register(reg(tp=1), 0.0)  # a registration came after all (the router's TP was stale)
    out = rv.on_unread(K, ReadyKV((1,), 8, None), 0.5, "no reader")
    assert [type(a).__name__ for a in out] == ["StartWrite"]
