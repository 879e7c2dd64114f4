"""Who each instance is: prefill identities (learned at start-up, probed again every health round and after a
decode leg failed for its KV), decode TP sizes, decode instances' word on a failed receive, the warm-up.

Every question is a tiny completion (`"ping"`, one token) carrying a probe in kv_transfer_params
(`LegPlan.identity_probe`), so no request ever waits on one.  A restarted prefill instance answers with
another engine id; the request that found out (`refresh`) and every later one use the new identity.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import aiohttp
import msgspec

from kvpush_common.protocol.legs import RecvReport
from kvpush_common.router.config import RouterConfig, StartupError
from kvpush_common.router.context import RequestContext
from kvpush_common.router.legs import LegPlan, identity_probe_params, push_decode_params, push_prefill_params
from kvpush_common.router.metrics import RouterMetrics
from kvpush_common.router.replies import IdentityParams, ModelList, RecvParams, UpstreamReply
from kvpush_common.router.upstreams import Prefill, Upstreams

log = logging.getLogger(__name__)

IDENTITY_PROBE_TIMEOUT_S = 30.0  # a probe is a 1-token request: it may queue behind a busy instance's prefills


class Identities:
    def __init__(self, config: RouterConfig, upstreams: Upstreams, plan: LegPlan, metrics: RouterMetrics, mode: str):
        self.config, self.upstreams, self.plan, self.metrics, self.mode = config, upstreams, plan, metrics, mode
        self.consumer_tp: dict[str, int] = {}  # decode url -> its TP size (kvpush instances, learned at start-up)
        self._probes: set[asyncio.Task] = set()  # identity probes in flight (cancelled at close)

    @property
    def learns_producers(self) -> bool:
        return self.plan.identity_probe() is not None

    async def learn_all(self, deadline: float) -> None:
        """Start-up: every prefill's identity, every decode's TP size, and the warm-up pushes."""
        if not self.learns_producers:
            return
        await asyncio.gather(*(self._learn_producer(p, deadline) for p in self.upstreams.prefills))
        if self.plan.kvpush_instances:
            await asyncio.gather(*(self._learn_consumer(d, deadline) for d in self.upstreams.decode_urls))
            if self.plan.parallel and self.config.warm_up:
                await asyncio.gather(*(self._warm_up(p, d, deadline) for p in self.upstreams.prefills
                                       for d in self.upstreams.decode_urls))

    async def close(self) -> None:
        for task in list(self._probes):
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)

    # -- prefill identities
    async def _learn_producer(self, prefill: Prefill, deadline: float) -> None:
        """Ask P who it is at start-up, with a probe request, so no request ever waits on it."""
        await self.upstreams.wait_healthy(prefill.url, deadline)
        started = time.monotonic()
        try:
            prefill.producer = await self._ask_identity(prefill.url, deadline - started)
        except ValueError as e:
            raise StartupError(f"prefill {prefill.url} {e}") from e
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise StartupError(f"identity probe of prefill {prefill.url} failed: {e!r}") from e
        prefill.learned_at, prefill.confirmed = started, True
        log.info("prefill %s is %s", prefill.url, prefill.producer)

    async def _ask_identity(self, url: str, timeout_s: float):
        """The prefill instance's identity from one probe; ValueError says why it gave none (a connection error
        or a timeout passes as it is)."""
        try:
            status, raw = await self.probe(url, self.plan.identity_probe(), time.monotonic() + timeout_s)
            if status != 200:
                raise ValueError(f"answered the identity probe with {status}: {raw[:500]!r}")
            got = msgspec.json.decode(raw, type=UpstreamReply).kv_transfer_params
        except (msgspec.DecodeError, msgspec.ValidationError, IndexError) as e:
            raise ValueError(f"answered the identity probe unreadably: {e!r}") from e
        try:
            return self.plan.identity(got)
        except msgspec.ValidationError as e:
            raise ValueError(f"did not report its identity ({e}); expected {self.plan.identity_hint} "
                             f"Got kv_transfer_params={got!r}") from e

    def after_round(self, now: float) -> None:
        """After a health round: a prefill instance not healthy now loses its confirmed identity; every one
        that is up is probed again (not waited for here), at most once per health interval."""
        if not self.learns_producers:
            return
        for prefill in self.upstreams.prefills:
            if not self.upstreams.ok(prefill.url, now):
                prefill.confirmed = False
            elif ((prefill.probe is None or prefill.probe.done())
                  and (not prefill.confirmed or now - prefill.learned_at >= self.config.health_interval_s)):
                self._start_probe(prefill, now)

    async def refresh(self, prefill: Prefill, since: float) -> str:
        """P's identity probed again by a probe started at or after `since` (joined when one is in flight):
        "changed", "same", "refused" (nothing listens: it is down) or "failed" (timed out, or no identity).
        Shielded: a request that ends meanwhile does not cancel a probe others wait on."""
        if prefill.probe is None or prefill.probe.done() or prefill.probe_started < since:
            self._start_probe(prefill, time.monotonic())
        return await asyncio.shield(prefill.probe)

    def _start_probe(self, prefill: Prefill, now: float) -> None:
        prefill.probe_started = now
        prefill.probe = asyncio.create_task(self._reprobe(prefill, now))
        self._probes.add(prefill.probe)
        prefill.probe.add_done_callback(self._probes.discard)

    async def _reprobe(self, prefill: Prefill, started: float) -> str:
        try:
            producer = await self._ask_identity(prefill.url, IDENTITY_PROBE_TIMEOUT_S)
        except aiohttp.ClientConnectorError as e:
            self.upstreams.mark_down(prefill.url, f"identity probe refused: {e}")
            return "refused"
        except (ValueError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("identity probe of prefill %s failed: %r", prefill.url, e)
            return "failed"
        if started < prefill.learned_at:  # a later probe already answered: its identity stays
            return "same" if producer == prefill.producer else "changed"
        changed = producer != prefill.producer
        if changed:
            log.warning("prefill %s changed identity: %s -> %s (restarted); using the new one", prefill.url,
                        prefill.producer, producer)
            self.metrics.identity_changes.labels(self.mode).inc()
        prefill.producer, prefill.learned_at = producer, started
        prefill.confirmed = prefill.confirmed or self.upstreams.ok(prefill.url, time.monotonic())
        return "changed" if changed else "same"

    async def probe(self, url: str, kv_params: dict, deadline: float) -> tuple[int, bytes]:
        """One tiny completion carrying `kv_params` (the identity probes): HTTP status and body, by `deadline`."""
        session = self.upstreams.session
        timeout = aiohttp.ClientTimeout(total=max(1.0, deadline - time.monotonic()))
        async with session.get(f"{url}/v1/models", timeout=timeout) as resp:
            model = msgspec.json.decode(await resp.read(), type=ModelList).data[0].id
        probe = {"model": model, "prompt": "ping", "max_tokens": 1, "kv_transfer_params": kv_params}
        timeout = aiohttp.ClientTimeout(total=max(1.0, deadline - time.monotonic()))
        async with session.post(f"{url}/v1/completions", json=probe, timeout=timeout) as resp:
            return resp.status, await resp.read()

    # -- decode instances
    async def _learn_consumer(self, url: str, deadline: float) -> None:
        """D's TP size, asked once like P's identity: P's ranks that no D rank reads from then release
        their KV at once.  Optional: without it those ranks hold their KV to the lease end."""
        try:
            await self.upstreams.wait_healthy(url, deadline)
            _, raw = await self.probe(url, identity_probe_params(), deadline)
            got = msgspec.json.decode(raw, type=UpstreamReply).kv_transfer_params
            self.consumer_tp[url] = msgspec.convert(got, IdentityParams).kvpush_identity.tp_size
            log.info("decode %s has TP %d", url, self.consumer_tp[url])
        except Exception as e:  # noqa: BLE001 - an optimisation; serving goes on without it
            log.warning("decode %s did not report its TP size (%r): prefill ranks no decode rank reads from "
                        "will hold their KV until the lease ends", url, e)

    async def recv_report(self, url: str, ctx: RequestContext) -> RecvReport | None:
        """The decode instance's word on this attempt's receive, or None (it cannot tell, or did not answer
        in time)."""
        params = identity_probe_params(ctx.transfer_id, ctx.attempt)
        try:
            status, raw = await self.probe(url, params, time.monotonic() + IDENTITY_PROBE_TIMEOUT_S)
            got = msgspec.json.decode(raw, type=UpstreamReply).kv_transfer_params if status == 200 else None
            report = msgspec.convert(got or {}, RecvParams).kvpush_recv
        except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError, msgspec.ValidationError,
                IndexError) as err:
            log.warning("decode %s did not say whether transfer %s#%d failed: %r", url, ctx.transfer_id,
                        ctx.attempt, err)
            return None
        if report is None or (report.transfer_id, report.attempt) != (ctx.transfer_id, ctx.attempt):
            return None
        return report

    async def _warm_up(self, prefill: Prefill, decode_url: str, deadline: float) -> None:
        """One tiny push through each (prefill, decode) pair, so that the decode ranks handshake with the
        prefill ranks now and not on the first user request (a handshake adds NIXL peers on both sides: a user's
        request should not wait for it)."""
        session = self.upstreams.session
        try:
            await self.upstreams.wait_healthy(decode_url, deadline)
            async with session.get(f"{prefill.url}/v1/models") as resp:
                model = msgspec.json.decode(await resp.read(), type=ModelList).data[0].id
            tid = f"warmup-{uuid.uuid4().hex}"
            body = {"model": model, "prompt": "warm up", "max_tokens": 1}
            legs = [session.post(f"{prefill.url}/v1/completions",
                                 json={**body, "kv_transfer_params": push_prefill_params(tid, 0)}),
                    session.post(f"{decode_url}/v1/completions",
                                 json={**body, "kv_transfer_params": push_decode_params(tid, 0, prefill.producer)})]
            timeout = max(1.0, min(60.0, deadline - time.monotonic()))
            replies = await asyncio.wait_for(asyncio.gather(*legs), timeout)
            for r in replies:
                await r.read()
                r.release()
            log.info("warmed up %s -> %s: %s", prefill.url, decode_url, [r.status for r in replies])
        except Exception as e:  # noqa: BLE001 - warm-up is an optimisation; serving goes on without it
            log.warning("warm-up %s -> %s failed: %r", prefill.url, decode_url, e)
