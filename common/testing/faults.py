"""A fault-injecting wrapper around a real Transport, for fault tests and chaos runs.

Faults act on what this side *receives* (notifications: drop, duplicate, delay, reorder) and on what
it *posts* (fail the post, or make the transfer end in ERR).  Everything is seeded and counted so a
test can assert that a fault really happened.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import msgspec
import numpy as np

from kvpush_common.transport.nixl import Transport, TransportError


@dataclass(frozen=True)
class FaultPlan:
    seed: int = 0
    drop_notif: float = 0.0
    dup_notif: float = 0.0
    delay_notif: float = 0.0
    delay_s: tuple[float, float] = (0.05, 0.3)
    reorder_notif: float = 0.0
    fail_post: float = 0.0
    err_xfer: float = 0.0  # the post succeeds, the transfer then reports ERR (nothing is sent)
    post_delay_s: float = 0.0  # hold every post this long (PROC) before really posting: a slow WRITE
    crash_send: float = 0.0  # send_notif raises an unexpected (non-TransportError) exception: a bug mid-step
    crash_fetch: float = 0.0  # get_notifs raises an unexpected exception (nothing is fetched or lost)
    fail_prep: bool = False  # prep of a peer's descriptor list fails: the producer posts per-request lists
    match: Callable[[bytes], bool] | None = None  # notif faults apply only where this is true
    match_tag: str | None = None  # ... or only to messages of this wire tag ("hb", "reg", "done", ...)


class FaultyTransport:
    def __init__(self, inner: Transport, plan: FaultPlan, clock: Callable[[], float] = time.monotonic):
        self.inner = inner
        self.plan = plan
        self.name = inner.name
        self._rng = random.Random(plan.seed)
        self._clock = clock
        self._delayed: list[tuple[float, str, bytes]] = []
        self._held: list[tuple[str, bytes]] = []  # for reordering
        self._fake_err: set[int] = set()
        self._held_posts: dict[int, list] = {}  # id(token) -> [due, post thunk, real handle or None]
        self.counts: Counter[str] = Counter()

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def _hit(self, p: float) -> bool:
        return p > 0 and self._rng.random() < p

    def post(self, op, peer, local: np.ndarray, remote: np.ndarray, mem_type, remote_mem_type, notif):
        args = (op, peer, local.copy(), remote.copy(), mem_type, remote_mem_type, notif)
        return self._faulty_post(lambda: self.inner.post(*args))

    def post_prepped(self, op, local, local_idx, remote, remote_idx, notif):
        args = (op, local, np.array(local_idx), remote, np.array(remote_idx), notif)
        return self._faulty_post(lambda: self.inner.post_prepped(*args))

    def prep(self, peer, descs: np.ndarray, mem_type):
        if self.plan.fail_prep and peer is not None:
            self.counts["fail_prep"] += 1
            raise TransportError("injected fault: prep failed")
        return self.inner.prep(peer, descs, mem_type)

    def _faulty_post(self, really_post):
        if self._hit(self.plan.fail_post):
            self.counts["fail_post"] += 1
            raise TransportError("injected fault: post failed")
        if self._hit(self.plan.err_xfer):
            self.counts["err_xfer"] += 1
            token = _Held()
            self._fake_err.add(id(token))
            return token
        if self.plan.post_delay_s > 0:
            self.counts["post_delay"] += 1
            token = _Held()
            self._held_posts[id(token)] = [self._clock() + self.plan.post_delay_s, really_post, None]
            return token
        return really_post()

    def state(self, handle):
        if id(handle) in self._fake_err:
            return "ERR"
        held = self._held_posts.get(id(handle))
        if held is not None:
            if held[2] is None:
                if self._clock() < held[0]:
                    return "PROC"
                try:
                    held[2] = held[1]()
                except TransportError:  # the real post failed: the held transfer ends in ERR, releasable
                    del self._held_posts[id(handle)]
                    self._fake_err.add(id(handle))
                    raise
            return self.inner.state(held[2])
        return self.inner.state(handle)

    def release(self, handle) -> bool:
        if id(handle) in self._fake_err:
            self._fake_err.discard(id(handle))
            return True
        held = self._held_posts.get(id(handle))
        if held is not None:
            if held[2] is None:
                return False  # not cancellable: it will still be posted (models an in-flight WRITE)
            if self.inner.release(held[2]):
                del self._held_posts[id(handle)]
                return True
            return False
        return self.inner.release(handle)

    def send_notif(self, peer: str, msg: bytes) -> None:
        if self._hit(self.plan.crash_send):
            self.counts["crash_send"] += 1
            raise RuntimeError("injected fault: unexpected exception in send_notif")
        self.inner.send_notif(peer, msg)

    def get_notifs(self) -> dict[str, list[bytes]]:
        if self._hit(self.plan.crash_fetch):
            self.counts["crash_fetch"] += 1
            raise RuntimeError("injected fault: unexpected exception in get_notifs")
        now = self._clock()
        out: list[tuple[str, bytes]] = []
        tag = b"\xa1t" + msgspec.msgpack.encode(self.plan.match_tag) if self.plan.match_tag else None
        for peer, msgs in self.inner.get_notifs().items():
            for msg in msgs:
                skip = (self.plan.match is not None and not self.plan.match(msg)) or (tag is not None and tag not in msg)
                if skip:
                    out.append((peer, msg))
                    continue
                if self._hit(self.plan.drop_notif):
                    self.counts["drop"] += 1
                    continue
                if self._hit(self.plan.delay_notif):
                    self.counts["delay"] += 1
                    self._delayed.append((now + self._rng.uniform(*self.plan.delay_s), peer, msg))
                    continue
                if self._hit(self.plan.reorder_notif):
                    self.counts["reorder"] += 1
                    self._held.append((peer, msg))
                    continue
                out.append((peer, msg))
                if self._hit(self.plan.dup_notif):
                    self.counts["dup"] += 1
                    out.append((peer, msg))
        due = [d for d in self._delayed if d[0] <= now]
        self._delayed = [d for d in self._delayed if d[0] > now]
        out += [(peer, msg) for _, peer, msg in due]
        if self._held and (out or self._rng.random() < 0.5):
            out += self._held  # held messages come after later ones: reordered
            self._held = []
        grouped: dict[str, list[bytes]] = {}
        for peer, msg in out:
            grouped.setdefault(peer, []).append(msg)
        return grouped


class _Held:
    """Stand-in handle for a post that the wrapper is holding back."""
