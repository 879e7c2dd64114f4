"""The prefill and decode instances as the router knows them: health, load, and which may get a request now.

Health and load are refreshed by the health loop (app.py), never on the request path: a round probes every
upstream's /health and, for the kv-aware policy, reads its /metrics (load.py), all at once.  A refused
connection takes an instance out at once (`mark_down`); a prefill instance seen down gets no request until
a probe said who it is now (identity.py), since it may have come back as another process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvpush_common.router.config import RouterConfig, StartupError
from kvpush_common.router.load import parse_vllm_load
from kvpush_common.router.policy import Instance

log = logging.getLogger(__name__)


@dataclass
class Prefill:
    url: str
    producer: Any = None  # its identity (LegPlan.identity), learned at start-up and probed again
    # False once it was seen down: it may come back as another process (another engine id), so it gets no
    # request until a probe has said who it is now
    confirmed: bool = True
    learned_at: float = float("-inf")  # when the probe whose answer is in `producer` started
    probe: asyncio.Task | None = None  # the identity probe in flight (one at a time)
    probe_started: float = float("-inf")


@dataclass
class Health:
    """What the health loop last learned of one upstream.  A refusal or an error status takes it out at once;
    a busy instance on a starved host answers one probe late, so only two timeouts in a row do."""

    last_ok: float | None = None
    error: str = "not checked yet"
    down: bool = True  # the last probe was refused or answered an error status (or none answered yet)
    timeouts: int = 0  # consecutive probes that timed out

    def record(self, now: float, error: str | None, timed_out: bool) -> None:
        if error is None:
            self.last_ok, self.down, self.timeouts = now, False, 0
            return
        self.error = error
        if timed_out:
            self.timeouts += 1
        else:
            self.down = True

    def ok(self, now: float, stale_after_s: float) -> bool:
        """Usable now: answered lately, not refused since, and not late twice in a row."""
        return (not self.down and self.timeouts < 2 and self.last_ok is not None
                and self.last_ok >= now - stale_after_s)


class Upstreams:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.prefills = [Prefill(u.rstrip("/")) for u in config.prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in config.decode_urls]
        self.p_instances = {p.url: Instance(p.url) for p in self.prefills}
        self.d_instances = {u: Instance(u) for u in self.decode_urls}
        self.health = {u: Health() for u in dict.fromkeys([p.url for p in self.prefills] + self.decode_urls)}
        self.session: aiohttp.ClientSession | None = None  # set when the router starts

    def prefill(self, url: str) -> Prefill:
        return next(p for p in self.prefills if p.url == url)

    @property
    def probe_timeout_s(self) -> float:
        return min(5.0, self.config.health_interval_s * 2)

    @property
    def stale_after_s(self) -> float:
        """Older than three of the health loop's longest rounds (sleep + a probe timing out): the loop stalled."""
        return 3 * (self.config.health_interval_s + self.probe_timeout_s)

    def ok(self, url: str, now: float) -> bool:
        return self.health[url].ok(now, self.stale_after_s)

    def failing(self, now: float) -> dict[str, str]:
        """Each upstream not usable now, with why (the router's /health)."""
        return {u: h.error for u, h in self.health.items() if not h.ok(now, self.stale_after_s)}

    # -- choosing
    def healthy(self, instances: list[Instance], avoid: set[str] = frozenset()) -> list[Instance]:
        """The instances to choose from: healthy ones not to avoid; else any not to avoid; else all."""
        return self.usable(instances, avoid) or [i for i in instances if i.url not in avoid] or instances

    def usable(self, instances: list[Instance], avoid: set[str] = frozenset()) -> list[Instance]:
        """Healthy instances not to avoid; of prefill instances only those whose identity is confirmed."""
        now = time.monotonic()
        unconfirmed = {p.url for p in self.prefills if not p.confirmed}
        return [i for i in instances if i.url not in avoid and i.url not in unconfirmed and self.ok(i.url, now)]

    def mark_down(self, url: str, why: str) -> None:
        """An upstream refused a connection: out of the healthy set now, not at the next health round."""
        health = self.health.get(url)
        if health is None:
            return
        health.record(time.monotonic(), why, timed_out=False)
        for prefill in self.prefills:
            if prefill.url == url:
                prefill.confirmed = False

    # -- probing
    async def probe_health(self, url: str) -> tuple[str | None, bool]:
        """Why `url` is not healthy now (None when its /health answered 200), and whether the probe timed out."""
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout_s)
        try:
            async with self.session.get(f"{url}/health", timeout=timeout) as resp:
                return (None if resp.status == 200 else f"/health answered {resp.status}"), False
        except asyncio.TimeoutError:
            return "/health timed out", True
        except aiohttp.ClientError as e:
            return f"/health failed: {e}", False

    async def check_health(self) -> float:
        """One round: every upstream's /health and, for the kv-aware policy, its /metrics, all at once (a
        round lasts at most one probe timeout).  Returns when the round's answers were recorded."""
        scrapes = [self.scrape_load(u) for u in self.health] if self.config.policy == "kv-aware" else []
        results = await asyncio.gather(*(self.probe_health(u) for u in self.health), *scrapes)
        now = time.monotonic()
        for url, (error, timed_out) in zip(self.health, results):
            self.health[url].record(now, error, timed_out)
        return now

    async def wait_healthy(self, url: str, deadline: float) -> None:
        next_log = 0.0
        while True:
            error, _ = await self.probe_health(url)
            if error is None:
                return
            now = time.monotonic()
            if now >= deadline:
                raise StartupError(f"{url} not healthy after {self.config.startup_timeout_s:g} s: {error}")
            if now >= next_log:
                log.info("waiting for %s/health (%.0f s left): %s", url, deadline - now, error)
                next_log = now + 10.0
            await asyncio.sleep(min(1.0, max(0.0, deadline - now)))

    async def scrape_load(self, url: str) -> None:
        """The instance's queue and KV-cache use from its /metrics (the kv-aware policy's load term).  A decode
        instance lists a request waiting for its KV as waiting: the ones this router sent are its own in
        flight, counted once (as in flight), so its waiting is what the page shows beyond them -- else a
        conversation's next turn could leave the decode holding its history for a queue that is only ours."""
        decode = self.d_instances.get(url)
        ours_before = (decode.in_flight, decode.sent) if decode is not None else (0, 0)
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout_s)
        try:
            async with self.session.get(f"{url}/metrics", timeout=timeout) as resp:
                load = parse_vllm_load(await resp.text()) if resp.status == 200 else {}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, UnicodeDecodeError):
            load = {}
        for inst in (self.p_instances.get(url), decode):
            if inst is not None:
                inst.waiting = load.get("waiting", 0.0)
                inst.running = load.get("running", 0.0)
                inst.kv_usage = load.get("kv_usage", 0.0)
        if decode is not None:  # ours the page may count: in flight when asked, or sent while it was read
            ours = ours_before[0] + (decode.sent - ours_before[1])
            decode.waiting = max(0.0, decode.waiting - ours)
