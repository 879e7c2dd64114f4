"""One client request from arrival to relay: attempts, retries, which legs go where, and when.

An attempt picks a decode and a prefill instance (`policy.py`, from what upstreams.py knows), sends the
legs its `LegPlan` says (push: both at once; pull: D once P answered) and waits for D's first bytes --
which come only once P has answered 2xx, or before when D computed the prompt itself (then P's leg is
aborted).  Until the client saw a byte, a failed prefill is retried with the same transfer_id and the next
attempt (kvpush refuses older attempts), a failed decode moves to another decode instance the same way, and
a decode leg whose KV receive failed (the decode instance says so when asked: `RecvReport`) is retried
with the prefill's identity probed again.  With no usable prefill instance the decode instance computes
the prompt itself; with no usable decode instance a prefill instance serves the request alone.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from kvpush_common.protocol.legs import ProducerIdentity
from kvpush_common.router.config import RouterConfig
from kvpush_common.router.context import RequestContext
from kvpush_common.router.identity import Identities
from kvpush_common.router.legs import LegPlan
from kvpush_common.router.metrics import RouterMetrics
from kvpush_common.router.policy import Choice, make_policy
from kvpush_common.router.prefix_index import uncached_tokens
from kvpush_common.router.relay import DecodeOutput, LegError, Relay, discard
from kvpush_common.router.upstreams import Upstreams

log = logging.getLogger(__name__)

KV_FAILURES = ("stale_producer", "dead_producer", "kv_failed")  # a decode leg failed for its KV: retried
GONE = ("connect", "stream")  # the upstream itself is gone (refused, reset): out of the healthy set at once
# a stream that ended before its first token: with an error event, or with none (vLLM < 0.30's completions,
# replies.failed_start) -- either may be a failed KV receive, which the decode instance is asked about
STREAM_ENDS = ("error_event", "empty_stream")


class RequestFlow:
    def __init__(self, config: RouterConfig, plan: LegPlan, upstreams: Upstreams, identities: Identities,
                 relay: Relay, metrics: RouterMetrics, mode: str):
        self.config, self.plan, self.upstreams, self.identities = config, plan, upstreams, identities
        self.relay, self.metrics, self.mode = relay, metrics, mode
        self.p_policy, self.d_policy = make_policy(config.policy), make_policy(config.policy)

    async def serve(self, request: web.Request, ctx: RequestContext) -> web.StreamResponse:
        last: LegError | None = None
        for attempt in range(self.config.retries + 1):
            ctx.attempt = attempt
            if attempt:
                self.metrics.retries.labels(self.mode).inc()
                log.warning("request %s: retrying as attempt %d after: %s", ctx.request_id, attempt, last)
            ctx.relaying = None
            try:
                output = await self._attempt(ctx)
                return await self.relay.relay(request, ctx, output)
            except LegError as e:
                if e.leg == "decode" and ctx.streamed is None:
                    e = await self._why_decode_failed(ctx, e)
                if e.is_client_error or not self._retryable(ctx, e):
                    return await self.relay.leg_failed(ctx, e)
                self._note_failure(ctx, e)
                last = e
                continue
            finally:
                if ctx.relaying is not None:
                    ctx.relaying.leave()
        return await self.relay.fail(ctx, "retries_exhausted", "failed", 502,
                                     f"no attempt succeeded in all {self.config.retries + 1} attempts; last: {last}")

    # -- after a failed attempt
    def _retryable(self, ctx: RequestContext, e: LegError) -> bool:
        """A prefill failure is retried.  A decode failure only before the client saw a byte: one for its KV
        (a restarted or dead prefill instance) with a fresh identity, one of a decode instance that is gone on
        another -- or a prefill instance alone when none is left --, and any other (a model error) when
        another decode instance is there to take the request (request migration)."""
        if e.leg == "prefill":
            return True
        if ctx.streamed is not None:
            return False
        if e.cause in KV_FAILURES or e.cause in GONE:
            return True
        if e.cause == "empty_stream":  # not for its KV: what vLLM streamed is passed on as it came
            return False
        others = [u for u in self.upstreams.d_instances if u != ctx.route.get("decode") and u not in ctx.failed_decodes]
        return bool(others)

    def _note_failure(self, ctx: RequestContext, e: LegError) -> None:
        """What a retried failure teaches the next attempt: an instance that is gone is avoided (and out of
        the healthy set until its /health answers again); a decode that failed otherwise is migrated from."""
        self.metrics.failures.labels(self.mode, f"{e.leg}_{e.cause}").inc()
        url = ctx.route.get(e.leg)
        if url is None:
            return
        if e.cause in GONE:
            self.upstreams.mark_down(url, f"{e.leg} leg failed: {e}")
        if e.leg == "prefill" and e.cause in GONE:
            ctx.failed_prefills.add(url)
        elif e.cause == "dead_producer" and ctx.route.get("prefill"):  # who serves there is unknown: no more
            ctx.failed_prefills.add(ctx.route["prefill"])               # requests until a probe answers
            self.upstreams.prefill(ctx.route["prefill"]).confirmed = False
        elif e.leg == "decode" and e.cause not in KV_FAILURES:  # nothing reached the client: migrate
            ctx.failed_decodes.add(url)
            self.metrics.migrations.labels(self.mode).inc()

    async def _why_decode_failed(self, ctx: RequestContext, e: LegError) -> LegError:
        """A decode leg answered an error before the client saw a byte: did its KV receive fail?  vLLM
        answers a failed load like a model error (500 "Internal server error", or that as the stream's
        first event; before 0.30 a completion stream with no event at all) and drops the connector's
        kv_transfer_params, so the decode instance is asked
        (`RecvReport`); if it failed, the prefill's identity is probed again, so the retry names who serves
        there now.  The cause says which: another identity (stale_producer), nothing answering
        (dead_producer), the same one (kv_failed)."""
        prefill_url, decode_url = ctx.route.get("prefill"), ctx.route.get("decode")
        status = e.answer.status if e.answer is not None else 0
        if (not self.plan.kvpush_instances or not prefill_url or not decode_url
                or e.cause not in ("status", *STREAM_ENDS) or not (status >= 500 or e.cause in STREAM_ENDS)):
            return e
        since = time.monotonic()
        report = await self.identities.recv_report(decode_url, ctx)
        if report is None or not report.failed:
            return e  # a model error, or an instance that cannot tell: handled as before
        prefill = self.upstreams.prefill(prefill_url)
        outcome = await self.identities.refresh(prefill, since)
        if outcome in ("refused", "failed"):
            cause = "dead_producer"
        elif outcome == "changed" or (isinstance(prefill.producer, ProducerIdentity)
                                      and prefill.producer.engine_id != report.producer_engine_id):
            cause = "stale_producer"
        else:
            cause = "kv_failed"
        log.warning("request %s (transfer %s#%d): decode %s failed to receive its KV from %s (%s, prefill "
                    "probe: %s)", ctx.request_id, ctx.transfer_id, ctx.attempt, decode_url,
                    report.producer_engine_id, cause, outcome)
        return LegError("decode", cause, f"decode {decode_url} failed to receive the KV from prefill "
                        f"{prefill_url} ({cause}): {e}", e.answer)

    # -- one attempt
    async def _attempt(self, ctx: RequestContext) -> DecodeOutput:
        """One try at both legs: D's first output once P has answered 2xx -- or before, when D answers first
        (it computed the prompt from its own prefix cache): then the prefill leg lost the race and is
        aborted (closing its connection makes vLLM abort the request and free its blocks)."""
        up = self.upstreams
        decodes = up.usable(list(up.d_instances.values()), ctx.failed_decodes)
        prefills = up.usable(list(up.p_instances.values()), ctx.failed_prefills)
        if not decodes and prefills:
            return await self._prefill_alone(ctx, self.p_policy.choose(prefills, ctx.hashes))
        d_choice = self.d_policy.choose(decodes or up.healthy(list(up.d_instances.values()), ctx.failed_decodes),
                                        ctx.hashes)
        tail = self._local_tail(ctx, d_choice)
        if tail is not None:
            return await self._decode_only(ctx, d_choice, tail)
        if decodes and not prefills:
            return await self._decode_only(ctx, d_choice, None)
        p_choice = self.p_policy.choose(prefills or up.healthy(list(up.p_instances.values()), ctx.failed_prefills),
                                        ctx.hashes)
        prefill = up.prefill(p_choice.instance.url)
        decode_url = d_choice.instance.url
        ctx.route = {"prefill": prefill.url, "decode": decode_url, "prefill_why": p_choice.why,
                     "decode_why": d_choice.why}
        for choice in (p_choice, d_choice):
            choice.instance.index.record(ctx.hashes)  # both will hold the prompt's KV (P computes, D receives)
        p_params = self.plan.prefill(ctx, self.identities.consumer_tp.get(decode_url))
        d_params = self.plan.decode(ctx, prefill.producer, None) if self.plan.parallel else None
        ctx.stamp("dispatched")
        prefill_task = asyncio.create_task(self.relay.prefill_leg(p_choice.instance, ctx, p_params))
        decode_task = None
        if d_params is not None:
            decode_task = asyncio.create_task(self.relay.first_output(decode_url, ctx, d_params))
        d_choice.instance.enter()  # until the request is relayed (then the caller ends it)
        ctx.relaying = d_choice.instance
        try:
            pending = {t for t in (prefill_task, decode_task) if t}
            while prefill_task in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if prefill_task not in done:
                    output = decode_task.result()  # D failed first: that ends the request
                    await discard(prefill_task)
                    ctx.stamp("prefill_cancelled")
                    self.metrics.prefill_cancelled.labels(self.mode).inc()
                    return output
            reply = prefill_task.result()
            ctx.stamp("prefill_done")
            if decode_task is None:  # pull: the destination is chosen late, its leg sent now
                d_params = self.plan.decode(ctx, prefill.producer, reply)
                if d_params is None:
                    raise LegError("prefill", "bad_reply", f"prefill {prefill.url} answered no kv_transfer_params")
                decode_task = asyncio.create_task(self.relay.first_output(decode_url, ctx, d_params))
            return await decode_task
        except BaseException:
            await discard(prefill_task, decode_task)
            raise

    def _local_tail(self, ctx: RequestContext, d_choice: Choice) -> int | None:
        """The tokens the chosen decode probably computes for this prompt, when few enough that it should
        compute them with no prefill leg at all; None otherwise (and for instances that are not kvpush's,
        whose baselines stay vLLM's)."""
        limit = self.config.skip_prefill_max_tokens
        if not self.plan.kvpush_instances or not limit:
            return None
        matched = d_choice.instance.index.matched(ctx.hashes)
        tail = uncached_tokens(ctx.prompt_tokens, matched)
        return tail if matched and tail is not None and tail <= limit else None

    async def _decode_only(self, ctx: RequestContext, d_choice: Choice, tail: int | None) -> DecodeOutput:
        """D probably caches all of the prompt but a short tail (`tail`), or no prefill instance is usable
        (None: all down, restarting, or gone during this request): D computes the prompt itself, so no prefill
        instance computes or holds anything.  A stale hint (D evicted the prefix) costs D a longer prefill,
        never a wrong answer; a decode failure is retried like any other, from the policy's next choice."""
        url = d_choice.instance.url
        ctx.route = {"prefill": None, "decode": url, "decode_why": d_choice.why}
        if tail is None:
            ctx.route["fallback"] = "no_prefill"
            self.metrics.fallbacks.labels(self.mode, "no_prefill").inc()
        else:
            ctx.route["prefill_skipped"] = {"uncached_tokens_est": tail, "limit": self.config.skip_prefill_max_tokens}
            ctx.stamp("prefill_skipped")
            self.metrics.prefill_skipped.labels(self.mode).inc()
        d_choice.instance.index.record(ctx.hashes)
        ctx.stamp("dispatched")
        d_choice.instance.enter()  # until the request is relayed (then the caller ends it)
        ctx.relaying = d_choice.instance
        return await self.relay.first_output(url, ctx, None, local=True)

    async def _prefill_alone(self, ctx: RequestContext, p_choice: Choice) -> DecodeOutput:
        """No decode instance is usable (all down, restarting, or gone during this request): a prefill instance
        serves the request as a single instance would.  Its failure is a prefill failure (retried)."""
        url = p_choice.instance.url
        ctx.route = {"prefill": url, "decode": None, "prefill_why": p_choice.why, "fallback": "no_decode"}
        self.metrics.fallbacks.labels(self.mode, "no_decode").inc()
        p_choice.instance.index.record(ctx.hashes)
        ctx.stamp("dispatched")
        p_choice.instance.enter()  # until the request is relayed (then the caller ends it)
        ctx.relaying = p_choice.instance
        try:
            return await self.relay.first_output(url, ctx, None, local=True)
        except LegError as e:
            raise LegError("prefill", e.cause, str(e), e.answer) from e
