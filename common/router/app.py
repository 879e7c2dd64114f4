"""OpenAI-compatible HTTP router in front of disaggregated vLLM: prefill instances (P), decode instances (D).

Modes: `push` (kvpush: both legs at once, D's blocks registered while P computes), `pull` (kvpush: D's leg
once P has answered), and the benchmark baselines `nixl-pull` (vLLM NixlConnector: P, then D with P's
answer), `nixl-push` (vLLM NixlPushConnector: both legs at once) and `single` (one instance, the reference).
Producer identities are learned at start-up and probed again in the health loop (a restarted prefill
instance answers with a new engine id), so the request path only builds leg bodies, picks instances
(`policy.py`: kv-aware or round-robin, from state the health loop refreshes) and relays bytes.  The client
sees nothing until P has answered 2xx and D has sent its first bytes -- or D answered first (it computed the
prompt itself), and P's leg is aborted.
Until the client saw a byte, a failed prefill is retried with the same transfer_id and the next attempt
(kvpush refuses older attempts), a failed decode moves to another decode instance the same way, and a
decode leg whose KV receive failed (the decode instance says so when asked: `RecvReport`) is retried with
the prefill's identity probed again -- a restarted or dead prefill instance costs no request that had not
started.  With no usable prefill instance the decode instance computes the prompt itself; with no usable
decode instance a prefill instance serves the request alone.  Every request ends within `request_timeout_s`.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import json
import logging
import time
import uuid
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpush_common.router.baselines import SingleInstance, baseline_legs
from kvpush_common.router.config import PRODUCT_MODES, RouterConfig
from kvpush_common.router.context import RequestContext
from kvpush_common.router.flow import RequestFlow
from kvpush_common.router.identity import Identities
from kvpush_common.router.legs import KVPushLegs
from kvpush_common.router.metrics import RouterMetrics
from kvpush_common.router.prefix_index import estimated_tokens, prompt_hashes
from kvpush_common.router.relay import Relay
from kvpush_common.router.replies import ClientFields, openai_error
from kvpush_common.router.upstreams import Upstreams

log = logging.getLogger(__name__)

TIMELINES_KEPT = 1000
MAX_BODY_BYTES = 64 << 20  # long prompts arrive as token-id lists


class Router:
    """The parts wired together, their lifecycle (start-up discovery, the health loop) and the handlers."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.mode = config.mode
        self.plan = KVPushLegs(push=self.mode == "push") if self.mode in PRODUCT_MODES else baseline_legs(self.mode)
        self.upstreams = Upstreams(config)
        self.metrics = RouterMetrics()
        self.identities = Identities(config, self.upstreams, self.plan, self.metrics, self.mode)
        self.timelines: collections.deque[dict] = collections.deque(maxlen=TIMELINES_KEPT)
        self._next_decode = itertools.cycle(self.upstreams.decode_urls)  # /v1/models only
        self._health_task: asyncio.Task | None = None
        self._decode_timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s)
        self._prefill_timeout = aiohttp.ClientTimeout(total=config.prefill_timeout_s,
                                                      sock_connect=config.connect_timeout_s)
        self.session: aiohttp.ClientSession | None = None
        self.relay: Relay | None = None
        self.serve = None  # the mode's request flow (RequestFlow.serve, or a baseline's), once started

    # the instances, as upstreams.py keeps them
    @property
    def prefills(self):
        return self.upstreams.prefills

    @property
    def decode_urls(self) -> list[str]:
        return self.upstreams.decode_urls

    @property
    def p_instances(self):
        return self.upstreams.p_instances

    @property
    def d_instances(self):
        return self.upstreams.d_instances

    # -- lifecycle
    async def start(self) -> None:
        # limit=0: concurrency is bounded by the engines, not by a connection pool
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=self._decode_timeout)
        self.upstreams.session = self.session
        self.relay = Relay(self.session, self.metrics, self.mode, self._prefill_timeout, self._decode_timeout)
        if self.mode == "single":
            self.serve = SingleInstance(self.relay, self.decode_urls[0]).serve
        else:
            self.serve = RequestFlow(self.config, self.plan, self.upstreams, self.identities, self.relay,
                                     self.metrics, self.mode).serve
        await self.identities.learn_all(time.monotonic() + self.config.startup_timeout_s)
        await self._health_round()
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        await self.identities.close()
        if self.session:
            await self.session.close()

    async def lifespan(self, app: web.Application):
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        yield
        await self.close()

    async def _health_round(self) -> None:
        now = await self.upstreams.check_health()
        self.identities.after_round(now)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self._health_round()

    # -- HTTP handlers
    async def handle_health(self, request: web.Request) -> web.Response:
        failed = self.upstreams.failing(time.monotonic())
        if failed:
            return web.json_response({"status": "unhealthy", "failed": failed}, status=503)
        return web.json_response({"status": "ok", "upstreams": list(self.upstreams.health)})

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_timelines(self, request: web.Request) -> web.Response:
        return web.json_response(list(self.timelines))

    async def handle_models(self, request: web.Request) -> web.Response:
        url = next(self._next_decode)
        try:
            async with self.session.get(f"{url}/v1/models", headers=_auth(request),
                                        timeout=aiohttp.ClientTimeout(total=30)) as resp:
                return web.Response(status=resp.status, body=await resp.read(),
                                    headers={"Content-Type": resp.headers.get("Content-Type", "application/json")})
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return web.json_response(openai_error(f"decode {url}: {e!r}", 502), status=502)

    async def handle_generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = msgspec.json.decode(await request.read(), type=dict[str, Any])
            stream = bool(msgspec.convert(body, ClientFields).stream)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.metrics.requests.labels(self.mode, "bad_request").inc()
            return web.json_response(openai_error(f"invalid request body: {e}", 400, "invalid_request_error"),
                                     status=400)
        ctx = RequestContext(path=request.path, chat=chat, body=body, stream=stream,
                             request_id=request.headers.get("X-Request-Id") or uuid.uuid4().hex,
                             headers=_auth(request), hashes=prompt_hashes(body, chat),
                             prompt_tokens=estimated_tokens(body, chat))
        response: web.StreamResponse | None = None
        try:
            response = await asyncio.wait_for(self.serve(request, ctx), self.config.request_timeout_s)
        except asyncio.TimeoutError:
            response = await self.relay.fail(ctx, "request_timeout", "timeout", 504,
                                             f"no answer within {self.config.request_timeout_s:g} s")
        except asyncio.CancelledError:  # the client hung up (handler_cancellation): legs are closed by now
            self.metrics.failures.labels(self.mode, "client_gone").inc()
            ctx.outcome = "client_gone"
            raise
        finally:
            self._record(ctx, response)
        return response

    def _record(self, ctx: RequestContext, response: web.StreamResponse | None) -> None:
        outcome = ctx.outcome or ("ok" if response is not None and response.status < 400 else "failed")
        self.metrics.requests.labels(self.mode, outcome).inc()
        entry = ctx.timeline(self.mode, outcome)
        self.timelines.append(entry)
        if ctx.stream:
            log.info("timeline %s", json.dumps(entry))


def _auth(request: web.Request) -> dict[str, str]:
    """Headers forwarded to every upstream: only the API key, if the client sent one."""
    auth = request.headers.get("Authorization")
    return {"Authorization": auth} if auth else {}


ROUTER_KEY = web.AppKey("router", Router)


def build_app(config: RouterConfig) -> web.Application:
    router = Router(config)
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[ROUTER_KEY] = router
    app.cleanup_ctx.append(router.lifespan)
    app.add_routes([
        web.post("/v1/completions", functools.partial(router.handle_generate, chat=False)),
        web.post("/v1/chat/completions", functools.partial(router.handle_generate, chat=True)),
        web.get("/v1/models", router.handle_models),
        web.get("/health", router.handle_health),
        web.get("/metrics", router.handle_metrics),
        web.get("/timelines", router.handle_timelines),
    ])
    return app
