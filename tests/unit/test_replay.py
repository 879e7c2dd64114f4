"""The replay window: each (sender, seq) accepted at most once, in bounded memory, time passed in."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush_common.protocol.replay import ReplayWindow

S1, S2, S3 = b"\x01" * 8, b"\x02" * 8, b"\x03" * 8


def test_window_slides_and_refuses_below_its_floor():
    w = ReplayWindow(window=4)
    for seq in (3, 1, 2, 0):
        assert w.check(S1, seq, 10.0, 10.0) is None
    assert "replayed" in w.check(S1, 2, 10.0, 10.0)
    assert w.check(S1, 4, 10.0, 10.0) is None  # pushes seq 0 out: the floor is 0
    assert "replayed" in w.check(S1, 0, 10.0, 10.0)
    assert w.check(S1, 6, 10.0, 10.0) is None  # the floor is 1 now; 5 was never seen and is above it
    assert w.check(S1, 5, 10.0, 10.0) is None
    assert "replayed" in w.check(S1, 1, 10.0, 10.0)


def test_age_and_skew_horizon():
    w = ReplayWindow(max_age_s=60)
    assert "horizon" in w.check(S1, 0, 0.0, 61.0)
    assert "ahead" in w.check(S1, 1, 122.0, 61.0)
    assert "number" in w.check(S1, 2, float("nan"), 61.0)
    assert w.check(S1, 3, 1.0, 61.0) is None


def test_silent_senders_expire_without_raising_the_floor():
    w = ReplayWindow(max_senders=2, max_age_s=60)
    assert w.check(S1, 0, 0.0, 0.0) is None
    assert w.check(S2, 0, 50.0, 50.0) is None
    assert w.check(S3, 0, 100.0, 100.0) is None  # S1 is past the horizon: dropped, not evicted
    assert len(w) == 2
    assert "horizon" in w.check(S1, 0, 0.0, 100.0)  # its old frames are refused by age
    assert w.check(S1, 1, 100.0, 100.0) is None  # and it may come back


def test_a_full_table_evicts_and_refuses_what_could_be_the_evicted_senders_replay():
    w = ReplayWindow(max_senders=2, max_age_s=600)
    assert w.check(S1, 0, 10.0, 10.0) is None
    assert w.check(S2, 0, 20.0, 20.0) is None
    assert w.check(S3, 0, 30.0, 30.0) is None  # evicts S1 (least recently heard), newest frame at 10
    assert len(w) == 2
    assert "evicted" in w.check(S1, 0, 10.0, 31.0)  # S1's old frame, replayed: refused
    assert w.check(S1, 1, 31.0, 31.0) is None  # S1's new frame is newer than anything evicted


SENDERS = [S1, S2, S3]
deliveries = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40)), max_size=200)
# a frame's time is fixed by its sender and seq (it is under the MAC): a replay repeats it
frame_times = st.lists(st.floats(0, 200), min_size=3 * 41, max_size=3 * 41)


@settings(max_examples=200, deadline=None)
@given(deliveries=deliveries, times=frame_times, window=st.integers(1, 8), max_senders=st.integers(1, 3))
def test_nothing_is_accepted_twice_and_memory_stays_bounded(deliveries, times, window, max_senders):
    w = ReplayWindow(window=window, max_senders=max_senders, max_age_s=50)
    accepted, now = set(), 0.0
    for s, seq in deliveries:
        sender, sent_at = SENDERS[s], times[s * 41 + seq]
        now = max(now, sent_at)  # the receiver's clock never goes back
        if w.check(sender, seq, sent_at, now) is None:
            assert (sender, seq) not in accepted
            accepted.add((sender, seq))
        assert len(w) <= max_senders
        assert all(len(s.seen) <= window and len(s.order) <= window for s in w._senders.values())


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 300), window=st.integers(1, 16), step=st.floats(0, 1))
def test_an_in_order_stream_is_always_accepted(n, window, step):
    w = ReplayWindow(window=window, max_senders=1)
    for i in range(n):
        assert w.check(S1, i, i * step, i * step) is None


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        ReplayWindow(window=0)


def test_an_evicted_sender_that_comes_back_cannot_replay_its_old_frames():
    """Found by the property test above: S1 evicted by S2, readmitted with a newer frame (evicting S2), then its
    first frame replayed.  The readmitted sender keeps the eviction horizon it was admitted under."""
    w = ReplayWindow(max_senders=1, max_age_s=600)
    assert w.check(S1, 0, 0.0, 0.0) is None
    assert w.check(S2, 0, 0.0, 0.0) is None  # evicts S1 (newest frame at 0)
    assert w.check(S1, 33, 5.0, 5.0) is None  # S1 back with a newer frame, evicting S2
    assert "evicted" in w.check(S1, 0, 0.0, 5.0)  # its frame from before the eviction: refused
    assert w.check(S1, 34, 6.0, 6.0) is None  # and its new frames still pass
