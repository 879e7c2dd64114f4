"""OpenAI-compatible HTTP router in front of disaggregated vLLM: prefill instances (P), decode instances (D).

Modes: `push` (kvpush: both legs at once, D's blocks registered while P computes), `nixl-pull` (vLLM
NixlConnector: P, then D with P's answer), `nixl-push` (vLLM NixlPushConnector: both legs at once) and
`single` (one instance, the reference).  Producer identities are learned once at start-up, so the
request path only builds leg bodies, picks instances (`policy.py`: kv-aware or round-robin, from state
the health loop refreshes) and relays bytes.  The client sees nothing until P has answered 2xx and D has
sent its first bytes -- or D answered first (it computed the prompt itself), and P's leg is aborted.
Until the client saw a byte, a failed prefill is retried with the same transfer_id and the next attempt
(kvpush refuses older attempts), and a failed decode moves to another decode instance the same way.
Every request ends within `request_timeout_s`.
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
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from kvpush_common.protocol.legs import ProducerIdentity
from kvpush_common.router.load import parse_vllm_load
from kvpush_common.router.policy import POLICIES, Choice, Instance, make_policy
from kvpush_common.router.prefix_index import estimated_tokens, prompt_hashes, uncached_tokens

log = logging.getLogger(__name__)

MODES = ("push", "pull", "nixl-pull", "nixl-push", "single")
KVPUSH_MODES = ("push", "pull")  # kvpush connectors on both sides
IDENTITY_MODES = ("push", "pull", "nixl-push")  # D needs P's identity: learned once at start-up
TIMELINES_KEPT = 1000
MAX_BODY_BYTES = 64 << 20  # long prompts arrive as token-id lists


@dataclass(frozen=True)
class RouterConfig:
    """What `kvpush router` was told; validated here so a bad combination fails before anything starts."""

    mode: str
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    retries: int = 2
    request_timeout_s: float = 300.0
    prefill_timeout_s: float | None = None  # per attempt, so a hung P is retried; None: no bound but the request's
    connect_timeout_s: float = 10.0
    startup_timeout_s: float = 600.0
    health_interval_s: float = 5.0
    warm_up: bool = True  # push: one tiny request per (prefill, decode) pair at start-up (handshakes early)
    policy: str = "kv-aware"  # router/policy.py: kv-aware or round-robin
    # kvpush modes: no prefill leg when the chosen decode instance probably holds all of the prompt but at most
    # this many tokens (prefix index estimate); it computes them itself.  0 (default): every request has both
    # legs, so `push` means push (benchmarks of the transfer stay that); chat traffic: e.g. 256
    skip_prefill_max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if not self.decode_urls:
            raise ValueError("at least one decode URL is needed")
        if self.mode != "single" and not self.prefill_urls:
            raise ValueError(f"mode {self.mode} needs at least one prefill URL")
        if self.retries < 0 or self.request_timeout_s <= 0:
            raise ValueError("retries must be >= 0 and request_timeout_s > 0")
        if self.skip_prefill_max_tokens < 0:
            raise ValueError("skip_prefill_max_tokens must be >= 0")


class StartupError(RuntimeError):
    """The router cannot serve: an upstream stayed down or did not tell who it is."""


# ---- typed views of untrusted JSON (client bodies, upstream answers) ----------------------------------

class NixlProducer(msgspec.Struct, frozen=True):
    """P's side channel as NixlPushConnector reports it in a prefill's kv_transfer_params."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    tp_size: int


class _IdentityParams(msgspec.Struct):
    kvpush_identity: ProducerIdentity


class UpstreamReply(msgspec.Struct):
    """The part of a vLLM completion answer the router reads; everything else is ignored."""

    kv_transfer_params: dict[str, Any] | None = None


class _Model(msgspec.Struct):
    id: str


class _ModelList(msgspec.Struct):
    data: list[_Model]


class ClientFields(msgspec.Struct):
    """The fields of a client body the router acts on; the body itself passes through untouched."""

    stream: bool | None = False


# ---- leg bodies (pure) -------------------------------------------------------------------------------

def push_prefill_params(transfer_id: str, attempt: int, consumer_tp: int | None = None) -> dict:
    params = {"kvpush": "prefill", "transfer_id": transfer_id, "attempt": attempt}
    return params if consumer_tp is None else {**params, "consumer_tp": consumer_tp}


def push_decode_params(transfer_id: str, attempt: int, producer: ProducerIdentity) -> dict:
    identity = {"engine_id": producer.engine_id, "host": producer.host, "port": producer.port,
                "tp_size": producer.tp_size}
    return {"kvpush": "decode", "transfer_id": transfer_id, "attempt": attempt, "producer": identity}


def nixl_prefill_params(transfer_id: str | None = None) -> dict:
    """NixlConnector's prefill request; NixlPushConnector also wants the transfer id."""
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
    if transfer_id is not None:
        params["transfer_id"] = transfer_id
    return params


def nixl_push_decode_params(producer: NixlProducer, request_id: str, transfer_id: str) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": producer.remote_engine_id,
            "remote_host": producer.remote_host, "remote_port": producer.remote_port, "tp_size": producer.tp_size,
            "remote_request_id": request_id, "transfer_id": transfer_id}


def leg_params(mode: str, producer: Any, transfer_id: str, attempt: int, request_id: str,
               consumer_tp: int | None = None) -> tuple[dict, dict | None]:
    """kv_transfer_params of the prefill leg, and of the decode leg when it is known before P answers."""
    if mode == "push":
        return (push_prefill_params(transfer_id, attempt, consumer_tp),
                push_decode_params(transfer_id, attempt, producer))
    if mode == "nixl-push":
        return nixl_prefill_params(transfer_id), nixl_push_decode_params(producer, request_id, transfer_id)
    if mode == "pull":  # kvpush pull: D's leg is sent only once P has answered
        return push_prefill_params(transfer_id, attempt, consumer_tp), None
    return nixl_prefill_params(), None  # nixl-pull: D's params are P's answer


def prefill_body(body: dict, kv_params: dict, chat: bool) -> dict:
    """P computes the KV and one token, unstreamed; options that clash with that are dropped.  One
    sequence: the prompt's KV is the same for every sample of `n > 1`, whose samples D draws."""
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "best_of")}
    leg.update(max_tokens=1, stream=False, kv_transfer_params=kv_params)
    if "n" in leg:
        leg["n"] = 1
    if chat:
        leg["max_completion_tokens"] = 1
    return leg


def decode_body(body: dict, kv_params: dict | None) -> dict:
    return body if kv_params is None else {**body, "kv_transfer_params": kv_params}


def local_body(body: dict) -> dict:
    """D's leg when it computes the prompt alone: a client's own kv_transfer_params are dropped (in a
    disaggregated mode only the router tells an engine where KV comes from)."""
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}


def openai_error(message: str, status: int, kind: str = "upstream_error") -> dict:
    return {"error": {"message": message, "type": kind, "code": status}}


# ---- request state ------------------------------------------------------------------------------------

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
class RequestContext:
    path: str
    chat: bool
    body: dict
    stream: bool
    request_id: str
    headers: dict[str, str]
    transfer_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival: float = field(default_factory=time.monotonic)
    arrival_unix: float = field(default_factory=time.time)  # joins timelines with the endpoints' event logs
    attempt: int = 0
    outcome: str | None = None
    stamps: dict[str, float] = field(default_factory=dict)
    streamed: web.StreamResponse | None = None  # set once bytes went to the client
    hashes: list[bytes] = field(default_factory=list)  # the prompt's prefix hash chain (routing)
    prompt_tokens: int | None = None  # estimated (prefix_index.estimated_tokens); None: unknown shape
    route: dict = field(default_factory=dict)  # this attempt's instances and why (timeline)
    failed_decodes: set[str] = field(default_factory=set)  # decode instances that failed this request

    def stamp(self, name: str) -> None:
        self.stamps[name] = round((time.monotonic() - self.arrival) * 1000, 3)

    def leg_headers(self) -> dict[str, str]:
        """Both legs of an attempt carry one X-Request-Id; a retry gets its own, so vLLM never sees a duplicate."""
        rid = self.request_id if self.attempt == 0 else f"{self.request_id}-{self.attempt}"
        return {**self.headers, "X-Request-Id": rid}


class RouterMetrics:
    """The router's Prometheus series, in a registry of its own (tests run several routers in a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        seconds = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.requests = Counter("kvpush_router_requests", "client requests by mode and outcome",
                                ["mode", "outcome"], registry=self.registry)
        self.retries = Counter("kvpush_router_retries", "attempts started again after a prefill failure",
                               ["mode"], registry=self.registry)
        self.failures = Counter("kvpush_router_failures", "failed legs and requests by cause",
                                ["mode", "cause"], registry=self.registry)
        self.ttft = Histogram("kvpush_router_ttft_seconds", "arrival to the first byte of D's answer",
                              ["mode"], buckets=seconds, registry=self.registry)
        self.prefill = Histogram("kvpush_router_prefill_seconds", "prefill leg: dispatch to P's whole answer",
                                 ["mode"], buckets=seconds, registry=self.registry)
        self.migrations = Counter("kvpush_router_migrations", "requests moved to another decode instance after a "
                                  "decode failure before the client saw a byte", ["mode"], registry=self.registry)
        self.prefill_cancelled = Counter("kvpush_router_prefill_cancelled",
                                         "prefill legs aborted because D answered first (it computed the prompt "
                                         "from its own prefix cache)", ["mode"], registry=self.registry)
        self.prefill_skipped = Counter("kvpush_router_prefill_skipped",
                                       "requests sent to a decode instance alone because it probably holds all "
                                       "but a short tail of the prompt", ["mode"], registry=self.registry)


@dataclass
class Prefill:
    url: str
    producer: ProducerIdentity | NixlProducer | None = None  # learned at start-up (push, nixl-push)


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


# ---- the router ---------------------------------------------------------------------------------------

class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.mode = config.mode
        self.prefills = [Prefill(u.rstrip("/")) for u in config.prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in config.decode_urls]
        self._next_decode = itertools.cycle(self.decode_urls)  # /v1/models only
        self.p_instances = {p.url: Instance(p.url) for p in self.prefills}
        self.d_instances = {u: Instance(u) for u in self.decode_urls}
        self.p_policy, self.d_policy = make_policy(config.policy), make_policy(config.policy)
        self.consumer_tp: dict[str, int] = {}  # decode url -> its TP size (kvpush modes, learned at start-up)
        self.health = {u: Health() for u in dict.fromkeys([p.url for p in self.prefills] + self.decode_urls)}
        self.metrics = RouterMetrics()
        self.timelines: collections.deque[dict] = collections.deque(maxlen=TIMELINES_KEPT)
        self.session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self._decode_timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s)
        self._prefill_timeout = aiohttp.ClientTimeout(total=config.prefill_timeout_s,
                                                      sock_connect=config.connect_timeout_s)

    # -- lifecycle
    async def start(self) -> None:
        # limit=0: concurrency is bounded by the engines, not by a connection pool
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=self._decode_timeout)
        if self.mode in IDENTITY_MODES:
            deadline = time.monotonic() + self.config.startup_timeout_s
            await asyncio.gather(*(self._learn_producer(p, deadline) for p in self.prefills))
            if self.mode in KVPUSH_MODES:
                await asyncio.gather(*(self._learn_consumer(d, deadline) for d in self.decode_urls))
            if self.mode == "push" and self.config.warm_up:
                await asyncio.gather(*(self._warm_up(p, d, deadline) for p in self.prefills for d in self.decode_urls))
        await self._check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
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

    async def _learn_producer(self, prefill: Prefill, deadline: float) -> None:
        """Ask P who it is once, with a probe request, so no request ever waits on it."""
        await self._wait_healthy(prefill.url, deadline)
        try:
            params = {"kvpush": "identity"} if self.mode in KVPUSH_MODES else nixl_prefill_params()
            status, raw = await self._probe(prefill.url, params, deadline)
            if status != 200:
                raise StartupError(f"prefill {prefill.url} answered the identity probe with {status}: {raw[:500]!r}")
            got = msgspec.json.decode(raw, type=UpstreamReply).kv_transfer_params
        except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError, msgspec.ValidationError,
                IndexError) as e:
            raise StartupError(f"identity probe of prefill {prefill.url} failed: {e!r}") from e
        try:
            if self.mode in KVPUSH_MODES:
                prefill.producer = msgspec.convert(got, _IdentityParams).kvpush_identity
            else:
                prefill.producer = msgspec.convert(got, NixlProducer)
        except msgspec.ValidationError as e:
            want = ("kv_transfer_params.kvpush_identity {engine_id, host, port, tp_size}: is it serving with "
                    "KVPushConnector as kv_producer?" if self.mode in KVPUSH_MODES else
                    "remote_engine_id, remote_host, remote_port, tp_size in kv_transfer_params: is it serving "
                    "with NixlPushConnector?")
            raise StartupError(f"prefill {prefill.url} did not report its identity ({e}); expected {want} "
                               f"Got kv_transfer_params={got!r}") from e
        log.info("prefill %s is %s", prefill.url, prefill.producer)

    async def _probe(self, url: str, kv_params: dict, deadline: float) -> tuple[int, bytes]:
        """One tiny completion carrying `kv_params` (the start-up identity probes): HTTP status and body."""
        async with self.session.get(f"{url}/v1/models") as resp:
            model = msgspec.json.decode(await resp.read(), type=_ModelList).data[0].id
        probe = {"model": model, "prompt": "ping", "max_tokens": 1, "kv_transfer_params": kv_params}
        timeout = aiohttp.ClientTimeout(total=max(1.0, deadline - time.monotonic()))
        async with self.session.post(f"{url}/v1/completions", json=probe, timeout=timeout) as resp:
            return resp.status, await resp.read()

    async def _learn_consumer(self, url: str, deadline: float) -> None:
        """D's TP size, asked once like P's identity: P's ranks that no D rank reads from then release
        their KV at once.  Optional: without it those ranks hold their KV to the lease end."""
        try:
            await self._wait_healthy(url, deadline)
            _, raw = await self._probe(url, {"kvpush": "identity"}, deadline)
            got = msgspec.json.decode(raw, type=UpstreamReply).kv_transfer_params
            self.consumer_tp[url] = msgspec.convert(got, _IdentityParams).kvpush_identity.tp_size
            log.info("decode %s has TP %d", url, self.consumer_tp[url])
        except Exception as e:  # noqa: BLE001 - an optimisation; serving goes on without it
            log.warning("decode %s did not report its TP size (%r): prefill ranks no decode rank reads from "
                        "will hold their KV until the lease ends", url, e)

    async def _warm_up(self, prefill: Prefill, decode_url: str, deadline: float) -> None:
        """One tiny push through each (prefill, decode) pair, so that the decode ranks handshake with the
        prefill ranks now and not on the first user request (measured: ~150 ms on 2 CPUs)."""
        try:
            await self._wait_healthy(decode_url, deadline)
            async with self.session.get(f"{prefill.url}/v1/models") as resp:
                model = msgspec.json.decode(await resp.read(), type=_ModelList).data[0].id
            tid = f"warmup-{uuid.uuid4().hex}"
            body = {"model": model, "prompt": "warm up", "max_tokens": 1}
            legs = [self.session.post(f"{prefill.url}/v1/completions",
                                      json={**body, "kv_transfer_params": push_prefill_params(tid, 0)}),
                    self.session.post(f"{decode_url}/v1/completions",
                                      json={**body, "kv_transfer_params": push_decode_params(tid, 0, prefill.producer)})]
            timeout = max(1.0, min(60.0, deadline - time.monotonic()))
            replies = await asyncio.wait_for(asyncio.gather(*legs), timeout)
            for r in replies:
                await r.read()
                r.release()
            log.info("warmed up %s -> %s: %s", prefill.url, decode_url, [r.status for r in replies])
        except Exception as e:  # noqa: BLE001 - warm-up is an optimisation; serving goes on without it
            log.warning("warm-up %s -> %s failed: %r", prefill.url, decode_url, e)

    async def _wait_healthy(self, url: str, deadline: float) -> None:
        next_log = 0.0
        while True:
            error, _ = await self._probe_health(url)
            if error is None:
                return
            now = time.monotonic()
            if now >= deadline:
                raise StartupError(f"{url} not healthy after {self.config.startup_timeout_s:g} s: {error}")
            if now >= next_log:
                log.info("waiting for %s/health (%.0f s left): %s", url, deadline - now, error)
                next_log = now + 10.0
            await asyncio.sleep(min(1.0, max(0.0, deadline - now)))

    # -- health
    @property
    def _probe_timeout_s(self) -> float:
        return min(5.0, self.config.health_interval_s * 2)

    @property
    def _stale_after_s(self) -> float:
        """Older than three of the health loop's longest rounds (sleep + a probe timing out): the loop stalled."""
        return 3 * (self.config.health_interval_s + self._probe_timeout_s)

    async def _probe_health(self, url: str) -> tuple[str | None, bool]:
        """Why `url` is not healthy now (None when its /health answered 200), and whether the probe timed out."""
        timeout = aiohttp.ClientTimeout(total=self._probe_timeout_s)
        try:
            async with self.session.get(f"{url}/health", timeout=timeout) as resp:
                return (None if resp.status == 200 else f"/health answered {resp.status}"), False
        except asyncio.TimeoutError:
            return "/health timed out", True
        except aiohttp.ClientError as e:
            return f"/health failed: {e}", False

    async def _check_health(self) -> None:
        """Probes every upstream's /health and, for the kv-aware policy, reads its /metrics, all at once (one
        round lasts at most one probe timeout)."""
        scrapes = [self._scrape_load(u) for u in self.health] if self.config.policy == "kv-aware" else []
        results = await asyncio.gather(*(self._probe_health(u) for u in self.health), *scrapes)
        now = time.monotonic()
        for url, (error, timed_out) in zip(self.health, results):
            self.health[url].record(now, error, timed_out)

    async def _scrape_load(self, url: str) -> None:
        """The instance's queue and KV-cache use from its /metrics (the kv-aware policy's load term).  A decode
        instance lists a request waiting for its KV as waiting: the ones this router sent are its own in
        flight, counted once (as in flight), so its waiting is what the page shows beyond them -- else a
        conversation's next turn could leave the decode holding its history for a queue that is only ours."""
        decode = self.d_instances.get(url)
        ours_before = (decode.in_flight, decode.sent) if decode is not None else (0, 0)
        timeout = aiohttp.ClientTimeout(total=self._probe_timeout_s)
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

    def _healthy(self, instances: list[Instance], avoid: set[str] = frozenset()) -> list[Instance]:
        """The instances to choose from: healthy ones not to avoid; else any not to avoid; else all."""
        now = time.monotonic()
        usable = [i for i in instances if i.url not in avoid]
        healthy = [i for i in usable if self.health[i.url].ok(now, self._stale_after_s)]
        return healthy or usable or instances

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self._check_health()

    # -- HTTP handlers
    async def handle_health(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        failed = {u: h.error for u, h in self.health.items() if not h.ok(now, self._stale_after_s)}
        if failed:
            return web.json_response({"status": "unhealthy", "failed": failed}, status=503)
        return web.json_response({"status": "ok", "upstreams": list(self.health)})

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
            response = await asyncio.wait_for(self._serve(request, ctx), self.config.request_timeout_s)
        except asyncio.TimeoutError:
            response = await self._fail(ctx, "request_timeout", "timeout", 504,
                                        f"no answer within {self.config.request_timeout_s:g} s")
        except asyncio.CancelledError:  # the client hung up (handler_cancellation): legs are closed by now
            self.metrics.failures.labels(self.mode, "client_gone").inc()
            ctx.outcome = "client_gone"
            raise
        finally:
            self._record(ctx, response)
        return response

    # -- request flow
    async def _serve(self, request: web.Request, ctx: RequestContext) -> web.StreamResponse:
        if self.mode == "single":
            ctx.stamp("dispatched")
            try:
                upstream = await self._first_output(self.decode_urls[0], ctx, None)
            except LegError as e:
                return await self._leg_failed(ctx, e)
            return await self._relay(request, ctx, upstream)
        last: LegError | None = None
        for attempt in range(self.config.retries + 1):
            ctx.attempt = attempt
            if attempt:
                self.metrics.retries.labels(self.mode).inc()
                log.warning("request %s: retrying as attempt %d after: %s", ctx.request_id, attempt, last)
            decode = None
            try:
                output = await self._attempt(ctx)
                decode = self.d_instances[ctx.route["decode"]]
                return await self._relay(request, ctx, output)
            except LegError as e:
                if e.is_client_error or not self._retryable(ctx, e):
                    return await self._leg_failed(ctx, e)
                if e.leg == "decode":  # nothing reached the client: migrate to another decode instance
                    ctx.failed_decodes.add(ctx.route["decode"])
                    self.metrics.migrations.labels(self.mode).inc()
                self.metrics.failures.labels(self.mode, f"{e.leg}_{e.cause}").inc()
                last = e
                continue
            finally:
                if decode is not None:
                    decode.leave()
        return await self._fail(ctx, "retries_exhausted", "failed", 502,
                                f"no attempt succeeded in all {self.config.retries + 1} attempts; last: {last}")

    def _retryable(self, ctx: RequestContext, e: LegError) -> bool:
        """A prefill failure is retried; a decode failure only before the client saw a byte and when another
        decode instance is there to take the request (request migration)."""
        if e.leg == "prefill":
            return True
        others = [u for u in self.d_instances if u != ctx.route.get("decode") and u not in ctx.failed_decodes]
        return ctx.streamed is None and bool(others)

    async def _attempt(self, ctx: RequestContext) -> "DecodeOutput":
        """One try at both legs: D's first output once P has answered 2xx -- or before, when D answers first
        (it computed the prompt from its own prefix cache): then the prefill leg lost the race and is
        aborted (closing its connection makes vLLM abort the request and free its blocks)."""
        d_choice = self.d_policy.choose(self._healthy(list(self.d_instances.values()), ctx.failed_decodes),
                                        ctx.hashes)
        tail = self._local_tail(ctx, d_choice.instance)
        if tail is not None:
            return await self._decode_only(ctx, d_choice, tail)
        p_choice = self.p_policy.choose(self._healthy(list(self.p_instances.values())), ctx.hashes)
        prefill = next(p for p in self.prefills if p.url == p_choice.instance.url)
        decode_url = d_choice.instance.url
        ctx.route = {"prefill": prefill.url, "decode": decode_url, "prefill_why": p_choice.why,
                     "decode_why": d_choice.why}
        for choice in (p_choice, d_choice):
            choice.instance.index.record(ctx.hashes)  # both will hold the prompt's KV (P computes, D receives)
        p_params, d_params = leg_params(self.mode, prefill.producer, ctx.transfer_id, ctx.attempt,
                                        ctx.leg_headers()["X-Request-Id"], self.consumer_tp.get(decode_url))
        ctx.stamp("dispatched")
        prefill_task = asyncio.create_task(self._prefill_leg(prefill.url, ctx, p_params))
        decode_task = None
        if d_params is not None:
            decode_task = asyncio.create_task(self._first_output(decode_url, ctx, d_params))
        d_choice.instance.enter()  # until the request is relayed (then the caller ends it)
        try:
            pending = {t for t in (prefill_task, decode_task) if t}
            while prefill_task in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if prefill_task not in done:
                    output = decode_task.result()  # D failed first: that ends the request
                    await _discard(prefill_task)
                    ctx.stamp("prefill_cancelled")
                    self.metrics.prefill_cancelled.labels(self.mode).inc()
                    return output
            reply = prefill_task.result()
            ctx.stamp("prefill_done")
            if decode_task is None and self.mode == "pull":  # late destination choice
                d_params = push_decode_params(ctx.transfer_id, ctx.attempt, prefill.producer)
                decode_task = asyncio.create_task(self._first_output(decode_url, ctx, d_params))
            if decode_task is None:  # nixl-pull: D's params are exactly what P answered
                if not reply.kv_transfer_params:
                    raise LegError("prefill", "bad_reply", f"prefill {prefill.url} answered no kv_transfer_params")
                decode_task = asyncio.create_task(self._first_output(decode_url, ctx, reply.kv_transfer_params))
            return await decode_task
        except BaseException:
            d_choice.instance.leave()
            await _discard(prefill_task, decode_task)
            raise

    def _local_tail(self, ctx: RequestContext, decode: Instance) -> int | None:
        """The tokens `decode` probably computes for this prompt, when few enough that it should compute them
        with no prefill leg at all; None otherwise (and outside kvpush modes, whose baselines stay vLLM's)."""
        limit = self.config.skip_prefill_max_tokens
        if self.mode not in KVPUSH_MODES or not limit:
            return None
        matched = decode.index.matched(ctx.hashes)
        tail = uncached_tokens(ctx.prompt_tokens, matched)
        return tail if matched and tail is not None and tail <= limit else None

    async def _decode_only(self, ctx: RequestContext, d_choice: Choice, tail: int) -> "DecodeOutput":
        """D probably caches all of the prompt but a short tail: it computes that itself, so no prefill instance
        computes or holds anything.  A stale hint (D evicted the prefix) costs D a longer prefill, never a
        wrong answer; a decode failure is retried like any other, from the policy's next choice."""
        url = d_choice.instance.url
        ctx.route = {"prefill": None, "decode": url, "decode_why": d_choice.why,
                     "prefill_skipped": {"uncached_tokens_est": tail,
                                         "limit": self.config.skip_prefill_max_tokens}}
        d_choice.instance.index.record(ctx.hashes)
        ctx.stamp("dispatched")
        ctx.stamp("prefill_skipped")
        self.metrics.prefill_skipped.labels(self.mode).inc()
        d_choice.instance.enter()  # until the request is relayed (then the caller ends it)
        try:
            return await self._first_output(url, ctx, None, local=True)
        except BaseException:
            d_choice.instance.leave()
            raise

    async def _prefill_leg(self, url: str, ctx: RequestContext, params: dict) -> UpstreamReply:
        inst = self.p_instances[url]
        inst.enter()
        try:
            return await self._prefill_answer(url, ctx, params)
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

    async def _first_output(self, url: str, ctx: RequestContext, params: dict | None,
                            local: bool = False) -> "DecodeOutput":
        """D's response and the first bytes of its body (for a stream: the first token)."""
        resp = await self._open_decode(url, ctx, params, local)
        try:
            first = await resp.content.readany()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            resp.close()
            raise LegError("decode", "stream", f"decode {url} stream broke before its first byte: {e!r}") from e
        except BaseException:
            resp.close()
            raise
        ctx.stamp("first_byte")
        self.metrics.ttft.labels(self.mode).observe(ctx.stamps["first_byte"] / 1000)
        return DecodeOutput(resp, first)

    async def _relay(self, request: web.Request, ctx: RequestContext, output: "DecodeOutput") -> web.StreamResponse:
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
                    return await self._fail(ctx, "decode_stream", "failed", 502, f"decode stream broke: {e!r}")
            ctx.stamp("done")
            ctx.outcome = ctx.outcome or "ok"
            if ctx.streamed is not None:
                await ctx.streamed.write_eof()
                return ctx.streamed
            headers["x-kvpush-timeline"] = json.dumps(ctx.stamps)
            return web.Response(status=upstream.status, body=b"".join(chunks), headers=headers)
        finally:
            upstream.release() if upstream.content.at_eof() else upstream.close()

    async def _leg_failed(self, ctx: RequestContext, e: LegError) -> web.StreamResponse:
        """Pass an upstream's own HTTP error through as it is; anything else becomes a 502."""
        self.metrics.failures.labels(self.mode, f"{e.leg}_{e.cause}").inc()
        if e.answer is None:
            return await self._fail(ctx, None, "failed", 502, str(e))
        ctx.outcome = "upstream_error"
        return web.Response(status=e.answer.status, body=e.answer.body,
                            headers={"Content-Type": e.answer.content_type, "X-Request-Id": ctx.request_id})

    async def _fail(self, ctx: RequestContext, cause: str | None, outcome: str, status: int,
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

    def _record(self, ctx: RequestContext, response: web.StreamResponse | None) -> None:
        outcome = ctx.outcome or ("ok" if response is not None and response.status < 400 else "failed")
        self.metrics.requests.labels(self.mode, outcome).inc()
        entry = {"transfer_id": ctx.transfer_id, "attempt": ctx.attempt, "mode": self.mode,
                 "request_id": ctx.request_id, "outcome": outcome, "arrival_unix": round(ctx.arrival_unix, 6),
                 **ctx.stamps, "route": ctx.route}
        if ctx.failed_decodes:
            entry["migrated_from"] = sorted(ctx.failed_decodes)
        self.timelines.append(entry)
        if ctx.stream:
            log.info("timeline %s", json.dumps(entry))


@dataclass
class DecodeOutput:
    """D's open response and the first bytes read from its body."""

    response: aiohttp.ClientResponse
    first: bytes


async def _discard(*tasks: asyncio.Task | None) -> None:
    """End legs that are no longer wanted: closing their connections makes vLLM abort those requests."""
    live = [t for t in tasks if t is not None]
    for task in live:
        task.cancel()
    await asyncio.gather(*live, return_exceptions=True)
    for task in live:
        if not task.cancelled() and task.exception() is None and isinstance(task.result(), DecodeOutput):
            task.result().response.close()


def _auth(request: web.Request) -> dict[str, str]:
    """Headers forwarded to every upstream: only the API key, if the client sent one."""
    auth = request.headers.get("Authorization")
    return {"Authorization": auth} if auth else {}


def _json(headers: dict[str, str]) -> dict[str, str]:
    return {**headers, "Content-Type": "application/json"}


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
