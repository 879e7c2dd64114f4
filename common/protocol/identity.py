"""Request identity: a transfer id plus an attempt number, and the floor below which attempts are dead.

The router mints a fresh `transfer_id` per request and bumps `attempt` on every retry or reissue, so
an old registration can never be paired with a newer execution.  Ended keys raise the floor for a
while (a tombstone) so that late or replayed messages about them are refused, not acted on.
"""

from __future__ import annotations

from typing import NamedTuple


class TransferKey(NamedTuple):
    transfer_id: str
    attempt: int

    def __str__(self) -> str:
        return f"{self.transfer_id}#{self.attempt}"


class AttemptFloor:
    """Per transfer id, the lowest attempt still acceptable; entries expire after `ttl_s`."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._floor: dict[str, tuple[int, float]] = {}

    def refusal(self, key: TransferKey) -> str | None:
        """Why a message about `key` must be refused, or None if it may proceed."""
        entry = self._floor.get(key.transfer_id)
        if entry is None or key.attempt >= entry[0]:
            return None
        return f"attempt {key.attempt} of {key.transfer_id} is stale or ended (floor {entry[0]})"

    def raise_to(self, transfer_id: str, attempt: int, now: float) -> None:
        old = self._floor.get(transfer_id, (0, 0.0))[0]
        self._floor[transfer_id] = (max(old, attempt), now + self.ttl_s)

    def end(self, key: TransferKey, now: float) -> None:
        """Tombstone `key` itself and every older attempt."""
        self.raise_to(key.transfer_id, key.attempt + 1, now)

    def prune(self, now: float) -> None:
        dead = [tid for tid, (_, exp) in self._floor.items() if exp <= now]
        for tid in dead:
            del self._floor[tid]

    def __len__(self) -> int:
        return len(self._floor)
