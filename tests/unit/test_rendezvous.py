"""Producer rendezvous: each documented path, then random interleavings against a model.

Invariants checked after every step of the state machine:
  1. a key with ready KV gets exactly one Release, and the table drains once time runs past every
     lease/TTL and all in-flight writes finish;
  2. StartWrite at most once per (key, dest), never after that dest revoked, never for an attempt older
     than one already seen, never after the key was released or locally aborted, never on an expired
     registration, with reg and ready of the same key;
  3. SendRevokeAck for a dest only while no write into it is in flight;
  5. Release(DONE) only when every expected dest's write succeeded.
Also: no Release and no SendFailed for a dest while a write of that key / into that dest is in flight.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpush_common.protocol.identity import AttemptFloor, TransferKey
from kvpush_common.state.rendezvous import (Outcome, ReadyKV, Release, Rendezvous, SendFailed, SendRevokeAck,
                                      StartWrite)
from kvpush_common.protocol.wire import Register

LEASE = 10.0
TTL_MS = 5_000


def expected_dests(engine: str, tp: int) -> frozenset:
    """This producer rank writes every consumer rank when the consumer has TP 2 or less, else ranks 0-1."""
    return frozenset((engine, r) for r in range(min(tp, 2)))


def reg(tid="t", attempt=0, engine="D", rank=0, tp=1, ttl_ms=TTL_MS, blocks=(1, 2)) -> Register:
    return Register(transfer_id=tid, attempt=attempt, consumer_engine=engine, consumer_rank=rank, consumer_tp=tp,
                    block_ids=list(blocks), first_token=0, num_tokens=20, ttl_ms=ttl_ms)


READY = ReadyKV((7, 8), 20, fence="f")
K = TransferKey("t", 0)
D0, D1 = ("D", 0), ("D", 1)


def make(**kw) -> Rendezvous:
    return Rendezvous(expected_dests=expected_dests, lease_s=LEASE, **kw)


def kinds(actions):
    return [type(a).__name__ for a in actions]


def only(actions, cls):
    return [a for a in actions if isinstance(a, cls)]


# ---- documented paths --------------------------------------------------------------------------------
def test_registration_first():
    rv = make()
    assert rv.on_register(reg(), 0.0) == []
    assert rv.has_unmatched() and rv.entry_state(K)["pending"] == [D0]
    acts = rv.on_ready(K, READY, 1.0)
    assert acts == [StartWrite(K, D0, reg(), READY)]
    assert rv.entry_state(K)["writing"] == [D0]
    assert rv.on_write_result(K, D0, True, 2.0) == [Release(K, Outcome.DONE)]
    assert len(rv) == 0 and rv.entry_state(K) is None
    # ended: late messages about the key are refused
    assert kinds(rv.on_register(reg(rank=0), 3.0)) == ["SendFailed"]
    assert rv.on_write_result(K, D0, True, 3.0) == []


def test_ready_first():
    rv = make()
    assert rv.on_ready(K, READY, 0.0) == []
    assert rv.entry_state(K)["ready"] and rv.has_unmatched()
    acts = rv.on_register(reg(), 1.0)
    assert acts == [StartWrite(K, D0, reg(), READY)]
    assert rv.on_write_result(K, D0, True, 2.0) == [Release(K, Outcome.DONE)]
    assert len(rv) == 0


def test_multi_dest_consumer_tp2():
    rv = make()
    assert rv.on_register(reg(rank=0, tp=2), 0.0) == []
    acts = rv.on_ready(K, READY, 0.5)
    assert acts == [StartWrite(K, D0, reg(rank=0, tp=2), READY)]
    assert rv.on_write_result(K, D0, True, 1.0) == []  # rank 1 has not registered yet
    assert len(rv) == 1
    acts = rv.on_register(reg(rank=1, tp=2), 1.5)
    assert acts == [StartWrite(K, D1, reg(rank=1, tp=2), READY)]
    assert rv.on_write_result(K, D1, True, 2.0) == [Release(K, Outcome.DONE)]
    assert len(rv) == 0


def test_multi_dest_one_write_fails():
    rv = make()
    rv.on_ready(K, READY, 0.0)
    rv.on_register(reg(rank=0, tp=2), 0.0)
    rv.on_register(reg(rank=1, tp=2), 0.0)
    assert rv.entry_state(K)["writing"] == [D0, D1]
    assert rv.on_write_result(K, D1, False, 1.0) == []
    acts = rv.on_write_result(K, D0, True, 1.0)
    assert len(acts) == 1 and acts[0].outcome is Outcome.FAILED
    assert len(rv) == 0


def test_consumer_tp4_routes_two_of_four():
    rv = make()
    out = rv.on_register(reg(rank=3, tp=4), 0.0)
    assert kinds(out) == ["SendFailed"] and out[0].code == "not_routed"
    rv.on_ready(K, READY, 0.0)
    assert kinds(rv.on_register(reg(rank=0, tp=4), 0.0)) == ["StartWrite"]
    assert kinds(rv.on_register(reg(rank=1, tp=4), 0.0)) == ["StartWrite"]
    rv.on_write_result(K, D0, True, 1.0)
    assert rv.on_write_result(K, D1, True, 1.0) == [Release(K, Outcome.DONE)]


def test_stale_attempt_refused():
    rv = make()
    k1 = TransferKey("t", 1)
    rv.on_register(reg(attempt=1), 0.0)
    out = rv.on_register(reg(attempt=0), 0.1)
    assert kinds(out) == ["SendFailed"] and out[0].code == "stale" and out[0].key == K
    out = rv.on_ready(K, READY, 0.2)
    assert out == [Release(K, Outcome.FAILED, out[0].reason)] and "stale" in out[0].reason
    assert rv.entry_state(K) is None and rv.entry_state(k1)["pending"] == [D0]
    assert kinds(rv.on_ready(k1, READY, 0.3)) == ["StartWrite"]


def test_newer_attempt_supersedes_older_pending_registrations():
    rv = make()
    rv.on_register(reg(attempt=0, rank=0, tp=2), 0.0)
    rv.on_register(reg(attempt=0, rank=1, tp=2), 0.0)
    out = rv.on_register(reg(attempt=1, rank=0, tp=2), 1.0)
    fails = only(out, SendFailed)
    assert {(f.key, f.dest, f.code) for f in fails} == {(K, D0, "failed"), (K, D1, "failed")}
    assert all("superseded" in f.reason for f in fails)
    assert rv.entry_state(K) is None and len(rv) == 1
    assert kinds(rv.on_ready(K, READY, 1.1)) == ["Release"]  # the old execution's KV is refused


def test_newer_attempt_supersedes_older_ready():
    rv = make()
    rv.on_ready(K, READY, 0.0)
    out = rv.on_ready(TransferKey("t", 1), READY, 1.0)
    assert out == [Release(K, Outcome.FAILED, "superseded by attempt 1")]
    assert len(rv) == 1


def test_newer_attempt_waits_for_older_inflight_write():
    rv = make()
    rv.on_ready(K, READY, 0.0)
    rv.on_register(reg(), 0.0)
    k1 = TransferKey("t", 1)
    assert rv.on_register(reg(attempt=1), 1.0) == []  # older release deferred: its WRITE is in flight
    assert rv.entry_state(K)["writing"] == [D0]
    out = rv.on_write_result(K, D0, True, 2.0)
    assert out == [Release(K, Outcome.FAILED, "superseded by attempt 1")]  # never DONE once superseded
    assert kinds(rv.on_ready(k1, READY, 2.0)) == ["StartWrite"]


def test_duplicate_registration_ignored():
    rv = make()
    assert rv.on_register(reg(), 0.0) == []
    assert rv.on_register(reg(blocks=(9,)), 0.1) == []  # pending
    out = rv.on_ready(K, READY, 0.2)
    assert out == [StartWrite(K, D0, reg(), READY)]  # the first registration wins
    assert rv.on_register(reg(), 0.3) == []  # writing
    rv2 = make()
    rv2.on_ready(K, READY, 0.0)
    rv2.on_register(reg(rank=0, tp=2), 0.0)
    rv2.on_write_result(K, D0, True, 0.1)
    assert rv2.on_register(reg(rank=0, tp=2), 0.2) == []  # finished
    assert rv2.entry_state(K)["finished"] == {D0: True}


def test_duplicate_registration_of_superseded_key_while_writing_is_ignored():
    """A replayed registration must not get "stale" while its WRITE is in flight: the consumer would
    take that WriteFailed as "nothing more lands" and could free the blocks under the WRITE."""
    rv = make()
    rv.on_ready(K, READY, 0.0)
    rv.on_register(reg(), 0.0)
    rv.on_register(reg(attempt=1), 1.0)  # supersedes attempt 0, whose WRITE is in flight
    assert rv.on_register(reg(), 1.5) == []
    rv2 = make()
    rv2.on_ready(K, READY, 0.0)
    rv2.on_register(reg(), 0.0)
    rv2.on_revoke(TransferKey("t", 2), D0, 1.0)  # unknown newer attempt: floor rises above attempt 0
    assert rv2.on_register(reg(), 1.5) == []
    assert rv2.on_ready(K, ReadyKV((3,), 20), 1.6) == []  # nor a Release of the KV being read
    assert rv2.on_write_result(K, D0, True, 2.0) == [Release(K, Outcome.DONE)]


def test_duplicate_ready_keeps_first():
    rv = make()
    rv.on_ready(K, READY, 0.0)
    assert rv.on_ready(K, ReadyKV((1,), 20), 0.1) == []
    assert rv.on_register(reg(), 0.2) == [StartWrite(K, D0, reg(), READY)]


def test_revoke_before_registration_cancels_ready():
    rv = make()
    rv.on_ready(K, READY, 0.0)
    out = rv.on_revoke(K, D0, 1.0)
    assert out[0] == SendRevokeAck(K, D0)
    assert only(out, Release) == [Release(K, Outcome.CANCELLED, "revoked by consumer rank 0")]
    assert len(rv) == 0
    assert kinds(rv.on_register(reg(), 1.1)) == ["SendFailed"]


def test_unneeded_before_ready_releases_at_readiness():
    rv = make()
    assert rv.on_unneeded(K, D0, "tail computed here", 0.0) == []
    assert rv.on_ready(K, READY, 1.0) == [Release(K, Outcome.UNNEEDED, "unneeded by consumer D: tail computed here")]
    assert len(rv) == 0 and rv._unneeded == {}
    assert kinds(rv.on_register(reg(), 1.1)) == ["SendFailed"]  # a late registration of it is stale
    assert kinds(rv.on_register(reg(attempt=1), 1.2)) == []  # the next attempt pairs as usual


def test_unneeded_after_ready_releases_at_once_and_fails_other_pending():
    rv = make()
    rv.on_ready(K, READY, 0.0)
    assert rv.on_unneeded(K, D0, "", 1.0) == [Release(K, Outcome.UNNEEDED, "unneeded by consumer D")]
    rv = make()
    rv.on_register(reg(rank=1, tp=2), 0.0)  # an odd consumer: one rank registered, the engine declined
    out = rv.on_unneeded(K, D0, "", 1.0)
    assert [(a.dest, a.code) for a in only(out, SendFailed)] == [(D1, "unneeded")] and len(rv) == 0


def test_unneeded_waits_for_a_write_in_flight():
    rv = make()
    rv.on_ready(K, READY, 0.0)
    rv.on_register(reg(rank=0, tp=2), 0.0)
    assert rv.on_unneeded(K, D1, "", 1.0) == []
    assert rv.on_write_result(K, D0, True, 2.0) == [Release(K, Outcome.UNNEEDED, "unneeded by consumer D")]


def test_unneeded_from_another_engine_changes_nothing():
    rv = make()
    rv.on_ready(K, READY, 0.0)
    rv.on_register(reg(), 0.0)
    assert rv.on_unneeded(K, ("E", 0), "", 1.0) == [] and rv.entry_state(K)["writing"] == [D0]


def test_unneeded_memory_is_bounded_and_pruned_with_the_floor():
    rv = Rendezvous(expected_dests=expected_dests, lease_s=LEASE, tombstone_s=5.0, max_entries=2)
    for i in range(4):
        rv.on_unneeded(TransferKey(f"t{i}", 0), D0, "", 0.0)
    assert list(rv._unneeded) == [TransferKey("t2", 0), TransferKey("t3", 0)]
    rv.tick(10.0)
    assert rv._unneeded == {}


def test_revoke_of_pending_registration():
    rv = make()
    rv.on_register(reg(), 0.0)
    assert rv.on_revoke(K, D0, 1.0) == [SendRevokeAck(K, D0)]
    assert len(rv) == 0
    assert rv.on_ready(K, READY, 2.0)[0].outcome is Outcome.FAILED  # refused: key ended


def test_revoke_while_writing_acks_after_the_write():
    rv = make()
    rv.on_ready(K, READY, 0.0)
    rv.on_register(reg(), 0.0)
    assert rv.on_revoke(K, D0, 1.0) == []  # no ack while the WRITE may still land
    assert rv.on_revoke(K, D0, 1.1) == []  # nor on a repeated revoke
    out = rv.on_write_result(K, D0, True, 2.0)
    assert out[0] == SendRevokeAck(K, D0)
    assert [a.outcome for a in only(out, Release)] == [Outcome.CANCELLED]
    assert len(out) == 2 and len(rv) == 0


def test_revoke_while_writing_stops_other_destinations():
    rv = make()
    rv.on_ready(K, READY, 0.0)
    rv.on_register(reg(rank=0, tp=2), 0.0)
    assert rv.on_revoke(K, D0, 1.0) == []
    out = rv.on_register(reg(rank=1, tp=2), 1.5)  # the consumer gave up: no new WRITE for this key
    assert kinds(out) == ["SendFailed"] and out[0].code == "cancelled"
    out = rv.on_write_result(K, D0, False, 2.0)
    assert out == [SendRevokeAck(K, D0), Release(K, Outcome.CANCELLED, "revoked by consumer rank 0")]


def test_revoke_after_write():
    rv = make()
    rv.on_ready(K, READY, 0.0)
    rv.on_register(reg(rank=0, tp=2), 0.0)
    rv.on_write_result(K, D0, True, 0.5)
    out = rv.on_revoke(K, D0, 1.0)
    assert out == [SendRevokeAck(K, D0), Release(K, Outcome.CANCELLED, "revoked by consumer rank 0")]


def test_revoke_fails_other_pending_registrations_at_once():
    rv = make()
    rv.on_register(reg(rank=0, tp=2), 0.0)
    rv.on_register(reg(rank=1, tp=2), 0.0)
    out = rv.on_revoke(K, D0, 1.0)
    assert out[0] == SendRevokeAck(K, D0)
    assert [(a.dest, a.code) for a in only(out, SendFailed)] == [(D1, "cancelled")]
    assert len(rv) == 0  # not left to wait for rank 1's TTL (renewed by its heartbeats)


def test_revoke_unknown_key_then_late_registration_refused():
    rv = make()
    assert rv.on_revoke(K, D0, 0.0) == [SendRevokeAck(K, D0)]
    out = rv.on_register(reg(), 0.5)
    assert kinds(out) == ["SendFailed"] and out[0].code == "stale"
    out = rv.on_ready(K, READY, 0.6)
    assert kinds(out) == ["Release"] and out[0].outcome is Outcome.FAILED
    assert len(rv) == 0
    # a newer attempt is still welcome
    assert rv.on_register(reg(attempt=1), 0.7) == []


def test_revoke_from_other_engine_changes_nothing():
    rv = make()
    rv.on_register(reg(), 0.0)
    assert rv.on_revoke(K, ("X", 0), 0.5) == [SendRevokeAck(K, ("X", 0))]
    assert rv.on_ready(K, READY, 1.0) == [StartWrite(K, D0, reg(), READY)]


def test_heartbeat_renews_lease():
    rv = make()
    rv.on_ready(K, READY, 0.0)
    rv.on_heartbeat([K], 8.0)
    assert rv.tick(12.0) == []
    out = rv.tick(18.0)
    assert out == [Release(K, Outcome.EXPIRED, "producer lease expired")]
    rv.on_heartbeat([K, TransferKey("nope", 0)], 19.0)  # unknown keys are ignored


def test_heartbeat_renews_registration_deadline():
    rv = make()
    rv.on_register(reg(ttl_ms=2000), 0.0)
    rv.on_heartbeat([K], 1.5)
    assert rv.tick(3.0) == []
    assert rv.on_ready(K, READY, 3.4) == [StartWrite(K, D0, reg(ttl_ms=2000), READY)]


def test_heartbeat_never_shortens():
    rv = make()
    rv.on_register(reg(ttl_ms=4000), 0.0)
    rv.on_heartbeat([K], -10.0)
    assert rv.tick(3.9) == []


def test_registration_fetched_after_a_stall_counts_from_before_it():
    """The producer last looked at 0.0 and fetched at 7.0 (paused, or a transport call blocked): a
    registration with a 5 s ttl may be 7 s old and is refused; one with a 10 s ttl lives until 10.0."""
    rv = make()
    out = rv.on_register(reg(ttl_ms=5000), 7.0, arrived_after=0.0)
    assert [(type(a).__name__, a.code) for a in out] == [("SendFailed", "expired")]
    assert len(rv) == 0  # no entry, key not bound: a fresh registration is still taken
    rv.on_register(reg(tid="u", ttl_ms=10_000), 7.0, arrived_after=0.0)
    assert rv.tick(9.9) == []
    assert [(a.key.transfer_id, a.code) for a in rv.tick(10.0)] == [("u", "expired")]


def test_heartbeat_fetched_after_a_stall_renews_from_before_it():
    rv = make()
    rv.on_ready(K, READY, 0.0)
    rv.on_heartbeat([K], 20.0, arrived_after=0.5)  # renews to 0.5 + LEASE, not 20 + LEASE
    assert rv.tick(LEASE + 0.4) == []
    assert rv.tick(LEASE + 0.5) == [Release(K, Outcome.EXPIRED, "producer lease expired")]


def test_lease_expiry_releases():
    rv = make()
    rv.on_ready(K, READY, 0.0)
    assert rv.tick(LEASE - 0.01) == []
    assert rv.tick(LEASE) == [Release(K, Outcome.EXPIRED, "producer lease expired")]
    assert len(rv) == 0
    assert kinds(rv.on_register(reg(), LEASE + 1)) == ["SendFailed"]


def test_lease_expiry_fails_pending_of_other_dests_and_waits_for_write():
    rv = make()
    rv.on_ready(K, READY, 0.0)
    rv.on_register(reg(rank=0, tp=2), 0.0)
    assert rv.tick(LEASE) == []  # closes, but the WRITE to rank 0 is still in flight
    out = rv.on_register(reg(rank=1, tp=2), LEASE + 0.1)
    assert kinds(out) == ["SendFailed"] and out[0].code == "expired"
    assert rv.on_write_result(K, D0, True, LEASE + 1) == [Release(K, Outcome.EXPIRED, "producer lease expired")]


def test_registration_ttl_expiry_fails():
    rv = make()
    rv.on_register(reg(ttl_ms=1000), 0.0)
    assert rv.tick(0.9) == []
    out = rv.tick(1.0)
    assert [(a.dest, a.code) for a in out] == [(D0, "expired")]
    assert len(rv) == 0


def test_registration_expired_but_not_ticked_is_not_written():
    """on_ready before the tick that would expire the registration: no WRITE on a dead registration."""
    rv = make()
    rv.on_register(reg(ttl_ms=1000), 0.0)
    out = rv.on_ready(K, READY, 1.5)
    assert [(type(a).__name__, getattr(a, "code", None)) for a in out] == [("SendFailed", "expired"),
                                                                        ("Release", None)]
    assert out[1].outcome is Outcome.FAILED and len(rv) == 0


def test_partial_registration_expiry_does_not_leak():
    """Consumer TP 2: rank 0 registers and expires, rank 1 never registers, the KV never becomes ready."""
    rv = make()
    rv.on_register(reg(rank=0, tp=2, ttl_ms=1000), 0.0)
    out = rv.tick(1.0)
    assert [(a.dest, a.code) for a in out] == [(D0, "expired")]
    assert len(rv) == 0 and not rv.has_unmatched()
    assert kinds(rv.on_register(reg(rank=1, tp=2), 2.0)) == ["SendFailed"]  # the key cannot succeed
    assert kinds(rv.on_ready(K, READY, 2.0)) == ["Release"]


def test_partial_registration_expiry_with_other_dest_pending():
    rv = make()
    rv.on_register(reg(rank=0, tp=2, ttl_ms=1000), 0.0)
    rv.on_register(reg(rank=1, tp=2, ttl_ms=5000), 0.0)
    assert kinds(rv.tick(1.0)) == ["SendFailed"]
    assert len(rv) == 1
    out = rv.on_ready(K, READY, 2.0)
    assert kinds(out) == ["StartWrite"] and out[0].dest == D1
    out = rv.on_write_result(K, D1, True, 3.0)
    assert len(out) == 1 and out[0].outcome is Outcome.FAILED  # rank 0 was never written


def test_local_abort():
    rv = make()
    rv.on_register(reg(rank=0, tp=2), 0.0)
    rv.on_ready(K, READY, 0.0)
    rv.on_register(reg(rank=1, tp=2), 0.0)
    rv.on_write_result(K, D1, True, 0.1)
    out = rv.on_local_abort(K, "prefill aborted", 0.2)
    assert out == []  # the WRITE to rank 0 is in flight
    out = rv.on_register(reg(rank=1, tp=2), 0.3)
    assert out == []  # duplicate of a finished dest
    assert rv.on_write_result(K, D0, True, 1.0) == [Release(K, Outcome.CANCELLED, "prefill aborted")]
    assert len(rv) == 0


def test_local_abort_fails_pending_and_releases():
    rv = make()
    rv.on_register(reg(rank=0, tp=2), 0.0)
    out = rv.on_local_abort(K, "", 0.5)
    assert [(a.dest, a.code) for a in out] == [(D0, "cancelled")]
    assert len(rv) == 0
    rv.on_ready(K, READY, 0.0)  # readiness after the abort is refused, with its one Release


def test_local_abort_of_ready_releases_once_and_unknown_key_tombstones():
    rv = make()
    rv.on_ready(K, READY, 0.0)
    assert rv.on_local_abort(K, "x", 0.5) == [Release(K, Outcome.CANCELLED, "x")]
    assert rv.on_local_abort(K, "x", 0.6) == []
    k2 = TransferKey("u", 0)
    assert rv.on_local_abort(k2, "gone", 1.0) == []
    assert kinds(rv.on_register(reg(tid="u"), 1.1)) == ["SendFailed"]


def test_conflict_other_consumer_engine():
    rv = make()
    rv.on_register(reg(), 0.0)
    out = rv.on_register(reg(engine="X"), 0.1)
    assert kinds(out) == ["SendFailed"] and out[0].code == "conflict" and out[0].dest == ("X", 0)
    assert rv.on_ready(K, READY, 0.2) == [StartWrite(K, D0, reg(), READY)]


def test_not_routed_dest():
    rv = make()
    rv.on_register(reg(rank=0, tp=4), 0.0)
    out = rv.on_register(reg(rank=2, tp=4), 0.0)
    assert kinds(out) == ["SendFailed"] and out[0].code == "not_routed"


def test_not_routed_first_registration_neither_binds_nor_leaks():
    rv = make()
    out = rv.on_register(reg(engine="X", rank=3, tp=4), 0.0)
    assert kinds(out) == ["SendFailed"] and out[0].code == "not_routed"
    assert len(rv) == 0
    assert rv.on_register(reg(), 0.1) == []  # the real consumer is not refused as a "conflict"
    assert kinds(rv.on_ready(K, READY, 0.2)) == ["StartWrite"]


def test_table_full():
    rv = make(max_entries=2)
    rv.on_register(reg(tid="a"), 0.0)
    rv.on_register(reg(tid="b"), 0.0)
    out = rv.on_register(reg(tid="c"), 0.0)
    assert kinds(out) == ["SendFailed"] and out[0].code == "overloaded"
    assert len(rv) == 2
    assert rv.on_register(reg(tid="a", rank=0), 0.0) == []  # existing keys still work
    rv.tick(100.0)
    assert len(rv) == 0
    assert rv.on_register(reg(tid="c"), 100.0) == []


def test_long_lived_entry_keeps_refusing_older_attempts():
    """The tombstone TTL is shorter than a registration TTL renewed by heartbeats."""
    rv = make(tombstone_s=5.0)
    rv.on_register(reg(attempt=1, ttl_ms=3_600_000), 0.0)
    for t in range(10, 100, 10):
        rv.tick(float(t))
    out = rv.on_register(reg(attempt=0), 100.0)
    assert kinds(out) == ["SendFailed"] and out[0].code == "stale"
    assert len(rv) == 1


def test_floor_expiry_forgets_ended_keys():
    """By design, tombstones are bounded in time: a replay after tombstone_s is no longer recognised."""
    rv = make(tombstone_s=5.0)
    rv.on_ready(K, READY, 0.0)
    rv.on_local_abort(K, "", 0.0)
    assert len(rv.floor) == 1
    rv.tick(10.0)
    assert len(rv.floor) == 0


def test_attempt_floor():
    f = AttemptFloor(ttl_s=10.0)
    assert f.refusal(TransferKey("a", 0)) is None
    f.raise_to("a", 2, 0.0)
    assert f.refusal(TransferKey("a", 1)) and f.refusal(TransferKey("a", 2)) is None
    f.raise_to("a", 1, 1.0)  # never lowers
    assert f.refusal(TransferKey("a", 1))
    f.end(TransferKey("a", 2), 2.0)
    assert f.refusal(TransferKey("a", 2)) and f.refusal(TransferKey("a", 3)) is None
    assert f.refusal(TransferKey("b", 0)) is None
    f.prune(11.9)
    assert len(f) == 1
    f.prune(12.0)
    assert len(f) == 0 and f.refusal(TransferKey("a", 0)) is None
    assert str(TransferKey("a", 3)) == "a#3"


# ---- random interleavings ----------------------------------------------------------------------------
TIDS = ("t0", "t1")
ATTEMPTS = (0, 1, 2)
ENGINE_TP = {"D": 2, "E": 1, "X": 4}  # consumer engine -> its TP size
DESTS = (("D", 0), ("D", 1), ("E", 0), ("X", 0), ("X", 3))  # ("X", 3) is never routed
keys_st = st.builds(TransferKey, st.sampled_from(TIDS), st.sampled_from(ATTEMPTS))


class RendezvousMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.rv = Rendezvous(expected_dests=expected_dests, lease_s=LEASE, tombstone_s=1e12, max_entries=5)
        self.now = 0.0
        self.inflight: set[tuple[TransferKey, tuple]] = set()
        self.started: set[tuple[TransferKey, tuple]] = set()
        self.write_ok: dict[TransferKey, set] = defaultdict(set)
        self.write_engine: dict[TransferKey, str] = {}
        self.revoked: set[tuple[TransferKey, tuple]] = set()
        self.aborted: set[TransferKey] = set()
        self.unneeded_by: dict[TransferKey, str] = {}  # key -> the first consumer engine that declined it
        self.ready_given: dict[TransferKey, ReadyKV] = {}
        self.releases: Counter = Counter()
        self.max_attempt: dict[str, int] = {}
        self.reg_deadline: dict[tuple[TransferKey, tuple], float] = {}
        self.reg_ttl: dict[tuple[TransferKey, tuple], float] = {}

    # ---- applying outputs ----------------------------------------------------------------------
    def apply(self, actions):
        for a in actions:
            if isinstance(a, StartWrite):
                kd = (a.key, a.dest)
                assert kd not in self.started, f"second StartWrite for {kd}"
                assert kd not in self.revoked, f"StartWrite after revoke {kd}"
                assert a.key not in self.aborted, f"StartWrite after local abort {a.key}"
                assert self.unneeded_by.get(a.key) != a.dest[0], f"StartWrite after its consumer declined {a.key}"
                assert self.releases[a.key] == 0, f"StartWrite after Release {a.key}"
                assert a.key.attempt >= self.max_attempt.get(a.key.transfer_id, -1), f"stale StartWrite {a.key}"
                assert (a.reg.transfer_id, a.reg.attempt) == a.key
                assert (a.reg.consumer_engine, a.reg.consumer_rank) == a.dest
                assert a.ready is self.ready_given[a.key]
                assert a.dest in expected_dests(a.dest[0], ENGINE_TP[a.dest[0]])
                assert self.write_engine.setdefault(a.key, a.dest[0]) == a.dest[0], "two consumer engines"
                assert self.now < self.reg_deadline[kd], "StartWrite on an expired registration"
                self.started.add(kd)
                self.inflight.add(kd)
            elif isinstance(a, SendRevokeAck):
                assert (a.key, a.dest) not in self.inflight, f"RevokeAck while writing {a.key} {a.dest}"
            elif isinstance(a, SendFailed):
                assert (a.key, a.dest) not in self.inflight, f"SendFailed while writing {a.key} {a.dest}"
            elif isinstance(a, Release):
                assert a.key in self.ready_given, f"Release of a key never ready {a.key}"
                self.releases[a.key] += 1
                assert self.releases[a.key] == 1, f"second Release {a}"
                assert not any(k == a.key for k, _ in self.inflight), f"Release while writing {a.key}"
                if a.outcome is Outcome.DONE:
                    eng = self.write_engine.get(a.key)
                    assert eng is not None, "DONE without any write"
                    assert expected_dests(eng, ENGINE_TP[eng]) <= self.write_ok[a.key], "DONE with a dest unwritten"
            else:
                raise AssertionError(f"unknown action {a!r}")

    def seen(self, key: TransferKey):
        self.max_attempt[key.transfer_id] = max(self.max_attempt.get(key.transfer_id, -1), key.attempt)

    # ---- events ------------------------------------------------------------------------------------
    @rule(key=keys_st, dest=st.sampled_from(DESTS), ttl_ms=st.sampled_from([1000, TTL_MS, 20_000]))
    def register(self, key, dest, ttl_ms):
        r = reg(tid=key.transfer_id, attempt=key.attempt, engine=dest[0], rank=dest[1], tp=ENGINE_TP[dest[0]],
                ttl_ms=ttl_ms)
        kd = (key, dest)
        if kd not in self.reg_deadline:  # later duplicates are ignored by the rendezvous
            self.reg_deadline[kd] = self.now + ttl_ms / 1000
            self.reg_ttl[kd] = ttl_ms / 1000
        out = self.rv.on_register(r, self.now)
        self.apply(out)
        if any(isinstance(a, SendFailed) and a.code == "overloaded" and a.dest == dest for a in out):
            del self.reg_deadline[kd]  # refused for room only: a later registration may be accepted
        self.seen(key)

    @rule(key=keys_st)
    def ready(self, key):
        if key in self.ready_given:
            if self.releases[key] == 0:  # the engine reported readiness twice: the first one stands
                assert self.rv.on_ready(key, ReadyKV((99,), 20), self.now) == []
            return  # (after its Release a duplicate cannot be told from a stale readiness)
        ready = ReadyKV((hash(key) % 100,), 20, fence=object())
        self.ready_given[key] = ready
        self.apply(self.rv.on_ready(key, ready, self.now))
        self.seen(key)

    @precondition(lambda self: self.inflight)
    @rule(i=st.integers(0, 100), ok=st.booleans())
    def write_result(self, i, ok):
        key, dest = sorted(self.inflight)[i % len(self.inflight)]
        self.inflight.discard((key, dest))
        if ok:
            self.write_ok[key].add(dest)
        self.apply(self.rv.on_write_result(key, dest, ok, self.now))

    @rule(key=keys_st, dest=st.sampled_from(DESTS))
    def spurious_write_result(self, key, dest):
        if (key, dest) not in self.inflight:
            assert self.rv.on_write_result(key, dest, True, self.now) == []

    @rule(key=keys_st, dest=st.sampled_from(DESTS))
    def revoke(self, key, dest):
        self.revoked.add((key, dest))
        self.apply(self.rv.on_revoke(key, dest, self.now))

    @rule(key=keys_st, dest=st.sampled_from(DESTS))
    def unneeded(self, key, dest):
        self.unneeded_by.setdefault(key, dest[0])
        self.apply(self.rv.on_unneeded(key, dest, "tail computed here", self.now))

    @rule(keys=st.lists(keys_st, max_size=3))
    def heartbeat(self, keys):
        self.rv.on_heartbeat(keys, self.now)
        for kd in self.reg_deadline:
            if kd[0] in keys:
                self.reg_deadline[kd] = max(self.reg_deadline[kd], self.now + self.reg_ttl[kd])

    @rule(key=keys_st)
    def local_abort(self, key):
        self.aborted.add(key)
        self.apply(self.rv.on_local_abort(key, "abort", self.now))

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0, 7.0, 12.0]))
    def advance(self, dt):
        self.now += dt  # time passes; the worker may handle events before its next tick

    @rule()
    def tick(self):
        self.apply(self.rv.tick(self.now))

    @invariant()
    def table_is_consistent(self):
        for key in {k for k, _ in self.inflight}:
            state = self.rv.entry_state(key)
            assert state is not None, f"entry of {key} gone while writing"
            assert {d for k, d in self.inflight if k == key} == set(state["writing"])

    def teardown(self):
        # Finish every WRITE, then let time run past every lease and TTL: everything must end.
        while self.inflight:
            key, dest = sorted(self.inflight)[0]
            self.inflight.discard((key, dest))
            self.write_ok[key].add(dest)
            self.apply(self.rv.on_write_result(key, dest, True, self.now))
        self.now += 1e6
        self.apply(self.rv.tick(self.now))
        assert len(self.rv) == 0, f"left behind: {[self.rv.entry_state(k) for k in self.rv._entries]}"
        assert not self.rv.has_unmatched()
        for key in self.ready_given:
            assert self.releases[key] == 1, f"{key} released {self.releases[key]} times"


RendezvousMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_rendezvous_state_machine = RendezvousMachine.TestCase


@pytest.mark.parametrize("seed", range(3))
def test_random_interleavings_tp2_always_end(seed):
    """Plain random walk with many keys: a cheap extra check that nothing leaks at scale."""
    import random

    rnd = random.Random(seed)
    m = RendezvousMachine()
    m.rv.max_entries = 10_000
    tids = [f"r{i}" for i in range(40)]
    for _ in range(3000):
        key = TransferKey(rnd.choice(tids), rnd.randrange(3))
        dest = rnd.choice(DESTS)
        ev = rnd.random()
        if ev < 0.3:
            m.register(key, dest, rnd.choice([1000, TTL_MS]))
        elif ev < 0.5:
            m.ready(key)
        elif ev < 0.7 and m.inflight:
            m.write_result(rnd.randrange(100), rnd.random() < 0.8)
        elif ev < 0.75:
            m.revoke(key, dest)
        elif ev < 0.8:
            m.local_abort(key)
        elif ev < 0.85:
            m.heartbeat([key])
        elif ev < 0.95:
            m.advance(rnd.choice([0.1, 0.5, 2.0]))
        else:
            m.tick()
        m.table_is_consistent()
    m.teardown()


def test_heartbeat_from_another_consumer_does_not_renew():
    rv = make()
    rv.on_register(reg(engine="D"), 0.0)
    rv.on_heartbeat([K], TTL_MS / 1000.0 - 0.1, consumer_engine="E")  # a different consumer engine
    out = rv.tick(TTL_MS / 1000.0 + 0.01)
    assert kinds(out) == ["SendFailed"] and out[0].code == "expired"


def test_lease_expiry_under_a_successful_write_reports_done():
    rv = make()
    rv.on_ready(K, READY, 0.0)
    (sw,) = rv.on_register(reg(), 0.0)
    assert rv.tick(LEASE + 1) == []  # the WRITE is still in flight
    assert rv.on_write_result(K, sw.dest, True, LEASE + 2) == [Release(K, Outcome.DONE)]
