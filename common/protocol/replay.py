"""Refuses a signed frame that was accepted before: a bounded window per sender.

The MAC proves that a holder of the secret wrote a frame, not that it is new: a captured
`Register`, `Revoke` or `WriteDone` sent again later would verify. So every signed frame carries
(sender, seq, sent_at) under its MAC: `sender` is random per `Codec`, `seq` counts that codec's
frames, `sent_at` is its wall clock. A receiver accepts each (sender, seq) once:

- a frame older (or newer, by clock skew) than `max_age_s` is refused outright;
- per sender the last `window` accepted seqs are remembered, and every seq at or below the
  smallest one forgotten (`floor`) is refused: reordering within `window` frames is fine;
- at most `max_senders` senders are tracked. One silent for `max_age_s` is dropped (its frames are
  refused by age anyway); when the table is full of live senders the least recently heard one is
  evicted, and a sender not in the table is then refused if its frame is not newer than the newest
  frame of any evicted sender (a lagging clock there looks like a replay: logged, never accepted); a
  sender admitted (again) keeps refusing frames no newer than that, so an evicted sender that comes back
  cannot have its frames from before the eviction accepted twice.

Pure state with time passed in; the codec holds one per instance behind a lock.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

REPLAY_WINDOW = 512
REPLAY_MAX_SENDERS = 1024
REPLAY_MAX_AGE_S = 600.0


@dataclass
class _Sender:
    newest_sent_at: float
    seen: set[int] = field(default_factory=set)
    order: list[int] = field(default_factory=list)  # heap of `seen`
    floor: int = -1  # every seq <= floor is refused
    # the evicted senders' newest frame when this one was (re)admitted: if it is one of them back again, its frames
    # from before its eviction are no newer than this, so none of them is accepted a second time
    evicted_up_to: float = float("-inf")


class ReplayWindow:
    def __init__(self, window: int = REPLAY_WINDOW, max_senders: int = REPLAY_MAX_SENDERS,
                 max_age_s: float = REPLAY_MAX_AGE_S):
        if window < 1 or max_senders < 1 or max_age_s <= 0:
            raise ValueError("replay window, sender count and age must be positive")
        self.window, self.max_senders, self.max_age_s = window, max_senders, max_age_s
        self._senders: OrderedDict[bytes, _Sender] = OrderedDict()
        self._evicted_up_to = float("-inf")

    def __len__(self) -> int:
        return len(self._senders)

    def check(self, sender: bytes, seq: int, sent_at: float, now: float) -> str | None:
        """Accept (None, and remember it) or say why the frame is refused."""
        if not sent_at == sent_at:  # NaN
            return "frame time is not a number"
        age = now - sent_at
        if age > self.max_age_s:
            return f"frame sent {age:.0f} s ago, past the {self.max_age_s:.0f} s replay horizon"
        if -age > self.max_age_s:
            return f"frame dated {-age:.0f} s ahead of this clock, past the {self.max_age_s:.0f} s replay horizon"
        state = self._senders.get(sender)
        if sent_at <= (self._evicted_up_to if state is None else state.evicted_up_to):
            return (f"frame from sender {sender.hex()} not newer than a sender evicted from the full "
                    f"replay table ({self.max_senders} senders): possibly a replay")
        if state is None:
            admitted_after = self._evicted_up_to
            self._expire(now)
            if len(self._senders) >= self.max_senders:
                _, evicted = self._senders.popitem(last=False)
                self._evicted_up_to = max(self._evicted_up_to, evicted.newest_sent_at)
            state = self._senders[sender] = _Sender(newest_sent_at=sent_at, evicted_up_to=admitted_after)
        if seq <= state.floor or seq in state.seen:
            return f"replayed frame (sender {sender.hex()}, seq {seq})"
        state.seen.add(seq)
        heapq.heappush(state.order, seq)
        if len(state.order) > self.window:
            state.floor = heapq.heappop(state.order)
            state.seen.discard(state.floor)
        state.newest_sent_at = max(state.newest_sent_at, sent_at)
        self._senders.move_to_end(sender)
        return None

    def _expire(self, now: float) -> None:
        """Drop senders, least recently heard first, whose newest frame is past the horizon."""
        while self._senders:
            sender, state = next(iter(self._senders.items()))
            if now - state.newest_sent_at <= self.max_age_s:
                return
            del self._senders[sender]
