"""Consumer-side completion: a request's KV is usable only after every expected producer rank is done.

Pure state machine, time passed in.  A key ends exactly once, with a `Received` result, and only when
no WRITE into its blocks can still land:

    all expected producers sent WriteDone           -> Received(ok=True): KV usable
    WriteFailed / deadline / engine abort           -> revoke every producer rank that may still write,
                                                       then Received(ok=False) once each has answered
                                                       (RevokeAck, WriteDone or WriteFailed) or the
                                                       fence wait ran out (the producer's write bound)
    producer rank gone (its process exited)        -> that rank is quiet for every key that waits on it
                                                       (a dead process writes nothing): each such key
                                                       fails at once, revoking only the live ranks
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush_common.protocol.identity import AttemptFloor, TransferKey

Producer = tuple[str, int]  # (producer engine id, producer rank)


@dataclass(frozen=True)
class Received:
    """Final word on a key: the engine may use (ok) or free/reuse (not ok) its blocks now."""

    key: TransferKey
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class SendRevoke:
    key: TransferKey
    producer: Producer
    reason: str


@dataclass
class _Pending:
    expected: frozenset[Producer]
    deadline: float
    registered: set[Producer] = field(default_factory=set)  # registration sent: a WRITE may come
    done: set[Producer] = field(default_factory=set)
    quiet: set[Producer] = field(default_factory=set)  # failed or acked: nothing more will land
    failure: str | None = None
    fence_deadline: float = 0.0

    def in_doubt(self) -> set[Producer]:
        return self.registered - self.done - self.quiet


class Completion:
    def __init__(self, *, transfer_timeout_s: float, fence_wait_s: float, tombstone_s: float = 600.0):
        """`fence_wait_s` bounds how long a revoked, silent producer may still write: its registration
        TTL (heartbeats stop on failure) plus its write timeout plus a grace (EndpointConfig.fence_wait_s)."""
        self.transfer_timeout_s = transfer_timeout_s
        self.fence_wait_s = fence_wait_s
        self.floor = AttemptFloor(tombstone_s)
        self._pending: dict[TransferKey, _Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, key: TransferKey) -> bool:
        return key in self._pending

    def waiting_keys(self) -> dict[Producer, list[TransferKey]]:
        """Keys still waiting for data, per producer rank (for heartbeats)."""
        out: dict[Producer, list[TransferKey]] = {}
        for key, p in self._pending.items():
            if p.failure is None:
                for prod in p.expected - p.done:
                    out.setdefault(prod, []).append(key)
        return out

    def start(self, key: TransferKey, expected: frozenset[Producer], now: float) -> list[Received]:
        """Begin waiting for `key`.  A key already in progress is left as it is (callers check first:
        answering it would end a live key while WRITEs may still land in its blocks)."""
        if key in self._pending:
            return []
        refusal = self.floor.refusal(key)
        if refusal:
            return [Received(key, False, refusal)]
        if not expected:
            return [Received(key, False, "no producer rank is routed to this consumer rank")]
        self.floor.raise_to(key.transfer_id, key.attempt, now)
        self._pending[key] = _Pending(expected=expected, deadline=now + self.transfer_timeout_s)
        return []

    def repoint(self, key: TransferKey, expected: frozenset[Producer]) -> bool:
        """Wait for `expected` instead of the producers `key` named (their address answers as another engine
        now).  Only while nothing was registered for the key -- no byte can come from the producers it waited
        for -- and it is not failing; False otherwise (the key is left as it was)."""
        p = self._pending.get(key)
        if p is None or p.failure is not None or p.registered or not expected:
            return False
        p.expected, p.done, p.quiet = frozenset(expected), set(), set()
        return True

    def keys_registered_with(self, producer: Producer) -> set[TransferKey]:
        """Keys that registered with this producer rank and have not heard its last word yet."""
        return {key for key, p in self._pending.items() if producer in p.in_doubt()}

    def wants_registration(self, key: TransferKey) -> bool:
        """Still waiting and not failing: registering now is allowed (a failing key must not invite WRITEs)."""
        p = self._pending.get(key)
        return p is not None and p.failure is None

    def on_registered(self, key: TransferKey, producer: Producer) -> None:
        """Call just before the registration is sent: from then on a WRITE may land."""
        p = self._pending.get(key)
        if p is not None:
            p.registered.add(producer)

    def on_unsent(self, key: TransferKey, producer: Producer) -> None:
        """The registration's send raised: it never left, so no WRITE can come from it (it is sent again)."""
        p = self._pending.get(key)
        if p is not None:
            p.registered.discard(producer)

    def on_done(self, key: TransferKey, producer: Producer, now: float) -> list[Received | SendRevoke]:
        p = self._pending.get(key)
        if p is None or producer not in p.expected:
            return []
        p.done.add(producer)
        return self._advance(key, p, now)

    def on_failed(self, key: TransferKey, producer: Producer, reason: str, now: float) -> list[Received | SendRevoke]:
        p = self._pending.get(key)
        if p is None or producer not in p.expected or producer in p.done:
            return []  # a failure after that producer's done is a replay: its bytes are in
        p.quiet.add(producer)
        return self._fail(key, p, f"producer rank {producer[1]}: {reason}", now)

    def on_revoke_ack(self, key: TransferKey, producer: Producer, now: float) -> list[Received | SendRevoke]:
        p = self._pending.get(key)
        if p is None or producer not in p.expected:
            return []
        p.quiet.add(producer)
        return self._advance(key, p, now)

    def producers_owing(self) -> set[Producer]:
        """Producer ranks some key still waits on: for its bytes, or (failing) for its last word."""
        out: set[Producer] = set()
        for p in self._pending.values():
            out |= (p.expected - p.done) if p.failure is None else p.in_doubt()
        return out

    def on_producer_gone(self, producer: Producer, reason: str, now: float,
                         keep: frozenset[TransferKey] = frozenset()) -> list[Received | SendRevoke]:
        """`producer`'s process is known to have exited: nothing more can land from it, and nothing more
        will come.  Every key that still waits on it fails now; keys it already finished are untouched, and so
        are those in `keep` (a pull READ of our own from it still posted: its end fails the key)."""
        out: list[Received | SendRevoke] = []
        for key, p in list(self._pending.items()):
            if producer not in p.expected or producer in p.done or producer in p.quiet or key in keep:
                continue
            p.quiet.add(producer)
            out += self._fail(key, p, f"producer rank {producer[1]} is gone: {reason}", now)
        return out

    def abort(self, key: TransferKey, reason: str, now: float) -> list[Received | SendRevoke]:
        p = self._pending.get(key)
        if p is None:
            self.floor.end(key, now)
            return []
        return self._fail(key, p, reason or "aborted by consumer", now)

    def tick(self, now: float) -> list[Received | SendRevoke]:
        out: list[Received | SendRevoke] = []
        for key, p in list(self._pending.items()):
            if p.failure is None and now >= p.deadline:
                missing = sorted(r for _, r in p.expected - p.done)
                out += self._fail(key, p, f"timed out waiting for producer ranks {missing}", now)
            elif p.failure is not None and now >= p.fence_deadline:
                unanswered = sorted(r for _, r in p.in_doubt())
                out.append(self._end(key, False, f"{p.failure} (revoke unanswered by ranks {unanswered}; fence wait elapsed)", now))
        for key in self._pending:  # a live key keeps refusing its older attempts, however long it lives
            self.floor.raise_to(key.transfer_id, key.attempt, now)
        self.floor.prune(now)
        return out

    def _fail(self, key: TransferKey, p: _Pending, reason: str, now: float) -> list[Received | SendRevoke]:
        if p.failure is not None:
            return self._advance(key, p, now)
        p.failure = reason
        p.fence_deadline = now + self.fence_wait_s
        revokes: list[Received | SendRevoke] = [SendRevoke(key, prod, reason) for prod in sorted(p.in_doubt())]
        return revokes + self._advance(key, p, now)

    def _advance(self, key: TransferKey, p: _Pending, now: float) -> list[Received | SendRevoke]:
        if p.failure is None:
            if p.done >= p.expected:
                return [self._end(key, True, "", now)]
            return []
        if not p.in_doubt():
            return [self._end(key, False, p.failure, now)]
        return []

    def _end(self, key: TransferKey, ok: bool, reason: str, now: float) -> Received:
        del self._pending[key]
        self.floor.end(key, now)
        return Received(key, ok, reason)
