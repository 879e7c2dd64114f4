"""The HTTP side of one leg: send it, read P's answer or D's first bytes, relay D's answer to the client, and
turn what went wrong into a `LegError` (or a router-made error answer).

Nothing here decides anything: which instance, which params and whether to retry are the flow's (flow.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import aiohttp
import msgspec
from aiohttp import web

from kvpush_common.router.context import RequestContext
from kvpush_common.router.legs import decode_body, local_body, prefill_body
from kvpush_common.router.metrics import RouterMetrics
from kvpush_common.router.policy import Instance
from kvpush_common.router.replies import UpstreamReply, failed_start, first_event, openai_error, rest_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpstreamAnswer:
    status: int
    body: bytes
    content_type: str


class LegError(Exception):
    """A leg that did not succeed; `answer` is the upstream's own HTTP reply when it sent one."""

    def __init__(self, leg: str, cause: str, message: str, answer: UpstreamAnswer | None = None):
        super().__init__(message)
        self.leg, self.cause, self.answer = leg, cause, answer

    @property
    def is_client_error(self) -> bool:
        """A 4xx is about the request itself: passed through, never retried."""
        return self.answer is not None and 400 <= self.answer.status < 500


@dataclass
class DecodeOutput:
    """D's open response and the first bytes read from its body."""

    response: aiohttp.ClientResponse
    first: bytes


class Relay:
    def __init__(self, session: aiohttp.ClientSession, metrics: RouterMetrics, mode: str,
                 prefill_timeout: aiohttp.ClientTimeout, decode_timeout: aiohttp.ClientTimeout):
        self.session, self.metrics, self.mode = session, metrics, mode
        self._prefill_timeout, self._decode_timeout = prefill_timeout, decode_timeout

    # -- prefill leg
    async def prefill_leg(self, inst: Instance, ctx: RequestContext, params: dict) -> UpstreamReply:
        inst.enter()
        try:
            return await self._prefill_answer(inst.url, ctx, params)
        finally:
            inst.leave()

    async def _prefill_answer(self, url: str, ctx: RequestContext, params: dict) -> UpstreamReply:
        started = time.monotonic()
        data = msgspec.json.encode(prefill_body(ctx.body, params, ctx.chat))
        try:
            async with self.session.post(url + ctx.path, data=data, headers=_json(ctx.leg_headers()),
                                         timeout=self._prefill_timeout) as resp:
                raw = await resp.read()
        except asyncio.TimeoutError as e:
            raise LegError("prefill", "timeout", f"prefill {url} timed out") from e
        except aiohttp.ClientError as e:
            raise LegError("prefill", "connect", f"prefill {url}: {e!r}") from e
        if not 200 <= resp.status < 300:
            raise LegError("prefill", "status", f"prefill {url} answered {resp.status}: {raw[:300]!r}",
                           UpstreamAnswer(resp.status, raw, resp.headers.get("Content-Type", "application/json")))
        self.metrics.prefill.labels(self.mode).observe(time.monotonic() - started)
        try:
            return msgspec.json.decode(raw, type=UpstreamReply)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise LegError("prefill", "bad_reply", f"prefill {url} answered unreadable JSON: {e}") from e

    # -- decode leg
    async def _open_decode(self, url: str, ctx: RequestContext, params: dict | None,
                           local: bool = False) -> aiohttp.ClientResponse:
        """D's response with its headers read; its body is relayed later (cancelling closes the connection)."""
        data = msgspec.json.encode(local_body(ctx.body) if local else decode_body(ctx.body, params))
        try:
            resp = await self.session.post(url + ctx.path, data=data, headers=_json(ctx.leg_headers()),
                                           timeout=self._decode_timeout)
        except asyncio.TimeoutError as e:
            raise LegError("decode", "timeout", f"decode {url} timed out") from e
        except aiohttp.ClientError as e:
            raise LegError("decode", "connect", f"decode {url}: {e!r}") from e
        if 200 <= resp.status < 300:
            return resp
        try:
            raw = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            raw = b""
        finally:
            resp.release()
        raise LegError("decode", "status", f"decode {url} answered {resp.status}",
                       UpstreamAnswer(resp.status, raw, resp.headers.get("Content-Type", "application/json")))

    async def first_output(self, url: str, ctx: RequestContext, params: dict | None,
                           local: bool = False) -> DecodeOutput:
        """D's response and the first bytes of its body (for a stream: the first token)."""
        resp = await self._open_decode(url, ctx, params, local)
        try:
            first = await resp.content.readany()
            if ctx.stream:
                first = await first_event(resp, first)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            resp.close()
            raise LegError("decode", "stream", f"decode {url} stream broke before its first byte: {e!r}") from e
        except BaseException:
            resp.close()
            raise
        cause = failed_start(first) if ctx.stream else None
        if cause is not None:
            answer = UpstreamAnswer(resp.status, await rest_of(resp, first),
                                    resp.headers.get("Content-Type", "text/event-stream"))
            what = "an error" if cause == "error_event" else "no output"
            raise LegError("decode", cause, f"decode {url} streamed {what} first: {first[:300]!r}", answer)
        ctx.stamp("first_byte")
        self.metrics.ttft.labels(self.mode).observe(ctx.stamps["first_byte"] / 1000)
        return DecodeOutput(resp, first)

    # -- to the client
    async def relay(self, request: web.Request, ctx: RequestContext, output: DecodeOutput) -> web.StreamResponse:
        """D's answer to the client: whole, with the timeline header, or chunk by chunk when streaming."""
        upstream, chunk = output.response, output.first
        chunks: list[bytes] = []
        headers = {"Content-Type": upstream.headers.get("Content-Type", "application/json"),
                   "X-Request-Id": ctx.request_id}
        try:
            while chunk:
                if not ctx.stream:
                    chunks.append(chunk)
                else:
                    if ctx.streamed is None:
                        ctx.streamed = web.StreamResponse(status=upstream.status, headers=headers)
                        await ctx.streamed.prepare(request)
                    try:
                        await ctx.streamed.write(chunk)
                    except ConnectionError:
                        self.metrics.failures.labels(self.mode, "client_gone").inc()
                        ctx.outcome = "client_gone"
                        return ctx.streamed
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    return await self.fail(ctx, "decode_stream", "failed", 502, f"decode stream broke: {e!r}")
            ctx.stamp("done")
            ctx.outcome = ctx.outcome or "ok"
            if ctx.streamed is not None:
                await ctx.streamed.write_eof()
                return ctx.streamed
            headers["x-kvpush-timeline"] = json.dumps(ctx.stamps)
            return web.Response(status=upstream.status, body=b"".join(chunks), headers=headers)
        finally:
            upstream.release() if upstream.content.at_eof() else upstream.close()

    async def leg_failed(self, ctx: RequestContext, e: LegError) -> web.StreamResponse:
        """Pass an upstream's own HTTP error through as it is; anything else becomes a 502."""
        self.metrics.failures.labels(self.mode, f"{e.leg}_{e.cause}").inc()
        if e.answer is None:
            return await self.fail(ctx, None, "failed", 502, str(e))
        ctx.outcome = "upstream_error"
        return web.Response(status=e.answer.status, body=e.answer.body,
                            headers={"Content-Type": e.answer.content_type, "X-Request-Id": ctx.request_id})

    async def fail(self, ctx: RequestContext, cause: str | None, outcome: str, status: int,
                   message: str) -> web.StreamResponse:
        """A router-made error: JSON before anything was sent, else an SSE error event and [DONE]."""
        if cause:
            self.metrics.failures.labels(self.mode, cause).inc()
        ctx.outcome = outcome
        ctx.stamp("done")
        log.warning("request %s (transfer %s#%d): %s", ctx.request_id, ctx.transfer_id, ctx.attempt, message)
        error = openai_error(message, status, "timeout" if status == 504 else "upstream_error")
        if ctx.streamed is None:
            return web.json_response(error, status=status, headers={"X-Request-Id": ctx.request_id})
        try:
            events = b"data: " + msgspec.json.encode(error) + b"\n\ndata: [DONE]\n\n"
            await asyncio.wait_for(ctx.streamed.write(events), 1.0)
            await asyncio.wait_for(ctx.streamed.write_eof(), 1.0)
        except (ConnectionError, asyncio.TimeoutError):
            pass
        return ctx.streamed


async def discard(*tasks: asyncio.Task | None) -> None:
    """End legs that are no longer wanted: closing their connections makes vLLM abort those requests."""
    live = [t for t in tasks if t is not None]
    for task in live:
        task.cancel()
    await asyncio.gather(*live, return_exceptions=True)
    for task in live:
        if not task.cancelled() and task.exception() is None and isinstance(task.result(), DecodeOutput):
            task.result().response.close()


def _json(headers: dict[str, str]) -> dict[str, str]:
    return {**headers, "Content-Type": "application/json"}
