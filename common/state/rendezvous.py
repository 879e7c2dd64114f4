"""Producer-side rendezvous: pair destination registrations with local KV readiness.

Pure state machine (no threads, no I/O, time passed in) so every interleaving can be tested.  Inputs
are events; outputs are actions the worker thread carries out.  A destination is one consumer rank,
`(consumer_engine, consumer_rank)`.  For a key:

    registration + ready  -> StartWrite per destination (whichever arrives second triggers it)
    write result          -> when every expected destination is finished: Release(outcome)
    revoke                -> drop the destination's pending registration, ack once nothing is in flight
    unneeded              -> the consumer computes the prompt itself: release as soon as the KV is ready
    deadlines             -> unmatched registrations fail after their TTL; ready KV is released
                             when its lease (renewed by heartbeats) runs out with nothing in flight
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from kvpush_common.protocol.identity import AttemptFloor, TransferKey
from kvpush_common.protocol.wire import Register

Dest = tuple[str, int]  # (consumer engine id, consumer rank)


class Outcome(str, enum.Enum):
    DONE = "done"  # every expected destination was written
    FAILED = "failed"  # a write failed, was refused, or the attempt was superseded
    EXPIRED = "expired"  # lease or registration deadline passed
    CANCELLED = "cancelled"  # revoked by the consumer or aborted by the producer engine
    UNNEEDED = "unneeded"  # the consumer said it needs no bytes (it computes the short tail itself)


@dataclass(frozen=True)
class ReadyKV:
    block_ids: tuple[int, ...]
    num_tokens: int
    fence: object = None  # device backend's "KV written" token


# ---- actions -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StartWrite:
    key: TransferKey
    dest: Dest
    reg: Register
    ready: ReadyKV


@dataclass(frozen=True)
class SendFailed:
    key: TransferKey
    dest: Dest
    code: str
    reason: str


@dataclass(frozen=True)
class SendRevokeAck:
    key: TransferKey
    dest: Dest


@dataclass(frozen=True)
class Release:
    """The producer engine may free (or reuse) this key's source blocks."""

    key: TransferKey
    outcome: Outcome
    reason: str = ""


Action = StartWrite | SendFailed | SendRevokeAck | Release


@dataclass
class _Entry:
    ready: ReadyKV | None = None
    lease_deadline: float = 0.0
    pending: dict[Dest, tuple[Register, float]] = field(default_factory=dict)  # reg, deadline
    writing: set[Dest] = field(default_factory=set)
    finished: dict[Dest, bool] = field(default_factory=dict)  # dest -> written ok
    expected: frozenset[Dest] | None = None
    consumer_engine: str | None = None
    ack_after_write: set[Dest] = field(default_factory=set)
    closing: Outcome | None = None  # set when the entry must end once nothing is in flight
    closing_reason: str = ""


class Rendezvous:
    def __init__(
        self,
        *,
        expected_dests: Callable[[str, int], frozenset[Dest]],
        lease_s: float = 30.0,
        tombstone_s: float = 600.0,
        max_entries: int = 65536,
    ):
        """`expected_dests(consumer_engine, consumer_tp)`: the consumer ranks this producer rank writes."""
        self._expected_dests = expected_dests
        self.lease_s = lease_s
        self.max_entries = max_entries
        self.floor = AttemptFloor(tombstone_s)
        self._entries: dict[TransferKey, _Entry] = {}
        # keys a consumer declined before their KV was ready (bounded, oldest dropped: the floor still refuses them)
        self._unneeded: OrderedDict[TransferKey, str] = OrderedDict()

    # ---- queries ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def has_unmatched(self) -> bool:
        return any(e.pending or e.ready for e in self._entries.values())

    def has_ready(self) -> bool:
        """Some key's KV is ready (waiting for a registration, or being written)."""
        return any(e.ready is not None for e in self._entries.values())

    def entry_state(self, key: TransferKey) -> dict | None:
        e = self._entries.get(key)
        if e is None:
            return None
        return {
            "ready": e.ready is not None,
            "pending": sorted(e.pending),
            "writing": sorted(e.writing),
            "finished": dict(e.finished),
        }

    # ---- events ----------------------------------------------------------------------------------
    def on_register(self, reg: Register, now: float, arrived_after: float | None = None) -> list[Action]:
        """`arrived_after`: the registration was not there before this time (default `now`); its ttl
        counts from then, and one already past it is refused as expired."""
        key = TransferKey(reg.transfer_id, reg.attempt)
        dest = (reg.consumer_engine, reg.consumer_rank)
        entry = self._entries.get(key)
        # Duplicates first: a live key may already be below the floor (superseded, or a newer attempt
        # revoked), and a "stale" WriteFailed would tell its consumer nothing lands while a WRITE may.
        if entry is not None and (dest in entry.pending or dest in entry.writing or dest in entry.finished):
            return []  # duplicate notification
        refusal = self.floor.refusal(key)
        if refusal:
            return [SendFailed(key, dest, "stale", refusal)]
        since = now if arrived_after is None else min(now, arrived_after)
        if since + reg.ttl_ms / 1000.0 <= now:
            return [SendFailed(key, dest, "expired", f"registration of unknown age: fetched {now - since:.1f} s "
                                                     f"after the producer last looked, past its ttl")]
        actions = self._supersede_older(key, now)
        entry = self._entries.get(key)
        bound = entry is not None and entry.consumer_engine is not None
        if bound and reg.consumer_engine != entry.consumer_engine:
            return actions + [SendFailed(key, dest, "conflict", f"{key} is bound to consumer {entry.consumer_engine}")]
        # A refused registration neither creates an entry nor binds the key to its consumer engine.
        expected = entry.expected if bound else self._expected_dests(reg.consumer_engine, reg.consumer_tp)
        if dest not in expected:
            return actions + [SendFailed(key, dest, "not_routed", f"producer does not write into consumer rank {dest[1]}")]
        if entry is None:
            if len(self._entries) >= self.max_entries:
                return actions + [SendFailed(key, dest, "overloaded", "producer rendezvous table is full")]
            entry = self._entries[key] = _Entry()
        if not bound:
            entry.consumer_engine = reg.consumer_engine
            entry.expected = expected
        if entry.closing is not None:
            entry.finished[dest] = False
            return actions + [SendFailed(key, dest, entry.closing.value, entry.closing_reason)]
        entry.pending[dest] = (reg, since + reg.ttl_ms / 1000.0)
        return actions + self._match(key, entry, now)

    def on_ready(self, key: TransferKey, ready: ReadyKV, now: float) -> list[Action]:
        entry = self._entries.get(key)
        if entry is not None and entry.ready is not None:
            return []  # engine reported readiness twice; keep the first (releasing now would free KV in flight)
        refusal = self.floor.refusal(key)
        if refusal:
            return [self._refused(key, refusal)]
        actions = self._supersede_older(key, now)
        entry = self._entries.setdefault(key, _Entry())
        if entry.ready is not None:
            return actions  # engine reported readiness twice; keep the first
        entry.ready = ready
        entry.lease_deadline = now + self.lease_s
        if entry.closing is not None:  # e.g. every destination already revoked
            return actions + self._maybe_end(key, entry, now)
        return actions + self._match(key, entry, now)

    def on_write_result(self, key: TransferKey, dest: Dest, ok: bool, now: float) -> list[Action]:
        entry = self._entries.get(key)
        if entry is None or dest not in entry.writing:
            return []
        entry.writing.discard(dest)
        entry.finished[dest] = ok
        actions: list[Action] = []
        if dest in entry.ack_after_write:
            entry.ack_after_write.discard(dest)
            actions.append(SendRevokeAck(key, dest))
        return actions + self._maybe_end(key, entry, now)

    def on_revoke(self, key: TransferKey, dest: Dest, now: float) -> list[Action]:
        entry = self._entries.get(key)
        if entry is None:
            # Unknown (registration lost, or not yet arrived): tombstone so it can never be acted on.
            self.floor.end(key, now)
            return [SendRevokeAck(key, dest)]
        if entry.consumer_engine is not None and dest[0] != entry.consumer_engine:
            return [SendRevokeAck(key, dest)]  # that engine has nothing pending or in flight here
        # The consumer gave up on this key: nothing more is written for it, into any of its ranks.
        reason = f"revoked by consumer rank {dest[1]}"
        if dest in entry.writing:
            entry.ack_after_write.add(dest)
            return self._close(key, entry, Outcome.CANCELLED, reason, now)
        entry.pending.pop(dest, None)
        entry.finished.setdefault(dest, False)
        return [SendRevokeAck(key, dest)] + self._close(key, entry, Outcome.CANCELLED, reason, now)

    def on_unneeded(self, key: TransferKey, dest: Dest, reason: str, now: float) -> list[Action]:
        """The consumer engine computes this attempt's prompt itself (every rank says so; the first is
        enough): nothing is written for it into any of its ranks; the KV is released once ready and
        nothing is in flight (at once if already ready), instead of at the lease end."""
        why = f"unneeded by consumer {dest[0]}" + (f": {reason}" if reason else "")
        entry = self._entries.get(key)
        if entry is None:
            if self.floor.refusal(key) is None:  # not ended yet: remember why its readiness will be refused
                self.floor.end(key, now)
                self._unneeded[key] = why
                while len(self._unneeded) > self.max_entries:
                    self._unneeded.popitem(last=False)
            return []
        if entry.consumer_engine is not None and dest[0] != entry.consumer_engine:
            return []  # bound to another consumer engine: not this one's to decline
        return self._close(key, entry, Outcome.UNNEEDED, why, now)

    def on_heartbeat(self, keys: list[TransferKey], now: float, consumer_engine: str | None = None,
                     arrived_after: float | None = None) -> None:
        """Renew leases and registration deadlines, counted from `arrived_after` (default `now`: see
        on_register); a key bound to another consumer is left alone."""
        now = now if arrived_after is None else min(now, arrived_after)
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                continue
            if consumer_engine is not None and entry.consumer_engine not in (None, consumer_engine):
                continue
            if entry.ready is not None:
                entry.lease_deadline = max(entry.lease_deadline, now + self.lease_s)
            for dest, (reg, deadline) in list(entry.pending.items()):
                entry.pending[dest] = (reg, max(deadline, now + reg.ttl_ms / 1000.0))

    def on_unread(self, key: TransferKey, ready: ReadyKV, now: float, reason: str) -> list[Action]:
        """KV ready that no consumer rank will read from this producer rank (head replication, a
        decode TP that routes elsewhere): released at once, not held to the lease end.  A key that
        already has an entry (a registration came anyway) takes the normal path."""
        if key in self._entries:
            return self.on_ready(key, ready, now)
        refusal = self.floor.refusal(key)
        if refusal:
            return [self._refused(key, refusal)]
        actions = self._supersede_older(key, now)
        self.floor.end(key, now)  # a late registration for it is refused as stale
        return actions + [Release(key, Outcome.DONE, reason)]

    def on_unusable_ready(self, key: TransferKey, reason: str, now: float) -> list[Action]:
        """The engine's readiness could not be used (block ids that are not integers): fail the waiting
        registrations and hand the blocks back.  A key already ready keeps its first readiness."""
        entry = self._entries.get(key)
        if entry is not None and entry.ready is not None:
            return []
        actions = self._close(key, entry, Outcome.FAILED, reason, now) if entry is not None else []
        self.floor.end(key, now)
        return actions + [Release(key, Outcome.FAILED, reason)]

    def on_local_abort(self, key: TransferKey, reason: str, now: float) -> list[Action]:
        """The producer engine dropped the request (e.g. its prefill was aborted)."""
        entry = self._entries.get(key)
        if entry is None:
            self.floor.end(key, now)
            return []
        return self._close(key, entry, Outcome.CANCELLED, reason or "aborted by producer", now)

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for key, entry in list(self._entries.items()):
            for dest, (reg, deadline) in list(entry.pending.items()):
                if deadline <= now:
                    del entry.pending[dest]
                    entry.finished[dest] = False
                    actions.append(SendFailed(key, dest, "expired", "registration expired before the KV was ready"))
            if entry.ready is not None and entry.lease_deadline <= now and entry.closing is None:
                actions += self._close(key, entry, Outcome.EXPIRED, "producer lease expired", now)
            else:
                actions += self._maybe_end(key, entry, now)
        for key in self._entries:  # a live key keeps refusing its older attempts, however long it lives
            self.floor.raise_to(key.transfer_id, key.attempt, now)
        self.floor.prune(now)
        for key in [k for k in self._unneeded if self.floor.refusal(k) is None]:  # pruned from the floor
            del self._unneeded[key]
        return actions

    # ---- internals -------------------------------------------------------------------------------
    def _refused(self, key: TransferKey, refusal: str) -> Release:
        """Ready KV of an ended key: released at once, as unneeded when its consumer declined it."""
        declined = self._unneeded.pop(key, None)
        return Release(key, Outcome.UNNEEDED, declined) if declined is not None else Release(key, Outcome.FAILED, refusal)

    def _match(self, key: TransferKey, entry: _Entry, now: float) -> list[Action]:
        if entry.ready is None or entry.closing is not None:
            return []
        actions: list[Action] = []
        for dest, (reg, deadline) in list(entry.pending.items()):
            del entry.pending[dest]
            if deadline <= now:  # expired but not yet ticked: the consumer's fence wait may be running out
                entry.finished[dest] = False
                actions.append(SendFailed(key, dest, "expired", "registration expired before the KV was ready"))
                continue
            entry.writing.add(dest)
            actions.append(StartWrite(key, dest, reg, entry.ready))
        return actions + self._maybe_end(key, entry, now)

    def _close(self, key: TransferKey, entry: _Entry, outcome: Outcome, reason: str, now: float) -> list[Action]:
        """End the entry: fail pending registrations now; release once in-flight writes finish."""
        entry.closing = entry.closing or outcome
        entry.closing_reason = entry.closing_reason or reason
        actions: list[Action] = []
        for dest in list(entry.pending):
            del entry.pending[dest]
            entry.finished[dest] = False
            actions.append(SendFailed(key, dest, outcome.value, reason))
        return actions + self._maybe_end(key, entry, now)

    def _maybe_end(self, key: TransferKey, entry: _Entry, now: float) -> list[Action]:
        """End the entry once nothing is pending or in flight and nothing is left to write."""
        if entry.writing or entry.pending:
            return []
        every_dest_ended = entry.expected is not None and entry.expected <= entry.finished.keys()
        # Without ready KV there is nothing to hold: once a destination failed, the key cannot succeed.
        failed_before_ready = entry.ready is None and not all(entry.finished.values())
        if entry.closing is None and not every_dest_ended and not failed_before_ready:
            return []
        del self._entries[key]
        self.floor.end(key, now)  # late readiness or registrations for this key are refused from now on
        if entry.ready is None:
            return []
        written = entry.expected is not None and all(entry.finished.get(d, False) for d in entry.expected)
        if written and entry.closing in (None, Outcome.EXPIRED):  # the lease ran out under a WRITE that succeeded
            return [Release(key, Outcome.DONE)]
        outcome = entry.closing or Outcome.FAILED
        return [Release(key, outcome, entry.closing_reason or "a write into a destination rank failed")]

    def _supersede_older(self, key: TransferKey, now: float) -> list[Action]:
        """A newer attempt arrived: older attempts of the same transfer id end now."""
        self.floor.raise_to(key.transfer_id, key.attempt, now)
        actions: list[Action] = []
        for other, entry in list(self._entries.items()):
            if other.transfer_id == key.transfer_id and other.attempt < key.attempt:
                actions += self._close(other, entry, Outcome.FAILED, f"superseded by attempt {key.attempt}", now)
        return actions
