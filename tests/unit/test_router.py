"""The HTTP router against fake vLLM servers on 127.0.0.1: leg bodies, concurrency, retries, timeouts, relays."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from dataclasses import dataclass, field

import pytest
from aiohttp import ClientTimeout, web
from aiohttp.test_utils import TestClient, TestServer

from kvpush_common.router.app import (
    NixlProducer, ROUTER_KEY, RouterConfig, StartupError, build_app, decode_body, nixl_prefill_params, nixl_push_decode_params,
    prefill_body, push_decode_params, push_prefill_params,
)
from kvpush_common.protocol.legs import ProducerIdentity

IDENTITY = {"engine_id": "prefill-0", "host": "10.0.0.7", "port": 5600, "tp_size": 2}
NIXL_COORDS = {"remote_engine_id": "nixl-p", "remote_host": "10.0.0.8", "remote_port": 5700, "tp_size": 4,
               "remote_block_ids": None, "do_remote_prefill": True}
SSE = [b'data: {"choices":[{"text":"Hel"}]}\n\n', b'data: {"choices":[{"text":"lo \xc3\xa9"}]}\n\n',
       b'data: {"choices":[{"text":"!"}]}\n\ndata: [DONE]\n\n']
ANSWER = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "Hello!"}]}


def run_async(fn):
    """Each test owns its event loop and can never run past 20 s."""
    @functools.wraps(fn)
    def wrapper():
        asyncio.run(asyncio.wait_for(fn(), 20))
    return wrapper


@dataclass
class Leg:
    body: dict
    request_id: str | None
    arrived: float
    finished: float | None = None
    disconnected: bool = False

    @property
    def params(self) -> dict:
        return self.body.get("kv_transfer_params") or {}


@dataclass
class FakeVllm:
    """A vLLM instance as the router sees it: P answers after `delay`, D waits until P has "pushed" the KV."""

    role: str
    done: set = field(default_factory=set)  # (transfer_id, attempt) that some P finished; shared P/D
    delay: float = 0.0
    actions: list[str] = field(default_factory=list)  # per leg, in order: ok, 500, 400, hang, drop, stall
    identity: dict | None = field(default_factory=lambda: dict(IDENTITY))
    reply_params: dict | None = None
    healthy: bool = True
    legs: list[Leg] = field(default_factory=list)
    probes: list[dict] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.post("/v1/completions", self.generate), web.post("/v1/chat/completions", self.generate),
                        web.get("/health", self.health), web.get("/v1/models", self.models)])
        return app

    async def health(self, request):
        return web.Response(status=200 if self.healthy else 500)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": f"tiny-{self.role}", "object": "model"}]})

    async def generate(self, request):
        body = await request.json()
        if body.get("prompt") == "ping":
            return self._probe_answer(body)
        leg = Leg(body, request.headers.get("X-Request-Id"), time.monotonic())
        self.legs.append(leg)
        action = self.actions.pop(0) if self.actions else "ok"
        try:
            return await self._answer(request, leg, action)
        except asyncio.CancelledError:  # TestServer cancels the handler when the client hangs up
            leg.disconnected = True
            raise

    async def _answer(self, request, leg: Leg, action: str):
        body = leg.body
        if self.role == "decode" and action in ("ok", "stall") and not await self._kv_arrived(request, leg):
            return web.Response(status=499)
        await asyncio.sleep(self.delay)
        if action == "500":
            return web.json_response({"error": {"message": "engine died"}}, status=500)
        if action == "400":
            return web.json_response({"error": {"message": "bad prompt", "code": 400}}, status=400)
        if action == "drop":
            request.transport.close()
            return web.Response()
        if action == "hang":
            await self._until_disconnected(request, leg, 60)
            return web.Response(status=499)
        if self.role == "prefill":
            leg.finished = time.monotonic()
            self.done.add((leg.params.get("transfer_id"), leg.params.get("attempt", 0)))
            return web.json_response({**ANSWER, "kv_transfer_params": self.reply_params})
        if not body.get("stream"):
            return web.json_response(ANSWER)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        for chunk in SSE:
            await response.write(chunk)
            if action == "stall":
                await self._until_disconnected(request, leg, 60)
                return response
            await asyncio.sleep(0.01)
        return response

    def _probe_answer(self, body):
        self.probes.append(body)
        if body["kv_transfer_params"].get("kvpush") == "identity":
            params = {"kvpush_identity": self.identity} if self.identity else {"something_else": 1}
        else:
            params = dict(NIXL_COORDS)
        return web.json_response({**ANSWER, "kv_transfer_params": params})

    async def _kv_arrived(self, request, leg: Leg) -> bool:
        """Like a kvpush/NIXL consumer: no tokens before the prefill with this transfer id and attempt is done."""
        key = (leg.params.get("transfer_id"), leg.params.get("attempt", 0))
        if key[0] is None:
            return True  # nixl-pull and single: P already finished
        while key not in self.done:
            if request.transport is None or request.transport.is_closing():
                leg.disconnected = True
                return False
            await asyncio.sleep(0.005)
        return True

    @staticmethod
    async def _until_disconnected(request, leg: Leg, limit: float) -> None:
        end = time.monotonic() + limit
        while time.monotonic() < end:
            if request.transport is None or request.transport.is_closing():
                leg.disconnected = True
                return
            await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def router_stack(mode: str = "push", prefills: int = 1, **config):
    """Fake P(s) and D, then the router in front of them; yields (client, [P...], D)."""
    done: set = set()
    fakes_p = [FakeVllm("prefill", done) for _ in range(prefills)]
    fake_d = FakeVllm("decode", done)
    for fake, overrides in [(p, config.pop("prefill", {})) for p in fakes_p[:1]] + [(fake_d, config.pop("decode", {}))]:
        for key, value in overrides.items():
            setattr(fake, key, value)
    servers = [TestServer(f.app(), host="127.0.0.1") for f in fakes_p + [fake_d]]
    async with contextlib.AsyncExitStack() as stack:
        for server in servers:
            await stack.enter_async_context(server)
        urls = [str(s.make_url("")) for s in servers]
        config.setdefault("warm_up", False)  # the fakes count legs; warm-up has its own test
        cfg = RouterConfig(mode=mode, prefill_urls=tuple(urls[:-1]), decode_urls=(urls[-1],), **config)
        client = TestClient(TestServer(build_app(cfg), host="127.0.0.1"))
        stack.push_async_callback(client.close)  # also when the router fails to start
        await client.start_server()
        yield client, fakes_p, fake_d


async def wait_for(predicate, limit: float = 2.0) -> None:
    end = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.01)


# ---- pure leg builders -------------------------------------------------------------------------------

def test_push_leg_bodies():
    client = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"x": 1},
              "kv_transfer_params": {"from": "client"}}
    producer = ProducerIdentity(**IDENTITY)
    p = prefill_body(client, push_prefill_params("t1", 3), chat=False)
    assert p == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False,
                 "kv_transfer_params": {"kvpush": "prefill", "transfer_id": "t1", "attempt": 3}}
    d = decode_body(client, push_decode_params("t1", 3, producer))
    assert d == {**client, "kv_transfer_params": {"kvpush": "decode", "transfer_id": "t1", "attempt": 3,
                                                  "producer": IDENTITY}}
    assert client["max_tokens"] == 50 and client["kv_transfer_params"] == {"from": "client"}  # not mutated
    chat = prefill_body({"messages": [], "max_completion_tokens": 9}, push_prefill_params("t", 0), chat=True)
    assert chat["max_tokens"] == 1 and chat["max_completion_tokens"] == 1


def test_nixl_leg_params():
    pull = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert nixl_prefill_params() == pull
    assert nixl_prefill_params("t9") == {**pull, "transfer_id": "t9"}
    coords = NixlProducer(remote_engine_id="e", remote_host="h", remote_port=7, tp_size=2)
    assert nixl_push_decode_params(coords, "rid", "t9") == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e", "remote_host": "h",
        "remote_port": 7, "tp_size": 2, "remote_request_id": "rid", "transfer_id": "t9"}


def test_config_refuses_missing_upstreams():
    with pytest.raises(ValueError, match="prefill"):
        RouterConfig(mode="push", prefill_urls=(), decode_urls=("http://d",))
    with pytest.raises(ValueError, match="mode"):
        RouterConfig(mode="bogus", prefill_urls=("http://p",), decode_urls=("http://d",))


# ---- push --------------------------------------------------------------------------------------------

@run_async
async def test_push_dispatches_both_legs_at_once():
    async with router_stack(prefill={"delay": 0.3}) as (client, [p], d):
        body = {"model": "m", "prompt": "hello", "max_tokens": 20}
        resp = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "req-42"})
        assert resp.status == 200 and await resp.json() == ANSWER
        [pl], [dl] = p.legs, d.legs
        assert dl.arrived < pl.finished - 0.2, "decode leg must be sent while the prefill leg runs"
        assert pl.request_id == dl.request_id == "req-42"
        tid = pl.params["transfer_id"]
        assert len(tid) == 32 and int(tid, 16) >= 0
        assert pl.body == {**body, "max_tokens": 1, "stream": False,
                           "kv_transfer_params": {"kvpush": "prefill", "transfer_id": tid, "attempt": 0}}
        assert dl.body == {**body, "kv_transfer_params": {"kvpush": "decode", "transfer_id": tid, "attempt": 0,
                                                          "producer": IDENTITY}}
        assert p.probes[0]["kv_transfer_params"] == {"kvpush": "identity"} and p.probes[0]["model"] == "tiny-prefill"
        stamps = json.loads(resp.headers["x-kvpush-timeline"])
        assert stamps["dispatched"] <= stamps["prefill_done"] <= stamps["first_byte"] <= stamps["done"]
        assert stamps["prefill_done"] >= 300
        [timeline] = await (await client.get("/timelines")).json()
        assert timeline["transfer_id"] == tid and timeline["attempt"] == 0 and timeline["mode"] == "push"
        assert timeline["prefill_done"] == stamps["prefill_done"]


@run_async
async def test_push_chat_streams_bytes_unchanged():
    async with router_stack(prefill={"delay": 0.05}) as (client, [p], d):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "stream_options": {"include_usage": True}, "max_completion_tokens": 30}
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        assert await resp.read() == b"".join(SSE)
        [pl], [dl] = p.legs, d.legs
        assert pl.body["max_tokens"] == 1 and pl.body["max_completion_tokens"] == 1
        assert pl.body["stream"] is False and "stream_options" not in pl.body
        assert dl.body["stream"] is True and dl.body["stream_options"] == {"include_usage": True}
        assert pl.request_id == dl.request_id and pl.params["transfer_id"] == dl.params["transfer_id"]


@run_async
async def test_prefill_failure_retries_with_next_attempt_and_drops_first_decode():
    async with router_stack(prefill={"delay": 0.15, "actions": ["500"]}) as (client, [p], d):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 5})
        assert resp.status == 200 and await resp.json() == ANSWER
        assert [leg.params["attempt"] for leg in p.legs] == [0, 1]
        assert [leg.params["attempt"] for leg in d.legs] == [0, 1]
        assert len({leg.params["transfer_id"] for leg in p.legs + d.legs}) == 1, "a retry keeps the transfer id"
        assert p.legs[0].request_id == d.legs[0].request_id != p.legs[1].request_id == d.legs[1].request_id
        await wait_for(lambda: d.legs[0].disconnected)  # the router closed the first decode leg
        assert not d.legs[1].disconnected
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpush_router_retries_total{mode="push"} 1.0' in metrics
        assert 'kvpush_router_failures_total{cause="prefill_status",mode="push"} 1.0' in metrics


@run_async
async def test_exhausted_retries_give_a_clear_502():
    async with router_stack(retries=2, prefill={"delay": 0.02, "actions": ["drop", "500", "500"]}) as (client, [p], d):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert resp.status == 502
        error = (await resp.json())["error"]
        assert error["code"] == 502 and error["type"] == "upstream_error" and "3 attempts" in error["message"]
        assert [leg.params["attempt"] for leg in p.legs] == [0, 1, 2]
        await wait_for(lambda: all(leg.disconnected for leg in d.legs) and len(d.legs) == 3)
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpush_router_requests_total{mode="push",outcome="failed"} 1.0' in metrics
        assert 'kvpush_router_failures_total{cause="prefill_connect",mode="push"} 1.0' in metrics


@run_async
async def test_hanging_prefill_hits_the_request_timeout():
    async with router_stack(request_timeout_s=0.5, prefill={"actions": ["hang"]}) as (client, [p], d):
        started = time.monotonic()
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert time.monotonic() - started < 2.0
        assert resp.status == 504 and (await resp.json())["error"]["code"] == 504
        await wait_for(lambda: p.legs[0].disconnected and d.legs[0].disconnected)


@run_async
async def test_hung_prefill_attempt_is_retried_under_prefill_timeout():
    async with router_stack(prefill_timeout_s=0.2, prefill={"actions": ["hang"]}) as (client, [p], d):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert resp.status == 200
        assert [leg.params["attempt"] for leg in p.legs] == [0, 1]


@run_async
async def test_stream_that_stalls_ends_with_an_sse_error():
    async with router_stack(request_timeout_s=0.6, decode={"actions": ["stall"]}) as (client, [p], d):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        assert resp.status == 200
        raw = await resp.read()
        assert raw.startswith(SSE[0]) and raw.endswith(b"\n\ndata: [DONE]\n\n")
        error = json.loads(raw[len(SSE[0]):].split(b"\n\n")[0].removeprefix(b"data: "))
        assert error["error"]["code"] == 504
        await wait_for(lambda: d.legs[0].disconnected)


@run_async
async def test_client_errors_pass_through_without_retry():
    async with router_stack(prefill={"actions": ["400"]}) as (client, [p], d):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert resp.status == 400
        assert await resp.json() == {"error": {"message": "bad prompt", "code": 400}}
        assert len(p.legs) == 1
    async with router_stack(decode={"actions": ["400"]}) as (client, [p], d):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert resp.status == 400 and len(d.legs) == 1
    async with router_stack() as (client, _, _):
        resp = await client.post("/v1/completions", data=b"[1, 2")
        assert resp.status == 400 and (await resp.json())["error"]["type"] == "invalid_request_error"


@run_async
async def test_decode_failure_returns_its_error_and_drops_prefill():
    async with router_stack(prefill={"actions": ["hang"]}, decode={"actions": ["500"]}) as (client, [p], d):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert resp.status == 500 and (await resp.json())["error"]["message"] == "engine died"
        assert len(p.legs) == 1
        await wait_for(lambda: p.legs[0].disconnected)


@run_async
async def test_client_that_hangs_up_ends_both_legs():
    async with router_stack(prefill={"delay": 5}) as (client, [p], d):
        with pytest.raises(asyncio.TimeoutError):
            await client.post("/v1/completions", json={"model": "m", "prompt": "x"}, timeout=ClientTimeout(total=0.3))
        await wait_for(lambda: p.legs[0].disconnected and d.legs[0].disconnected)
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpush_router_requests_total{mode="push",outcome="client_gone"} 1.0' in metrics


@run_async
async def test_prefills_are_used_round_robin():
    async with router_stack(prefills=2) as (client, ps, d):
        for _ in range(4):
            assert (await client.post("/v1/completions", json={"model": "m", "prompt": "x"})).status == 200
        assert [len(p.legs) for p in ps] == [2, 2]
        assert d.legs[0].params["producer"] == d.legs[1].params["producer"] == IDENTITY


# ---- health, metrics, start-up ----------------------------------------------------------------------

@run_async
async def test_health_follows_the_upstreams():
    async with router_stack(health_interval_s=0.05) as (client, [p], d):
        resp = await client.get("/health")
        assert resp.status == 200
        d.healthy = False
        await asyncio.sleep(0.3)
        resp = await client.get("/health")
        assert resp.status == 503
        failed = (await resp.json())["failed"]
        assert list(failed) == client.server.app[ROUTER_KEY].decode_urls
        assert "500" in next(iter(failed.values()))
        d.healthy = True
        await asyncio.sleep(0.2)
        assert (await client.get("/health")).status == 200


@run_async
async def test_metrics_count_requests_and_times():
    async with router_stack() as (client, [p], d):
        await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        text = await (await client.get("/metrics")).text()
        assert 'kvpush_router_requests_total{mode="push",outcome="ok"} 1.0' in text
        assert 'kvpush_router_ttft_seconds_count{mode="push"} 1.0' in text
        assert 'kvpush_router_prefill_seconds_count{mode="push"} 1.0' in text


@run_async
async def test_startup_fails_clearly_without_identity():
    with pytest.raises(StartupError, match="kvpush_identity"):
        async with router_stack(prefill={"identity": None}):
            pass


@run_async
async def test_startup_gives_up_on_a_prefill_that_never_comes_up():
    cfg = RouterConfig(mode="push", prefill_urls=("http://127.0.0.1:9",), decode_urls=("http://127.0.0.1:9",),
                       startup_timeout_s=0.3)
    with pytest.raises(StartupError, match="not healthy after"):
        async with TestServer(build_app(cfg), host="127.0.0.1"):
            pass


# ---- baselines ---------------------------------------------------------------------------------------

@run_async
async def test_nixl_pull_forwards_prefill_params_verbatim():
    answer = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 1, 4],
              "remote_engine_id": "e-1", "remote_host": "10.1.1.1", "remote_port": 5601, "tp_size": 1,
              "extra": {"nested": [None, 1.5]}}
    async with router_stack(mode="nixl-pull", prefill={"reply_params": answer, "delay": 0.05}) as (client, [p], d):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        assert await resp.read() == b"".join(SSE)
        [pl], [dl] = p.legs, d.legs
        assert pl.params == nixl_prefill_params() and pl.body["max_tokens"] == 1
        assert dl.params == answer
        assert dl.arrived >= pl.finished, "nixl-pull is sequential"
        assert not p.probes, "nixl-pull needs no start-up probe"


@run_async
async def test_nixl_push_legs_run_at_once_with_probed_coordinates():
    async with router_stack(mode="nixl-push", prefill={"delay": 0.2}) as (client, [p], d):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"},
                                 headers={"X-Request-Id": "rid-7"})
        assert resp.status == 200
        [pl], [dl] = p.legs, d.legs
        tid = pl.params["transfer_id"]
        assert pl.params == nixl_prefill_params(tid)
        assert dl.params == {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "nixl-p",
                             "remote_host": "10.0.0.8", "remote_port": 5700, "tp_size": 4,
                             "remote_request_id": "rid-7", "transfer_id": tid}
        assert dl.arrived < pl.finished - 0.1
        assert p.probes[0]["kv_transfer_params"] == nixl_prefill_params()


@run_async
async def test_single_forwards_unchanged_and_models_come_from_decode():
    async with router_stack(mode="single") as (client, [p], d):
        body = {"model": "m", "prompt": "x", "max_tokens": 7, "kv_transfer_params": {"keep": "me"}}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200 and await resp.json() == ANSWER
        assert d.legs[0].body == body and not p.legs
        models = await (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "tiny-decode"


@run_async
async def test_push_warm_up_pushes_once_per_pair_at_start_up():
    """Before serving, a tiny push through each (prefill, decode) pair: the decode instance handshakes
    with the prefill instance then, not on the first user request."""
    async with router_stack(warm_up=True) as (client, [p], d):
        [pl], [dl] = p.legs, d.legs
        assert pl.params["transfer_id"] == dl.params["transfer_id"] and pl.params["transfer_id"].startswith("warmup-")
        assert dl.params["producer"] == IDENTITY
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
        assert resp.status == 200 and len(p.legs) == len(d.legs) == 2


@run_async
async def test_kvpush_pull_sends_the_decode_leg_after_the_prefill_answered():
    """kvpush pull: D is picked and its leg sent only once P has answered (late destination choice);
    its params are the same kvpush decode params as in push."""
    async with router_stack(mode="pull", prefill={"delay": 0.2}) as (client, [p], d):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3})
        assert resp.status == 200 and await resp.json() == ANSWER
        [pl], [dl] = p.legs, d.legs
        assert dl.arrived >= pl.finished
        tid = pl.params["transfer_id"]
        assert pl.params == {"kvpush": "prefill", "transfer_id": tid, "attempt": 0}
        assert dl.params == {"kvpush": "decode", "transfer_id": tid, "attempt": 0, "producer": IDENTITY}
        assert p.probes[0]["kv_transfer_params"] == {"kvpush": "identity"}
