"""Consumer completion: each documented path, then random interleavings against a model.

Invariants checked after every step of the state machine:
  1. every started key ends exactly once (one Received), promptly once nothing is in doubt, and within
     transfer_timeout + fence_wait when time advances;
  4. Received(ok=True) only when every expected producer sent done and nothing failed; Received(ok=False)
     only after a failure, and never while a registered producer is in doubt (no done, failed or ack)
     unless the fence wait since the failure elapsed.
Also: every producer in doubt at the failure is revoked exactly once, and no one else is.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpush_common.state.completion import Completion, Received, SendRevoke
from kvpush_common.protocol.identity import TransferKey

TIMEOUT = 60.0
FENCE = 45.0
K = TransferKey("r", 0)
P0, P1, P2 = ("P", 0), ("P", 1), ("P", 2)
BOTH = frozenset({P0, P1})


def make(**kw) -> Completion:
    return Completion(transfer_timeout_s=kw.pop("timeout", TIMEOUT), fence_wait_s=kw.pop("fence", FENCE), **kw)


def started(expected=BOTH, register=True, **kw) -> Completion:
    c = make(**kw)
    assert c.start(K, expected, 0.0) == []
    if register:
        for p in sorted(expected):
            c.on_registered(K, p)
    return c


# ---- documented paths --------------------------------------------------------------------------------
def test_gone_producer_fails_its_keys_at_once_revoking_only_the_live_ones():
    c = started()
    out = c.on_producer_gone(P0, "side channel refuses", 1.0)
    assert out == [SendRevoke(K, P1, "producer rank 0 is gone: side channel refuses")]  # no fence wait for P0
    assert K in c and c.producers_owing() == {P1}
    assert c.on_revoke_ack(K, P1, 1.5) == [Received(K, False, "producer rank 0 is gone: side channel refuses")]


def test_gone_sole_producer_ends_its_keys_at_once():
    c = started(expected=frozenset({P0}))
    other = TransferKey("s", 0)
    assert c.start(other, frozenset({P0}), 0.0) == []  # not registered yet: it waits on P0 all the same
    out = c.on_producer_gone(P0, "exited", 2.0)
    assert sorted(out, key=lambda r: r.key.transfer_id) == [Received(K, False, "producer rank 0 is gone: exited"),
                                                            Received(other, False, "producer rank 0 is gone: exited")]
    assert len(c) == 0 and c.producers_owing() == set()


def test_gone_producer_that_already_wrote_changes_nothing():
    c = started()
    assert c.on_done(K, P0, 1.0) == []
    assert c.on_producer_gone(P0, "exited", 2.0) == []
    assert c.on_done(K, P1, 3.0) == [Received(K, True)]


def test_gone_producer_ends_a_failing_key_that_waited_for_its_revoke_ack():
    c = started()
    out = c.on_failed(K, P1, "boom", 1.0)
    assert out == [SendRevoke(K, P0, "producer rank 1: boom")]
    assert c.producers_owing() == {P0}
    assert c.tick(2.0) == []  # the fence wait (45 s) would hold it
    assert c.on_producer_gone(P0, "exited", 2.0) == [Received(K, False, "producer rank 1: boom")]


def test_gone_producer_leaves_keys_with_a_read_of_ours_still_posted():
    c = started(expected=frozenset({P0}))
    assert c.on_producer_gone(P0, "exited", 1.0, keep=frozenset({K})) == [] and K in c
    assert c.on_failed(K, P0, "READ ended in ERR", 1.5) == [Received(K, False, "producer rank 0: READ ended in ERR")]


def test_gone_producer_of_another_key_is_ignored():
    c = started(expected=frozenset({P0}))
    assert c.on_producer_gone(P2, "exited", 1.0) == [] and K in c



def test_all_done_is_ok():
    c = started()
    assert K in c and len(c) == 1
    assert c.on_done(K, P0, 1.0) == []
    assert c.on_done(K, P0, 1.1) == []  # duplicate
    assert c.on_done(K, P1, 2.0) == [Received(K, True)]
    assert K not in c and len(c) == 0
    assert c.on_done(K, P1, 2.1) == []  # late duplicate after the end


def test_done_without_registration_still_counts():
    c = started(register=False)
    c.on_done(K, P0, 1.0)
    assert c.on_done(K, P1, 1.0) == [Received(K, True)]


def test_write_failed_revokes_the_others_and_waits_for_them():
    c = started(expected=frozenset({P0, P1, P2}))
    out = c.on_failed(K, P1, "expired: registration expired", 1.0)
    assert out == [SendRevoke(K, P0, "producer rank 1: expired: registration expired"),
                   SendRevoke(K, P2, "producer rank 1: expired: registration expired")]
    assert c.on_failed(K, P1, "again", 1.1) == []
    assert c.on_revoke_ack(K, P0, 2.0) == []
    out = c.on_done(K, P2, 3.0)  # WriteDone answers a revoke too: nothing more will land
    assert out == [Received(K, False, "producer rank 1: expired: registration expired")]
    assert len(c) == 0


def test_failed_with_nobody_in_doubt_ends_at_once():
    c = started(expected=BOTH, register=False)
    c.on_registered(K, P0)
    c.on_done(K, P0, 0.5)
    assert c.on_failed(K, P1, "handshake failed", 1.0) == [Received(K, False, "producer rank 1: handshake failed")]


def test_unregistered_producers_are_not_revoked():
    c = started(register=False)
    c.on_registered(K, P0)
    out = c.on_failed(K, P1, "x", 1.0)
    assert out == [SendRevoke(K, P0, "producer rank 1: x")]
    assert c.on_revoke_ack(K, P0, 1.5) == [Received(K, False, "producer rank 1: x")]


def test_timeout_revokes_and_fence_wait_bounds_the_end():
    c = started()
    c.on_done(K, P0, 1.0)
    assert c.tick(TIMEOUT - 0.01) == []
    out = c.tick(TIMEOUT)
    assert out == [SendRevoke(K, P1, "timed out waiting for producer ranks [1]")]
    assert c.tick(TIMEOUT + FENCE - 0.01) == []  # P1 might still be writing
    out = c.tick(TIMEOUT + FENCE)
    assert len(out) == 1 and out[0].key == K and not out[0].ok
    assert "fence wait elapsed" in out[0].reason and "[1]" in out[0].reason
    assert len(c) == 0


def test_timeout_then_ack():
    c = started()
    out = c.tick(TIMEOUT + 1)
    assert [a.producer for a in out] == [P0, P1]
    assert c.on_revoke_ack(K, P1, TIMEOUT + 2) == []
    out = c.on_revoke_ack(K, P0, TIMEOUT + 3)
    assert out == [Received(K, False, "timed out waiting for producer ranks [0, 1]")]


def test_done_after_failure_never_makes_it_ok():
    c = started()
    c.abort(K, "client went away", 1.0)
    c.on_done(K, P0, 2.0)
    out = c.on_done(K, P1, 3.0)
    assert out == [Received(K, False, "client went away")]


def test_abort_before_registration_ends_at_once():
    c = started(register=False)
    assert c.abort(K, "", 1.0) == [Received(K, False, "aborted by consumer")]
    assert len(c) == 0


def test_abort_revokes_registered():
    c = started()
    out = c.abort(K, "stop", 1.0)
    assert out == [SendRevoke(K, P0, "stop"), SendRevoke(K, P1, "stop")]
    assert c.abort(K, "stop again", 1.5) == []  # no second round of revokes
    assert c.on_failed(K, P0, "revoked", 2.0) == []
    assert c.on_revoke_ack(K, P1, 2.5) == [Received(K, False, "stop")]


def test_abort_of_unknown_key_refuses_a_later_start():
    c = make()
    assert c.abort(K, "early", 0.0) == []
    out = c.start(K, BOTH, 1.0)
    assert len(out) == 1 and out[0].key == K and not out[0].ok and "stale" in out[0].reason
    assert len(c) == 0
    assert c.start(TransferKey("r", 1), BOTH, 1.0) == []  # the next attempt is fine


def test_stale_and_ended_starts_are_refused():
    c = make()
    assert c.start(TransferKey("r", 2), BOTH, 0.0) == []
    out = c.start(TransferKey("r", 1), BOTH, 0.0)
    assert [(a.ok, "stale" in a.reason) for a in out] == [(False, True)]
    c.on_done(TransferKey("r", 2), P0, 1.0)
    assert c.on_done(TransferKey("r", 2), P1, 1.0)[0].ok
    out = c.start(TransferKey("r", 2), BOTH, 2.0)  # the same key again after it ended
    assert len(out) == 1 and not out[0].ok


def test_empty_expected_is_refused():
    c = make()
    out = c.start(K, frozenset(), 0.0)
    assert len(out) == 1 and not out[0].ok and len(c) == 0


def test_unknown_keys_and_unexpected_producers_are_ignored():
    c = started()
    other = TransferKey("zz", 0)
    for call in (lambda: c.on_done(other, P0, 1.0), lambda: c.on_failed(other, P0, "x", 1.0),
                 lambda: c.on_revoke_ack(other, P0, 1.0), lambda: c.on_done(K, P2, 1.0),
                 lambda: c.on_failed(K, P2, "x", 1.0), lambda: c.on_revoke_ack(K, P2, 1.0)):
        assert call() == []
    c.on_registered(other, P0)
    assert len(c) == 1 and other not in c
    c.on_done(K, P0, 2.0)
    assert c.on_done(K, P1, 2.0) == [Received(K, True)]


def test_ack_before_failure_is_trusted():
    c = started()
    assert c.on_revoke_ack(K, P1, 1.0) == []  # says nothing of P1 will land
    out = c.on_failed(K, P0, "x", 2.0)
    assert out == [Received(K, False, "producer rank 0: x")]


def test_waiting_keys_for_heartbeats():
    c = make()
    k2 = TransferKey("s", 0)
    c.start(K, BOTH, 0.0)
    c.start(k2, frozenset({P0}), 0.0)
    assert c.waiting_keys() == {P0: [K, k2], P1: [K]}
    c.on_done(K, P1, 1.0)
    assert c.waiting_keys() == {P0: [K, k2]}
    c.on_registered(k2, P0)
    c.abort(k2, "", 1.0)  # failed: stop renewing its leases, even though it waits for the revoke
    assert c.waiting_keys() == {P0: [K]} and k2 in c


def test_long_lived_key_keeps_refusing_older_attempts():
    c = make(timeout=3600.0, tombstone_s=5.0)
    assert c.start(TransferKey("r", 3), BOTH, 0.0) == []
    for t in range(10, 100, 10):
        c.tick(float(t))
    out = c.start(TransferKey("r", 1), BOTH, 100.0)
    assert len(out) == 1 and not out[0].ok


def test_tombstones_expire():
    c = make(tombstone_s=5.0)
    c.abort(K, "", 0.0)
    assert len(c.floor) == 1
    c.tick(5.0)
    assert len(c.floor) == 0


# ---- random interleavings ----------------------------------------------------------------------------
KEYS = [TransferKey(t, a) for t in ("t0", "t1") for a in (0, 1, 2)]
PRODUCERS = [P0, P1, ("Q", 0)]
EXPECTED_CHOICES = [frozenset({P0}), BOTH, frozenset()]
keys_st = st.sampled_from(KEYS)
prods_st = st.sampled_from(PRODUCERS)


@dataclass
class Live:
    expected: frozenset
    deadline: float
    registered: set = field(default_factory=set)
    done: set = field(default_factory=set)
    answered: set = field(default_factory=set)  # done, failed or acked
    failed_at: float | None = None
    must_revoke: set = field(default_factory=set)  # in doubt when the failure happened
    revoked: set = field(default_factory=set)

    def in_doubt(self) -> set:
        return self.registered - self.answered


class CompletionMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.c = Completion(transfer_timeout_s=TIMEOUT, fence_wait_s=FENCE, tombstone_s=1e12)
        self.now = 0.0
        self.live: dict[TransferKey, Live] = {}
        self.floor: dict[str, int] = {}
        self.accepted = Counter()
        self.ended = Counter()

    def refused(self, key) -> bool:
        return key.attempt < self.floor.get(key.transfer_id, 0)

    def raise_floor(self, key, attempt):
        self.floor[key.transfer_id] = max(self.floor.get(key.transfer_id, 0), attempt)

    def fail(self, key, now):
        p = self.live[key]
        if p.failed_at is None:
            p.failed_at = now
            p.must_revoke = p.in_doubt()

    def apply(self, out):
        for a in out:
            p = self.live.get(a.key)
            assert p is not None, f"output for a key not in progress: {a!r}"
            if isinstance(a, SendRevoke):
                assert p.failed_at is not None, "revoke without a failure"
                assert a.producer in p.in_doubt(), f"revoke of {a.producer} that is not in doubt"
                assert a.producer not in p.revoked, "second revoke"
                p.revoked.add(a.producer)
            elif isinstance(a, Received):
                if a.ok:
                    assert p.failed_at is None, "ok after a failure"
                    assert p.done >= p.expected, "ok with a producer not done"
                else:
                    assert p.failed_at is not None, "not ok without a failure"
                    assert not p.in_doubt() or self.now >= p.failed_at + FENCE, (
                        f"ended while {p.in_doubt()} in doubt, {self.now - p.failed_at:.1f}s after the failure")
                del self.live[a.key]
                self.ended[a.key] += 1
                self.raise_floor(a.key, a.key.attempt + 1)
            else:
                raise AssertionError(f"unknown output {a!r}")

    # ---- events ------------------------------------------------------------------------------------
    @rule(key=keys_st, expected=st.sampled_from(EXPECTED_CHOICES))
    def start(self, key, expected):
        if key in self.live:
            return  # a duplicate start of a key in progress is the caller's bug (see report)
        out = self.c.start(key, expected, self.now)
        if self.refused(key) or not expected:
            assert len(out) == 1 and out[0].key == key and out[0].ok is False
            return
        assert out == []
        self.live[key] = Live(expected, self.now + TIMEOUT)
        self.accepted[key] += 1
        self.raise_floor(key, key.attempt)

    @rule(key=keys_st, prod=prods_st)
    def registered(self, key, prod):
        self.c.on_registered(key, prod)
        if key in self.live:
            self.live[key].registered.add(prod)

    def _answer(self, key, prod, call, failing):
        p = self.live.get(key)
        relevant = p is not None and prod in p.expected
        if relevant:
            p.answered.add(prod)
            if failing:
                self.fail(key, self.now)
        out = call()
        if not relevant:
            assert out == []
        self.apply(out)

    @rule(key=keys_st, prod=prods_st)
    def done(self, key, prod):
        p = self.live.get(key)
        if p is not None and prod in p.expected:
            p.done.add(prod)
        self._answer(key, prod, lambda: self.c.on_done(key, prod, self.now), False)

    @rule(key=keys_st, prod=prods_st)
    def failed(self, key, prod):
        p = self.live.get(key)
        if p is not None and prod in p.done:  # a failure replayed after that producer's done: ignored
            assert self.c.on_failed(key, prod, "boom", self.now) == []
            return
        self._answer(key, prod, lambda: self.c.on_failed(key, prod, "boom", self.now), True)

    @rule(key=keys_st, prod=prods_st)
    def revoke_ack(self, key, prod):
        self._answer(key, prod, lambda: self.c.on_revoke_ack(key, prod, self.now), False)

    @rule(key=keys_st)
    def abort(self, key):
        if key in self.live:
            self.fail(key, self.now)
            self.apply(self.c.abort(key, "abort", self.now))
        else:
            assert self.c.abort(key, "abort", self.now) == []
            self.raise_floor(key, key.attempt + 1)

    @rule(prod=prods_st)
    def producer_gone(self, prod):
        """Its process exited: every key waiting on it is answered by it (nothing more lands) and fails."""
        for key, p in self.live.items():
            if prod in p.expected and prod not in p.answered:
                p.answered.add(prod)
                self.fail(key, self.now)
        self.apply(self.c.on_producer_gone(prod, "exited", self.now))

    @rule(dt=st.sampled_from([0.0, 1.0, 10.0, 30.0, 50.0]))
    def advance(self, dt):
        self.now += dt

    @rule()
    def tick(self):
        for key, p in self.live.items():
            if p.failed_at is None and self.now >= p.deadline:
                self.fail(key, self.now)
        self.apply(self.c.tick(self.now))

    # ---- invariants --------------------------------------------------------------------------------
    @invariant()
    def agrees_with_model(self):
        assert len(self.c) == len(self.live)
        for key in KEYS:
            assert (key in self.c) == (key in self.live)
        for key, p in self.live.items():
            # prompt: a key that can end does not wait for a tick
            assert not (p.failed_at is None and p.done >= p.expected), f"{key} complete but not ended"
            assert not (p.failed_at is not None and not p.in_doubt()), f"{key} failed, nothing in doubt, not ended"
            if p.failed_at is not None:
                assert p.must_revoke - p.answered <= p.revoked, f"{key}: producers in doubt were not revoked"
        want: dict = {}
        for key, p in self.live.items():
            if p.failed_at is None:
                for prod in p.expected - p.done:
                    want.setdefault(prod, []).append(key)
        got = self.c.waiting_keys()
        assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in want.items()}
        owing = set()
        for p in self.live.values():
            owing |= (p.expected - p.done) if p.failed_at is None else p.in_doubt()
        assert self.c.producers_owing() == owing

    @invariant()
    def ends_at_most_once(self):
        for key, n in self.ended.items():
            assert n <= self.accepted[key]

    def teardown(self):
        # time runs out: every key ends, within timeout + fence wait
        self.now += TIMEOUT
        self.tick()
        self.now += FENCE
        self.tick()
        assert len(self.c) == 0 and not self.live
        assert self.ended == self.accepted


CompletionMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_completion_state_machine = CompletionMachine.TestCase


def test_second_start_of_a_live_key_changes_nothing():
    c = started()
    assert c.start(K, BOTH, 1.0) == []  # not a Received: the key is live and WRITEs may land
    assert K in c and c.wants_registration(K)


def test_failing_key_wants_no_more_registrations():
    c = started(expected=BOTH, register=False)
    c.on_registered(K, P0)
    out = c.on_failed(K, P0, "boom", 1.0)
    assert not c.wants_registration(K) and [type(a).__name__ for a in out] == ["Received"]


def test_failure_replayed_after_done_is_ignored():
    c = started()
    assert c.on_done(K, P0, 1.0) == []
    assert c.on_failed(K, P0, "stale replay", 1.5) == []
    assert c.on_done(K, P1, 2.0) == [Received(K, True, "")]
