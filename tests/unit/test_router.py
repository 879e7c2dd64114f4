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

from kvpush_common.router.prefix_index import prompt_hashes
from kvpush_common.router.app import ROUTER_KEY, build_app
from kvpush_common.router.baselines import NixlProducer, nixl_prefill_params, nixl_push_decode_params
from kvpush_common.router.config import RouterConfig, StartupError
from kvpush_common.router.legs import decode_body, prefill_body, push_decode_params, push_prefill_params
from kvpush_common.router.upstreams import Health
from kvpush_common.protocol.legs import ProducerIdentity

IDENTITY = {"engine_id": "prefill-0", "host": "10.0.0.7", "port": 5600, "tp_size": 2}
NIXL_COORDS = {"remote_engine_id": "nixl-p", "remote_host": "10.0.0.8", "remote_port": 5700, "tp_size": 4,
               "remote_block_ids": None, "do_remote_prefill": True}
SSE = [b'data: {"choices":[{"text":"Hel"}]}\n\n', b'data: {"choices":[{"text":"lo \xc3\xa9"}]}\n\n',
       b'data: {"choices":[{"text":"!"}]}\n\ndata: [DONE]\n\n']
ANSWER = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "Hello!"}]}
# what vLLM 0.32 answers for a request that failed (finish_reason "error", e.g. kv_load_failure_policy=fail):
# GenerationError -> 500 with this body, or this as a stream's first event (after a chat stream's role preamble)
VLLM_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}
CHAT_PREAMBLE = b'data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'


def run_async(fn):
    """Each test owns its event loop and can never run past 20 s."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 20))
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
    # per leg, in order: ok, 500, 400, hang, drop, stall, local, error (vLLM's failed request, not a KV failure)
    actions: list[str] = field(default_factory=list)
    identity: dict | None = field(default_factory=lambda: dict(IDENTITY))
    reply_params: dict | None = None
    healthy: bool = True
    metrics: str = ""  # its /metrics page (vLLM gauges), when set
    legs: list[Leg] = field(default_factory=list)
    probes: list[dict] = field(default_factory=list)
    probe_status: int = 200  # what identity probes get (500: an instance that cannot say who it is)
    # decode: the prefill instances it can reach; a leg naming an engine id none of them has fails its KV
    # receive as a kvpush consumer does (handshake: "expected producer X, found Y") and is remembered
    prefills: list["FakeVllm"] = field(default_factory=list)
    failed_recvs: dict = field(default_factory=dict)  # decode: (transfer_id, attempt) -> producer engine id
    # how a failed completion stream ends: "event" (vLLM 0.30 on: an error event) or "none" (vLLM 0.29: its
    # error check comes after it skips empty chunks, so the stream is [DONE] alone)
    stream_errors: str = "event"

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.post("/v1/completions", self.generate), web.post("/v1/chat/completions", self.generate),
                        web.get("/health", self.health), web.get("/v1/models", self.models),
                        web.get("/metrics", self.prometheus)])
        return app

    async def prometheus(self, request):
        return web.Response(text=self.metrics, status=200 if self.metrics else 404)

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
        if self.role == "decode" and self._stale(leg):
            return await self._vllm_error(request, leg)
        if action == "error":
            return await self._vllm_error(request, leg)
        # "local": a decode that computes the prompt itself (short tail after its own prefix-cache hit)
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

    def _stale(self, leg: Leg) -> bool:
        producer = leg.params.get("producer")
        if not producer or not self.prefills or producer["engine_id"] in {p.identity["engine_id"] for p in self.prefills}:
            return False
        self.failed_recvs[(leg.params["transfer_id"], leg.params.get("attempt", 0))] = producer["engine_id"]
        return True

    async def _vllm_error(self, request, leg: Leg):
        if not leg.body.get("stream"):
            return web.json_response(VLLM_ERROR, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        if request.path.endswith("/chat/completions"):
            await response.write(CHAT_PREAMBLE)
            await asyncio.sleep(0.02)  # a separate read on the router's side
        elif self.stream_errors == "none":
            await response.write(b"data: [DONE]\n\n")
            return response
        await response.write(b"data: " + json.dumps(VLLM_ERROR).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    def _probe_answer(self, body):
        self.probes.append(body)
        if self.probe_status != 200:
            return web.json_response({"error": {"message": "busy"}}, status=self.probe_status)
        asked = body["kv_transfer_params"]
        if asked.get("kvpush") == "identity":
            params = {"kvpush_identity": self.identity} if self.identity else {"something_else": 1}
            if "transfer_id" in asked and self.role == "decode":  # what KVPushConnector's scheduler side answers
                key = (asked["transfer_id"], asked.get("attempt", 0))
                params["kvpush_recv"] = {"transfer_id": key[0], "attempt": key[1], "failed": key in self.failed_recvs,
                                         "producer_engine_id": self.failed_recvs.get(key)}
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
async def cluster_stack(mode: str = "push", prefills: int = 1, decodes: int = 1, **config):
    """Fake Ps and Ds, then the router in front of them; yields (client, [P...], [D...]).  `prefill` /
    `decode` overrides apply to the first of each."""
    done: set = set()
    fakes_p = [FakeVllm("prefill", done) for _ in range(prefills)]
    fakes_d = [FakeVllm("decode", done) for _ in range(decodes)]
    for fake, overrides in [(fakes_p[0], config.pop("prefill", {})), (fakes_d[0], config.pop("decode", {}))]:
        for key, value in overrides.items():
            setattr(fake, key, value)
    for i, fake in enumerate(fakes_p[1:], 1):  # each prefill instance its own engine id
        fake.identity = {**fake.identity, "engine_id": f"prefill-{i}"}
    for fake in fakes_d:
        fake.prefills = fakes_p
    servers = [TestServer(f.app(), host="127.0.0.1") for f in fakes_p + fakes_d]
    async with contextlib.AsyncExitStack() as stack:
        for server in servers:
            await stack.enter_async_context(server)
        urls = [str(s.make_url("")) for s in servers]
        config.setdefault("warm_up", False)  # the fakes count legs; warm-up has its own test
        cfg = RouterConfig(mode=mode, prefill_urls=tuple(urls[:prefills]), decode_urls=tuple(urls[prefills:]),
                           **config)
        client = TestClient(TestServer(build_app(cfg), host="127.0.0.1"))
        stack.push_async_callback(client.close)  # also when the router fails to start
        await client.start_server()
        yield client, fakes_p, fakes_d


@contextlib.asynccontextmanager
async def router_stack(mode: str = "push", prefills: int = 1, **config):
    """Fake P(s) and one D, then the router in front of them; yields (client, [P...], D)."""
    async with cluster_stack(mode, prefills, 1, **config) as (client, fakes_p, fakes_d):
        yield client, fakes_p, fakes_d[0]


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
                 "kv_transfer_params": {"kvpush": "prefill", "transfer_id": "t1", "attempt": 3,
                                        "do_remote_decode": True}}
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
                           "kv_transfer_params": {"kvpush": "prefill", "transfer_id": tid, "attempt": 0,
                                                  "consumer_tp": IDENTITY["tp_size"],  # D's, from its probe
                                                  "do_remote_decode": True}}
        assert dl.body == {**body, "kv_transfer_params": {"kvpush": "decode", "transfer_id": tid, "attempt": 0,
                                                          "producer": IDENTITY}}
        assert p.probes[0]["kv_transfer_params"] == {"kvpush": "identity", "do_remote_decode": True}
        assert p.probes[0]["model"] == "tiny-prefill"
        stamps = json.loads(resp.headers["x-kvpush-timeline"])
        # D's first byte is read as it comes, so it may be stamped just before P's answer is looked at
        assert stamps["dispatched"] <= min(stamps["prefill_done"], stamps["first_byte"]) <= stamps["done"]
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
@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_that_answers_first_cancels_the_prefill_leg(stream):
    """Issue 14 item 2: D computed the prompt from its own prefix cache and answered while P still runs: the
    router relays D at once, closes P's leg (vLLM aborts it and frees its blocks) and says so in the timeline."""
    async with router_stack(prefill={"actions": ["hang"]}, decode={"actions": ["local"]}) as (client, [p], d):
        t0 = time.monotonic()
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "turn 2", "max_tokens": 5,
                                                          "stream": stream})
        assert resp.status == 200
        assert (await resp.read() == b"".join(SSE)) if stream else (await resp.json() == ANSWER)
        assert time.monotonic() - t0 < 5
        await wait_for(lambda: p.legs[0].disconnected)
        [timeline] = await (await client.get("/timelines")).json()
        assert timeline["outcome"] == "ok" and timeline["first_byte"] <= timeline["prefill_cancelled"]
        assert "prefill_done" not in timeline
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpush_router_prefill_cancelled_total{mode="push"} 1.0' in metrics


@run_async
async def test_exhausted_retries_give_a_clear_502():
    async with router_stack(retries=2, prefill={"delay": 0.02, "actions": ["500", "500", "500"]}) as (client, [p], d):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert resp.status == 502
        error = (await resp.json())["error"]
        assert error["code"] == 502 and error["type"] == "upstream_error" and "3 attempts" in error["message"]
        assert [leg.params["attempt"] for leg in p.legs] == [0, 1, 2]
        await wait_for(lambda: all(leg.disconnected for leg in d.legs) and len(d.legs) == 3)
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpush_router_requests_total{mode="push",outcome="failed"} 1.0' in metrics
        assert 'kvpush_router_failures_total{cause="prefill_status",mode="push"} 3.0' in metrics


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
        served_by = {leg.params["transfer_id"]: p.identity for p in ps for leg in p.legs}
        assert all(leg.params["producer"] == served_by[leg.params["transfer_id"]] for leg in d.legs)
        assert ps[0].identity == IDENTITY


# ---- routing across several instances (issue 14 item 3) --------------------------------------------

def conversation(i: int, turns: int) -> str:
    """A chat history as one completion prompt: turn n+1 extends turn n (each turn > 2 chunks)."""
    return "".join(f"[conversation {i}, turn {t}] " + f"line {t} of {i}; " * 60 for t in range(turns))


@run_async
async def test_kv_aware_sends_each_follow_up_to_the_decode_holding_its_history():
    # skipping the prefill leg off (the default): every turn has both legs; where each goes is the policy's alone
    async with cluster_stack(prefills=2, decodes=2) as (client, ps, ds):
        for i in range(4):  # first turns: no history anywhere, spread by rotation
            assert (await client.post("/v1/completions", json={"model": "m", "prompt": conversation(i, 1)})).status == 200
        first = {leg.body["prompt"]: k for k, d in enumerate(ds) for leg in d.legs}
        assert sorted(len(d.legs) for d in ds) == [2, 2]
        for i in (2, 0, 3, 1):
            assert (await client.post("/v1/completions", json={"model": "m", "prompt": conversation(i, 2)})).status == 200
        for k, d in enumerate(ds):
            for leg in d.legs[2:]:
                history = leg.body["prompt"][:len(conversation(0, 1)) - 3]
                assert any(p.startswith(history) and first[p] == k for p in first), "turn 2 left its history"
        timelines = await (await client.get("/timelines")).json()
        why = timelines[-1]["route"]["decode_why"]
        assert why["policy"] == "kv-aware" and why["matched_chunks"] >= 2 and why["chunks"] > why["matched_chunks"]
        assert set(timelines[-1]["route"]) == {"prefill", "decode", "prefill_why", "decode_why"}


@run_async
async def test_a_follow_up_with_a_short_new_tail_goes_to_its_decode_alone():
    """D probably holds all of turn 2 but its new ~225 tokens (<= the limit): no prefill leg at all, D gets the
    client's body with no kv_transfer_params (a client's own are dropped) and computes the tail itself; a
    longer tail (limit 100) keeps both legs."""
    for limit, skipped in ((256, True), (100, False)):
        async with cluster_stack(prefills=2, decodes=2, skip_prefill_max_tokens=limit) as (client, ps, ds):
            for i in range(2):
                assert (await client.post("/v1/completions", json={"model": "m", "prompt": conversation(i, 1)})).status == 200
            assert sum(len(p.legs) for p in ps) == 2
            body = {"model": "m", "prompt": conversation(0, 2), "kv_transfer_params": {"from": "client"}}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status == 200 and await resp.json() == ANSWER
            timeline = (await (await client.get("/timelines")).json())[-1]
            route = timeline["route"]
            metrics = await (await client.get("/metrics")).text()
            if skipped:
                assert sum(len(p.legs) for p in ps) == 2  # no prefill leg for turn 2
                [leg] = [leg for d in ds for leg in d.legs if leg.body["prompt"] == conversation(0, 2)]
                assert "kv_transfer_params" not in leg.body
                assert route["prefill"] is None and 0 < route["prefill_skipped"]["uncached_tokens_est"] <= limit
                assert "prefill_skipped" in timeline and route["decode_why"]["matched_chunks"] >= 2
                assert 'kvpush_router_prefill_skipped_total{mode="push"} 1.0' in metrics
            else:
                assert sum(len(p.legs) for p in ps) == 3 and "prefill_skipped" not in route
                assert 'kvpush_router_prefill_skipped_total{mode="push"}' not in metrics


@run_async
async def test_a_failed_decode_only_request_moves_to_another_decode_with_both_legs():
    async with cluster_stack(prefills=1, decodes=2, skip_prefill_max_tokens=256) as (client, ps, ds):
        assert (await client.post("/v1/completions", json={"model": "m", "prompt": conversation(3, 1)})).status == 200
        holder = next(d for d in ds if d.legs)
        holder.actions = ["500"]
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": conversation(3, 2)})
        assert resp.status == 200 and await resp.json() == ANSWER
        other = next(d for d in ds if d is not holder)
        assert "kv_transfer_params" not in holder.legs[-1].body  # attempt 0: decode alone
        assert [leg.params["attempt"] for leg in other.legs] == [1] and len(ps[0].legs) == 2  # attempt 1: both legs
        timeline = (await (await client.get("/timelines")).json())[-1]
        assert timeline["attempt"] == 1 and "prefill_skipped" not in timeline["route"]


def test_the_router_estimates_what_a_decode_computes():
    from kvpush_common.router.prefix_index import CHARS_PER_TOKEN, CHUNK_TOKENS, estimated_tokens, uncached_tokens

    assert estimated_tokens({"prompt": "x" * 1000}, False) == 1000 // CHARS_PER_TOKEN
    assert estimated_tokens({"prompt": ["é" * 10]}, False) == 20 // CHARS_PER_TOKEN  # UTF-8 bytes
    assert estimated_tokens({"prompt": list(range(300))}, False) == 300
    assert estimated_tokens({"messages": [{"role": "user", "content": "q" * 400}]}, True) > 400 // CHARS_PER_TOKEN
    assert estimated_tokens({"prompt": ["a", "b"]}, False) is None and estimated_tokens({"messages": 3}, True) is None
    assert uncached_tokens(300, 2) == 300 - 2 * CHUNK_TOKENS and uncached_tokens(100, 5) == 0
    assert uncached_tokens(None, 2) is None


@run_async
async def test_round_robin_stays_available():
    async with cluster_stack(decodes=2, policy="round-robin") as (client, ps, ds):
        for _ in range(2):
            for i in range(2):
                assert (await client.post("/v1/completions", json={"model": "m", "prompt": conversation(i, 1)})).status == 200
        assert [len(d.legs) for d in ds] == [2, 2]
        assert [leg.body["prompt"] for leg in ds[0].legs] == [conversation(0, 1)] * 2  # it alternates blindly
        assert (await (await client.get("/timelines")).json())[-1]["route"]["decode_why"] == {"policy": "round-robin"}


@run_async
async def test_a_busy_or_full_decode_loses_to_an_idle_one_and_load_comes_from_metrics():
    queue = 'vllm:num_requests_waiting{engine="0",model_name="m"} 9.0\nvllm:kv_cache_usage_perc{engine="0"} 0.2\n'
    async with cluster_stack(decodes=2, health_interval_s=0.05, decode={"metrics": queue}) as (client, ps, ds):
        router = client.server.app[ROUTER_KEY]
        await wait_for(lambda: router.d_instances[router.decode_urls[0]].waiting == 9.0)
        prompt = conversation(7, 1)
        # D0 holds the prompt, but 9 requests wait there
        router.d_instances[router.decode_urls[0]].index.record(prompt_hashes({"prompt": prompt}, False))
        for _ in range(3):
            assert (await client.post("/v1/completions", json={"model": "m", "prompt": prompt})).status == 200
        assert [len(d.legs) for d in ds] == [0, 3]


@run_async
async def test_a_decode_instance_waiting_counts_only_requests_that_are_not_this_routers():
    """A push-mode decode instance lists a request waiting for its KV as waiting: this router's own are
    counted once (in flight), so a conversation's next turn is not sent away from its history for them."""
    page = 'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
    async with cluster_stack(decodes=1, health_interval_s=30, decode={"metrics": page},
                             prefill={"metrics": page}) as (client, ps, ds):
        router = client.server.app[ROUTER_KEY]
        d, p = router.d_instances[router.decode_urls[0]], router.p_instances[router.prefills[0].url]
        d.enter(); d.enter(); p.enter()  # two decode legs and one prefill leg of ours in flight
        await router.upstreams.scrape_load(d.url)
        await router.upstreams.scrape_load(p.url)
        assert (d.waiting, p.waiting) == (1.0, 3.0)  # a prefill's queue is a real queue: kept whole
        d.leave(); d.leave()
        d.enter()  # ours finished, another sent: the page may still count it
        await router.upstreams.scrape_load(d.url)
        assert d.waiting == 2.0


@run_async
async def test_an_unhealthy_decode_is_skipped():
    async with cluster_stack(decodes=2, health_interval_s=0.05) as (client, ps, ds):
        ds[0].healthy = False
        await asyncio.sleep(0.4)  # three intervals without a good check
        for i in range(4):
            assert (await client.post("/v1/completions", json={"model": "m", "prompt": conversation(i, 1)})).status == 200
        assert [len(d.legs) for d in ds] == [0, 4]


@run_async
@pytest.mark.parametrize("failure", ["500", "drop"])
async def test_a_decode_failure_before_any_byte_migrates_to_another_decode(failure):
    """The decode instance dies (or errs) before the client saw a byte: the request moves to the other decode
    instance with the next attempt (a new prefill leg too), within the same request."""
    async with cluster_stack(decodes=2, decode={"actions": [failure]}, prefill={"delay": 0.05}) as (client, ps, ds):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": conversation(1, 1)})
        assert resp.status == 200 and await resp.json() == ANSWER
        assert [leg.params["attempt"] for leg in ds[0].legs] == [0]
        assert [leg.params["attempt"] for leg in ds[1].legs] == [1]
        assert [leg.params["attempt"] for leg in ps[0].legs] == [0, 1]
        [timeline] = await (await client.get("/timelines")).json()
        assert timeline["attempt"] == 1 and timeline["migrated_from"] == [client.server.app[ROUTER_KEY].decode_urls[0]]
        assert timeline["route"]["decode"] == client.server.app[ROUTER_KEY].decode_urls[1]
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpush_router_migrations_total{mode="push"} 1.0' in metrics


@run_async
async def test_a_decode_failure_after_the_stream_started_is_not_migrated():
    async with cluster_stack(decodes=2, decode={"actions": ["stall"]}, request_timeout_s=1.0) as (client, ps, ds):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        body = await resp.read()
        assert resp.status == 200 and body.startswith(SSE[0]) and b"error" in body  # bytes were out: no retry
        assert len(ds[1].legs) == 0


def test_prefix_hashes_chain_whole_chunks_of_text_tokens_and_chat():
    from kvpush_common.router.prefix_index import CHUNK_CHARS, CHUNK_TOKENS, PrefixIndex

    a = prompt_hashes({"prompt": "x" * (3 * CHUNK_CHARS + 5)}, False)
    b = prompt_hashes({"prompt": "x" * (2 * CHUNK_CHARS) + "y" * CHUNK_CHARS}, False)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]  # a hash covers every chunk before it
    assert prompt_hashes({"prompt": "short"}, False) == []
    ids = prompt_hashes({"prompt": list(range(2 * CHUNK_TOKENS + 3))}, False)
    assert len(ids) == 2 and prompt_hashes({"prompt": [list(range(2 * CHUNK_TOKENS))]}, False) == ids
    turn1 = [{"role": "user", "content": "q" * CHUNK_CHARS * 2}]
    turn2 = turn1 + [{"content": "answer", "role": "assistant"}, {"role": "user", "content": "more"}]
    h1, h2 = prompt_hashes({"messages": turn1}, True), prompt_hashes({"messages": turn2}, True)
    assert len(h1) >= 2 and h2[:len(h1)] == h1
    assert prompt_hashes({"prompt": ["a", "b"]}, False) == [] and prompt_hashes({"messages": "x"}, True) == []
    index = PrefixIndex(capacity=3)
    index.record(a)
    assert index.matched(b) == 2 and index.matched(a) == 3
    index.record(prompt_hashes({"prompt": "z" * CHUNK_CHARS}, False))
    assert index.matched(a) == 0 and len(index) == 3  # the least recently sent went first


def test_vllm_load_is_read_from_its_metrics_page():
    from kvpush_common.router.load import parse_vllm_load

    page = ("# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0"} 3.0\nvllm:num_requests_running{engine="1"} 2.0\n'
            "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.5\n"
            "# TYPE other gauge\nother 7\n")
    assert parse_vllm_load(page) == {"running": 5.0, "kv_usage": 0.5}
    assert parse_vllm_load("") == {}


def test_policy_choice_trades_cached_prefix_against_load():
    from kvpush_common.router.policy import Instance, KVAware

    hashes = [bytes([i]) * 8 for i in range(10)]
    warm, cold = Instance("http://warm"), Instance("http://cold")
    warm.index.record(hashes[:6])
    policy = KVAware(in_flight_weight=2.0, waiting_weight=8.0)
    assert policy.choose([cold, warm], hashes).instance is warm  # 4 chunks to compute vs 10
    warm.in_flight = 4  # 4 + 8 > 10
    assert policy.choose([cold, warm], hashes).instance is cold
    warm.in_flight, warm.waiting = 0, 1.0  # 4 + 8 > 10
    assert policy.choose([cold, warm], hashes).instance is cold
    warm.in_flight, warm.kv_usage = 0, 0.99  # nearly full: its cache is about to be evicted anyway
    assert policy.choose([cold, warm], hashes).instance is cold


# ---- health, metrics, start-up ----------------------------------------------------------------------

def test_one_late_health_probe_keeps_an_instance_two_take_it_out():
    """A busy instance on a starved host answers one probe late: it keeps its requests (and the prefix it
    holds); a second timeout in a row, a refusal or an error status takes it out; an answer brings it back."""
    h = Health()
    assert not h.ok(0.0, 10.0)  # never answered
    h.record(1.0, None, False)
    assert h.ok(1.0, 10.0)
    h.record(2.0, "/health timed out", True)
    assert h.ok(2.0, 10.0) and h.error == "/health timed out"
    h.record(3.0, "/health timed out", True)
    assert not h.ok(3.0, 10.0)
    h.record(4.0, None, False)
    assert h.ok(4.0, 10.0)
    h.record(5.0, "/health answered 500", False)
    assert not h.ok(5.0, 10.0)
    h.record(6.0, None, False)
    assert h.ok(6.0, 10.0) and not h.ok(16.5, 10.0)  # no round finished for longer than stale_after: stalled


@run_async
async def test_health_follows_the_upstreams():
    async with router_stack(health_interval_s=0.05) as (client, [p], d):
        resp = await client.get("/health")
        assert resp.status == 200
        d.healthy = False
        resp = await health_until(client, 503)
        failed = (await resp.json())["failed"]
        assert list(failed) == client.server.app[ROUTER_KEY].decode_urls
        assert "500" in next(iter(failed.values()))
        d.healthy = True
        await health_until(client, 200)


async def health_until(client, status: int, limit: float = 5.0):
    """The router's /health once it answers `status` (its probes run every 0.05 s; a loaded machine is late)."""
    end = time.monotonic() + limit
    while True:
        resp = await client.get("/health")
        if resp.status == status or time.monotonic() > end:
            assert resp.status == status
            return resp
        await asyncio.sleep(0.05)


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
        assert pl.params == {"kvpush": "prefill", "transfer_id": tid, "attempt": 0, "consumer_tp": IDENTITY["tp_size"],
                             "do_remote_decode": True}
        assert dl.params == {"kvpush": "decode", "transfer_id": tid, "attempt": 0, "producer": IDENTITY}
        assert d.probes[0]["kv_transfer_params"] == {"kvpush": "identity", "do_remote_decode": True}  # D's TP, once
        assert p.probes[0]["kv_transfer_params"] == {"kvpush": "identity", "do_remote_decode": True}


@run_async
async def test_a_decode_that_does_not_report_its_tp_size_still_serves_without_it():
    """D's TP size is an optimisation (P ranks no D rank reads from release at once): a D that answers
    the probe without an identity is served, and the prefill leg carries no consumer_tp."""
    async with router_stack(decode={"identity": None}) as (client, [p], d):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3})
        assert resp.status == 200 and await resp.json() == ANSWER
        [pl] = p.legs
        assert "consumer_tp" not in pl.params and d.probes


def test_prefill_leg_carries_a_bounded_consumer_tp():
    from kvpush_common.protocol.legs import PrefillLeg, parse_leg

    assert parse_leg({"kvpush": "prefill", "transfer_id": "t", "consumer_tp": 4}) == PrefillLeg("t", 0, 4)
    assert parse_leg({"kvpush": "prefill", "transfer_id": "t"}).consumer_tp is None
    assert parse_leg({"kvpush": "prefill", "transfer_id": "t", "consumer_tp": 0}) is None  # malformed: logged


@run_async
async def test_parallel_sampling_prefills_one_sequence_and_decodes_n():
    async with router_stack() as (client, [p], d):
        body = {"model": "m", "prompt": "hi", "max_tokens": 3, "n": 2, "best_of": 2, "temperature": 0.8, "seed": 7}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200
        [pl], [dl] = p.legs, d.legs
        assert pl.body["n"] == 1 and "best_of" not in pl.body and pl.body["seed"] == 7
        assert dl.body["n"] == 2 and dl.body["best_of"] == 2


# ---- restarts: identities probed again, failed receives retried, one instance alone (issue 31) -------

def restart(fake: FakeVllm, engine_id: str) -> None:
    """What a prefill instance killed and started again on the same port looks like: another engine id."""
    fake.identity = {**fake.identity, "engine_id": engine_id}


@run_async
async def test_the_health_loop_learns_a_restarted_prefills_new_identity():
    async with router_stack(health_interval_s=0.05) as (client, [p], d):
        assert (await client.post("/v1/completions", json={"model": "m", "prompt": "x"})).status == 200
        restart(p, "prefill-0-new")
        router = client.server.app[ROUTER_KEY]
        await wait_for(lambda: router.prefills[0].producer.engine_id == "prefill-0-new")
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert resp.status == 200 and await resp.json() == ANSWER
        assert [leg.params["producer"]["engine_id"] for leg in d.legs] == ["prefill-0", "prefill-0-new"]
        assert [leg.params["attempt"] for leg in d.legs] == [0, 0] and not d.failed_recvs
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpush_router_identity_changes_total{mode="push"} 1.0' in metrics


@run_async
@pytest.mark.parametrize("path,stream", [("/v1/completions", False), ("/v1/completions", True),
                                         ("/v1/chat/completions", True)])
async def test_a_decode_leg_that_failed_for_a_stale_identity_is_retried_with_the_new_one(path, stream):
    """The prefill restarted between two health rounds: D's receive fails (the old engine id is gone) and vLLM
    answers that like any failed request.  The router asks D, learns it was the KV, probes P again and retries
    on the same decode instance with the new identity, within the same request; the client sees one answer."""
    async with router_stack(health_interval_s=60) as (client, [p], d):
        restart(p, "prefill-0-new")
        body = {"model": "m", "prompt": "x", "stream": stream}
        if path.endswith("chat/completions"):
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": stream}
        resp = await client.post(path, json=body)
        assert resp.status == 200
        assert (await resp.read() == b"".join(SSE)) if stream else (await resp.json() == ANSWER)
        assert [leg.params["attempt"] for leg in d.legs] == [0, 1]
        assert [leg.params["producer"]["engine_id"] for leg in d.legs] == ["prefill-0", "prefill-0-new"]
        tid = d.legs[0].params["transfer_id"]
        assert d.failed_recvs == {(tid, 0): "prefill-0"}
        asked = [pr["kv_transfer_params"] for pr in d.probes if "transfer_id" in pr["kv_transfer_params"]]
        assert asked == [{"kvpush": "identity", "transfer_id": tid, "attempt": 0, "do_remote_decode": True}]
        [timeline] = await (await client.get("/timelines")).json()
        assert timeline["outcome"] == "ok" and timeline["attempt"] == 1 and "migrated_from" not in timeline
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpush_router_failures_total{cause="decode_stale_producer",mode="push"} 1.0' in metrics
        assert 'kvpush_router_identity_changes_total{mode="push"} 1.0' in metrics


@run_async
async def test_a_failed_receive_that_vllm_029_streams_as_an_empty_completion_is_retried():
    """vLLM 0.29 (the Neuron plugin's) ends a completion stream whose KV load failed with [DONE] alone, no error
    event: the router asks D as for an error, learns it was the KV and retries; the client gets every token."""
    async with router_stack(health_interval_s=60, decode={"stream_errors": "none"}) as (client, [p], d):
        restart(p, "prefill-0-new")
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        assert resp.status == 200 and await resp.read() == b"".join(SSE)
        assert [leg.params["attempt"] for leg in d.legs] == [0, 1]
        assert [leg.params["producer"]["engine_id"] for leg in d.legs] == ["prefill-0", "prefill-0-new"]
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpush_router_failures_total{cause="decode_stale_producer",mode="push"} 1.0' in metrics


@run_async
async def test_an_empty_stream_that_was_not_a_failed_receive_passes_through_as_vllm_sent_it():
    """D's stream ended with no output and its RecvReport says the KV arrived: the stream is D's answer, relayed
    as it came and not retried (with two decode instances, not migrated either)."""
    async with cluster_stack(decodes=2) as (client, [p], ds):
        for d in ds:
            d.actions, d.stream_errors = ["error"], "none"
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        assert resp.status == 200 and await resp.read() == b"data: [DONE]\n\n"
        assert len(ds[0].legs) + len(ds[1].legs) == 1 and not ds[0].failed_recvs


@run_async
@pytest.mark.parametrize("stream", [False, True])
async def test_a_model_error_on_the_only_decode_passes_through_as_vllm_sent_it(stream):
    """D failed the request but not for its KV (its RecvReport says so): nothing to retry with one decode
    instance, and the client gets D's own answer, byte for byte."""
    async with router_stack(decode={"actions": ["error"]}) as (client, [p], d):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": stream})
        if stream:
            assert resp.status == 200
            assert await resp.read() == b"data: " + json.dumps(VLLM_ERROR).encode() + b"\n\ndata: [DONE]\n\n"
        else:
            assert resp.status == 500 and await resp.json() == VLLM_ERROR
        assert len(d.legs) == 1 and not d.failed_recvs
        assert [pr["kv_transfer_params"].get("transfer_id") for pr in d.probes][-1] == d.legs[0].params["transfer_id"]


@run_async
async def test_a_failed_receive_from_a_prefill_that_cannot_answer_moves_to_another_prefill():
    """D's receive failed and P no longer answers its identity probe (dead, or wedged): the retry avoids it."""
    async with router_stack(prefills=2, health_interval_s=60, policy="round-robin") as (client, ps, d):
        restart(ps[0], "prefill-0-gone")  # D can no longer reach what the router knows as prefill-0 ...
        ps[0].probe_status = 500  # ... and P0 cannot say who it is
        for _ in range(2):  # round-robin: one of the two requests starts on P0
            resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert resp.status == 200 and await resp.json() == ANSWER
        failed = [leg for leg in d.legs if leg.params["producer"]["engine_id"] == "prefill-0"]
        assert len(failed) == 1 and failed[0].params["attempt"] == 0
        retried = next(leg for leg in d.legs if leg.params["transfer_id"] == failed[0].params["transfer_id"]
                       and leg.params["attempt"] == 1)
        assert retried.params["producer"] == ps[1].identity
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpush_router_failures_total{cause="decode_dead_producer",mode="push"} 1.0' in metrics


@run_async
async def test_with_no_usable_prefill_the_decode_computes_the_prompt_alone():
    """The only prefill instance refuses (killed) mid-request, and then its /health fails: that request and the
    next are computed by the decode instance alone (no kv_transfer_params), and both are answered."""
    async with router_stack(health_interval_s=0.05, prefill={"actions": ["drop"]}) as (client, [p], d):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert resp.status == 200 and await resp.json() == ANSWER
        assert [leg.params.get("kvpush") for leg in d.legs] == ["decode", None]
        p.healthy = False
        await asyncio.sleep(0.3)
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "y", "kv_transfer_params": {"a": 1}})
        assert resp.status == 200 and len(p.legs) == 1 and d.legs[-1].body == {"model": "m", "prompt": "y"}
        timelines = await (await client.get("/timelines")).json()
        assert [t["route"].get("fallback") for t in timelines] == ["no_prefill", "no_prefill"]
        assert timelines[0]["attempt"] == 1
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpush_router_fallbacks_total{kind="no_prefill",mode="push"} 2.0' in metrics


@run_async
async def test_with_no_usable_decode_a_prefill_serves_the_request_alone():
    """The only decode instance is killed before its first byte: the request is served by the prefill instance
    as a single instance (the client's body unchanged), and so is the next while D's /health fails."""
    async with router_stack(health_interval_s=0.05, decode={"actions": ["drop"]}) as (client, [p], d):
        body = {"model": "m", "prompt": "x", "max_tokens": 9}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200 and (await resp.json())["choices"] == ANSWER["choices"]
        assert p.legs[-1].body == body and len(d.legs) == 1
        d.healthy = False
        await asyncio.sleep(0.3)
        assert (await client.post("/v1/completions", json=body)).status == 200 and len(d.legs) == 1
        timelines = await (await client.get("/timelines")).json()
        assert [t["route"]["fallback"] for t in timelines] == ["no_decode", "no_decode"]
        assert [t["route"]["decode"] for t in timelines] == [None, None]


@run_async
async def test_a_prefill_seen_down_gets_requests_again_only_once_its_new_identity_is_known():
    async with router_stack(prefills=2, health_interval_s=0.05, policy="round-robin") as (client, ps, d):
        router = client.server.app[ROUTER_KEY]
        ps[0].healthy = False
        await wait_for(lambda: not router.prefills[0].confirmed)
        restart(ps[0], "prefill-0-new")
        ps[0].probe_status = 500  # up again, but not yet able to say who it is
        ps[0].healthy = True
        await asyncio.sleep(0.3)
        for _ in range(3):
            assert (await client.post("/v1/completions", json={"model": "m", "prompt": "x"})).status == 200
        assert len(ps[0].legs) == 0 and len(ps[1].legs) == 3
        ps[0].probe_status = 200
        await wait_for(lambda: router.prefills[0].confirmed)
        for _ in range(2):
            assert (await client.post("/v1/completions", json={"model": "m", "prompt": "x"})).status == 200
        assert len(ps[0].legs) == 1 and d.legs[-2:][0].params["producer"]["engine_id"] in ("prefill-0-new", "prefill-1")
        assert not d.failed_recvs  # no request ever named the old identity


def test_a_chat_streams_role_preamble_is_looked_past_for_an_error():
    from kvpush_common.router.replies import failed_start

    def _is_error_stream(data: bytes) -> bool:
        return failed_start(data) == "error_event"

    error = b"data: " + json.dumps(VLLM_ERROR).encode() + b"\n\n"
    assert _is_error_stream(CHAT_PREAMBLE + error) and _is_error_stream(error + b"data: [DONE]\n\n")
    assert not _is_error_stream(CHAT_PREAMBLE + b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n')
    assert not _is_error_stream(SSE[0] + error)  # an error after a token: bytes were served
    assert not _is_error_stream(CHAT_PREAMBLE) and not _is_error_stream(b"data: [DONE]\n\n")


def test_a_stream_that_ends_before_any_output_is_told_apart():
    from kvpush_common.router.replies import failed_start

    def is_empty_stream(data: bytes) -> bool:
        return failed_start(data) == "empty_stream"

    assert is_empty_stream(b"data: [DONE]\n\n") and is_empty_stream(b"")
    assert is_empty_stream(CHAT_PREAMBLE + b"data: [DONE]\n\n")
    assert not is_empty_stream(SSE[0]) and not is_empty_stream(CHAT_PREAMBLE)  # a token; a stream still open
    assert not is_empty_stream(b"data: " + json.dumps(VLLM_ERROR).encode() + b"\n\ndata: [DONE]\n\n")
