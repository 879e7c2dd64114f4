"""Chaos runs of the protocol core: real producer and consumer processes over real NIXL, a seeded
schedule of faults, and the invariants of tests/chaos/harness.py checked after every run.

CI runs one seed per scenario (`-m chaos`).  `scripts/chaos/chaos.sh` runs many (KVPUSH_CHAOS_SEEDS).
"""

from __future__ import annotations

import os
import time

import pytest

from harness import FAST, Chaos

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(240)]  # `chaos` comes from the folder

SEEDS = [int(s) for s in os.environ.get("KVPUSH_CHAOS_SEEDS", "1").split(",")]
ROWS = os.environ.get("KVPUSH_CHAOS_ROWS")  # scripts/chaos/chaos.sh: append one JSON line per run here


def record(name: str, seed: int, summary: dict, **extra) -> None:
    if ROWS:
        import json

        with open(ROWS, "a") as f:
            f.write(json.dumps({"scenario": name, "seed": seed, **summary, **extra}) + "\n")


def warm(ch: Chaos) -> None:
    """One clean request so that the consumer knows the producer (handshake done)."""
    ch.clean_batch(1)


@pytest.mark.parametrize("seed", SEEDS)
def test_notifications_dropped_duplicated_delayed_reordered(seed):
    noisy = dict(drop_notif=0.15, dup_notif=0.2, delay_notif=0.2, delay_s=(0.05, 0.6), reorder_notif=0.2)
    with Chaos(seed, p_faults=dict(noisy, seed=seed), d_faults=dict(noisy, seed=seed + 1000)) as ch:
        for i in range(12):
            r = ch.new_request()
            ch.pair(r)
            if ch.rng.random() < 0.2:
                ch.abort(r)
            time.sleep(ch.rng.uniform(0, 0.2))
            ch.collect()
        summary = ch.check()
        record("notif_chaos", seed, summary)


@pytest.mark.parametrize("seed", SEEDS)
def test_failed_posts_and_transfers_ending_in_err(seed):
    """Posts that fail and WRITEs that end in ERR fail their requests (every request still ends, no byte
    lands wrong: ch.check); with 40 % + 40 % faults over 10 requests, all ten succeeding has p < 1e-4."""
    with Chaos(seed, p_faults=dict(seed=seed, fail_post=0.4, err_xfer=0.4)) as ch:
        for i in range(10):
            ch.pair(ch.new_request())
            ch.collect()
        summary = ch.check()
        assert summary["failed"] >= 1 and summary["ok"] + summary["failed"] == summary["requests"], summary
        record("failed_posts", seed, summary)


@pytest.mark.parametrize("seed", SEEDS)
def test_unexpected_exceptions_in_worker_steps_lose_no_request(seed):
    """send_notif / get_notifs raise unexpected errors (a bug mid-step): every request still ends, and
    no result computed earlier in the same step is lost."""
    crash = dict(crash_send=0.15, crash_fetch=0.1)
    with Chaos(seed, p_faults=dict(crash, seed=seed), d_faults=dict(crash, seed=seed + 1000)) as ch:
        batch = [ch.new_request() for _ in range(10)]
        for r in batch:  # several expects in one worker step: one crashing must not drop the others
            ch.expect(r)
        for r in batch:
            ch.ready(r)
        record("crash_steps", seed, ch.check())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("point", ["before_registration", "mid_write", "after_write_before_completion"])
def test_producer_killed_then_restarted(seed, point):
    p_faults = dict(seed=seed, post_delay_s=1.0) if point == "mid_write" else None
    d_faults = (dict(seed=seed, delay_notif=1.0, delay_s=(1.0, 1.0), match_tag="done")
                if point == "after_write_before_completion" else None)
    with Chaos(seed, p_faults=p_faults, d_faults=d_faults) as ch:
        warm(ch)
        victims = [ch.new_request() for _ in range(2)]
        if point == "before_registration":
            ch.P.kill()
            ch.log("killed P before the registrations")
            for r in victims:
                ch.expect(r)
            time.sleep(0.5)
            for r in victims:
                r.ready_sent = False  # its prefill leg never ran
            ch.P.start(ch.port)
            ch.log("restarted P")
        else:
            for r in victims:
                ch.pair(r)
            time.sleep(0.3)  # WRITE held in flight / WriteDone held back at the consumer
            ch.restart(ch.P)
        ch.settle()
        summary = ch.check()
        ch.clean_batch(3)  # the restarted producer rejoins at once
        record(f"kill_producer_{point}", seed, summary)


@pytest.mark.parametrize("seed", SEEDS)
def test_consumer_killed_after_registering_then_restarted(seed):
    """The producer still holds the dead consumer's registration when the consumer's successor (same
    engine id and rank) handshakes: the old block ids must never be written into the new process."""
    cfg = dict(reg_ttl_s=5.0, lease_s=6.0)
    with Chaos(seed, p_cfg=cfg, d_cfg=cfg) as ch:
        warm(ch)
        old = ch.new_request(n=64)
        ch.expect(old)
        time.sleep(0.3)  # registered at the producer
        ch.restart(ch.D)
        fresh = ch.new_request()
        ch.expect(fresh)  # the new consumer handshakes; the producer replaces its peer entry
        time.sleep(0.5)
        ch.ready(old)  # the prefill of the dead consumer's request finishes now
        ch.ready(fresh)
        ch.settle()
        summary = ch.check()
        assert old.p_outcome in ("failed", "expired", "cancelled"), old
        ch.clean_batch(3)
        record("kill_consumer_after_registration", seed, summary)


@pytest.mark.parametrize("seed", SEEDS)
def test_consumer_killed_mid_write(seed):
    with Chaos(seed, p_faults=dict(seed=seed, post_delay_s=1.0)) as ch:
        warm(ch)
        rs = [ch.new_request() for _ in range(2)]
        for r in rs:
            ch.pair(r)
        time.sleep(0.3)
        ch.restart(ch.D)
        ch.settle()
        summary = ch.check()
        ch.clean_batch(2)
        record("kill_consumer_mid_write", seed, summary)


@pytest.mark.parametrize("seed", SEEDS)
def test_producer_paused_longer_than_a_lease(seed):
    """SIGSTOP the producer with registrations pending, longer than the consumer's whole bound; its
    Revokes are lost.  After SIGCONT the prefill finishes: nothing may land in the consumer's blocks,
    which it freed and reused meanwhile."""
    with Chaos(seed, p_faults=dict(seed=seed, drop_notif=1.0, match_tag="revoke")) as ch:
        warm(ch)
        waiting = [ch.new_request() for _ in range(2)]
        orphan = ch.new_request()
        ch.ready(orphan)  # ready KV nobody registers: released by the lease
        for r in waiting:
            ch.expect(r)
        time.sleep(0.5)  # registered, heartbeats flowing
        ch.P.stop()
        ch.log("SIGSTOP P")
        deadline = time.monotonic() + ch.bound_s + 1.5
        while time.monotonic() < deadline:
            ch.collect()
            ch.check_free_blocks_clean()
            time.sleep(0.2)
        assert all(r.d_end is not None and not r.ok for r in waiting), [(r.tid, r.d_end) for r in waiting]
        ch.P.cont()
        ch.log("SIGCONT P")
        for r in waiting:  # the paused prefill completes
            ch.ready(r)
        time.sleep(1.0)
        ch.check_free_blocks_clean()
        summary = ch.check()
        ch.clean_batch(3)
        record("sigstop_producer", seed, summary, paused_s=round(ch.bound_s + 1.5, 1))


@pytest.mark.parametrize("seed", SEEDS)
def test_consumer_paused_longer_than_a_lease(seed):
    with Chaos(seed) as ch:
        warm(ch)
        rs = [ch.new_request() for _ in range(2)]
        for r in rs:
            ch.expect(r)
        time.sleep(0.3)
        ch.D.stop()
        ch.log("SIGSTOP D")
        for r in rs:
            ch.ready(r)
        time.sleep(FAST["lease_s"] + 1.0)
        ch.D.cont()
        ch.log("SIGCONT D")
        summary = ch.check()
        ch.clean_batch(2)
        record("sigstop_consumer", seed, summary, paused_s=FAST["lease_s"] + 1.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_handshake_timeout_then_producer_recovers(seed):
    with Chaos(seed) as ch:
        ch.P.stop()  # the consumer's first handshake gets no answer
        rs = [ch.new_request() for _ in range(2)]
        for r in rs:
            ch.expect(r)
        time.sleep(FAST["handshake_timeout_s"] + 1.0)
        ch.collect()
        assert all(r.ok is False and "handshake" in r.reason for r in rs), [(r.ok, r.reason) for r in rs]
        ch.P.cont()
        summary = ch.check()
        ch.clean_batch(2)  # the next request handshakes again
        record("handshake_timeout", seed, summary)


@pytest.mark.parametrize("seed", SEEDS)
def test_decode_aborts_right_after_registration_and_preemption_retries(seed):
    with Chaos(seed) as ch:
        for i in range(6):
            r = ch.new_request()
            ch.expect(r)
            if ch.rng.random() < 0.5:
                ch.abort(r, "decode aborted")
                ch.ready(r)
            else:  # preempted: the router retries with the next attempt and new blocks
                ch.abort(r, "preempted")
                retry = ch.new_request(n=r.n, attempt=1, tid=r.tid)
                retry.p_blocks, r.p_blocks = r.p_blocks, retry.p_blocks  # same source KV
                retry.p_digest = None
                ch.expect(retry)
                if ch.rng.random() < 0.5:
                    ch.ready(r)  # the old attempt's prefill finishes late
                ch.ready(retry)
            ch.collect()
        summary = ch.check()
        retries = [r for r in ch.reqs.values() if r.attempt == 1]
        assert all(r.ok for r in retries), [(r.tid, r.reason) for r in retries]
        record("abort_and_preempt_retry", seed, summary)


def test_idle_peers_are_evicted_and_come_back():
    cfg = dict(peer_idle_s=8.0)
    with Chaos(1, p_cfg=cfg, d_cfg=cfg) as ch:
        warm(ch)
        assert ch.D.proc.call("state")["peers"] and ch.P.proc.call("state")["peers"]
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline and (ch.D.proc.call("state")["peers"] or ch.P.proc.call("state")["peers"]):
            time.sleep(0.5)
        assert not ch.D.proc.call("state")["peers"] and not ch.P.proc.call("state")["peers"]
        ch.clean_batch(2)
        record("peer_eviction", 1, ch.check())
