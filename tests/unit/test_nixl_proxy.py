"""The contract-only test proxy (common/testing/nixl_proxy.py) does what llm-d's sidecar does in NIXL push mode
when a prefill instance changes identity (`runNIXLProtocolV2PushParallel`): against fake P and D on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import functools

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvpush_common.testing.nixl_proxy import NixlProxy, make_app

ANSWER = {"choices": [{"text": "ok"}]}


def run_async(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 20))
    return wrapper


class Fake:
    def __init__(self, role: str):
        self.role, self.engine, self.legs, self.cancelled = role, "P-old", [], []
        self.bodies, self.request_ids = [], []
        self.decode_status = 200
        self.prefill_delay = 0.0

    async def generate(self, request):
        body = await request.json()
        kv = body["kv_transfer_params"]
        self.legs.append(kv)
        self.bodies.append(body)
        self.request_ids.append(request.headers.get("X-Request-Id"))
        try:
            if self.role == "prefill":
                await asyncio.sleep(self.prefill_delay)
                return web.json_response({**ANSWER, "kv_transfer_params": {
                    "transfer_mode": "push", "remote_engine_id": self.engine, "remote_host": "10.0.0.1",
                    "remote_port": 5700, "tp_size": 1, "remote_block_ids": [[1]], "do_remote_prefill": True}})
            if self.decode_status != 200:
                return web.json_response({"error": {"message": "Internal server error"}}, status=self.decode_status)
            return web.json_response(ANSWER)
        except asyncio.CancelledError:
            self.cancelled.append(kv)
            raise


@contextlib.asynccontextmanager
async def stack(mode="push", **kw):
    p, d = Fake("prefill"), Fake("decode")
    async with contextlib.AsyncExitStack() as s:
        urls = []
        for fake in (p, d):
            app = web.Application()
            app.router.add_post("/v1/completions", fake.generate)
            server = TestServer(app, host="127.0.0.1")
            await s.enter_async_context(server)
            urls.append(str(server.make_url("")).rstrip("/"))
        proxy = NixlProxy(urls[0], urls[1], mode, **kw)
        client = TestClient(TestServer(make_app(proxy), host="127.0.0.1"))
        await client.start_server()
        s.push_async_callback(client.close)
        yield client, proxy, p, d


async def ask(client):
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 4})
    return resp.status, resp.headers["X-Dispatch"], resp.headers["X-Transfer-Ids"]


@run_async
async def test_an_answer_with_another_identity_resends_the_decode_leg_from_it_under_the_same_transfer_id():
    async with stack() as (client, proxy, p, d):
        assert (await ask(client))[:2] == (200, "serial")  # learns P-old
        p.engine = "P-new"  # P restarted on the same address
        p.prefill_delay = 0.2
        status, dispatch, tid = await ask(client)
        assert (status, dispatch) == (200, "resent")
        first, again = d.legs[-2:]
        assert first["remote_engine_id"] == "P-old" and again["remote_engine_id"] == "P-new"
        assert first["transfer_id"] == again["transfer_id"] == tid and len(p.legs) == 2  # P is not asked again
        assert proxy.identities[proxy.prefill]["remote_engine_id"] == "P-new"
        assert (await ask(client))[:2] == (200, "parallel")


@run_async
async def test_a_decode_that_fails_before_the_prefill_answered_ends_the_request_and_forgets_the_identity():
    async with stack() as (client, proxy, p, d):
        await ask(client)
        p.prefill_delay, d.decode_status = 2.0, 500
        status, dispatch, _ = await ask(client)
        assert (status, dispatch) == (500, "parallel")  # D's error is the answer, as llm-d commits it
        await asyncio.sleep(0.1)
        assert len(p.cancelled) == 1 and proxy.prefill not in proxy.identities
        p.prefill_delay, d.decode_status = 0.0, 200
        assert (await ask(client))[:2] == (200, "serial")  # learns the identity again


COORDS = {"remote_engine_id": "prefill-0", "remote_host": "10.0.0.1", "remote_port": 5700, "tp_size": 1, "pp_size": 1}


@run_async
async def test_the_demo_push_proxy_sends_vllms_released_shape_and_mains():
    """vLLM's disagg_proxy_pushconnector_demo.py: both legs at once from the first request, one X-Request-Id, D's
    leg from the coordinates it was given; as released (0.34.0) no transfer_id, on main (1db62a2d) one on both."""
    for main in (False, True):
        async with stack("demo-push", coordinates=COORDS, demo_transfer_id=main) as (client, proxy, p, d):
            for _ in range(2):
                resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 4})
                assert resp.status == 200 and resp.headers["X-Dispatch"] == "demo"
            rid = resp.headers["X-Request-Id"]
            assert p.request_ids[-1] == d.request_ids[-1] == rid and len(set(d.request_ids)) == 2
            assert p.bodies[-1]["max_tokens"] == 1 and d.bodies[-1]["max_tokens"] == 4
            tid = {"transfer_id": resp.headers["X-Transfer-Ids"]} if main else {}
            assert p.legs[-1] == {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                  "remote_block_ids": None, "remote_host": None, "remote_port": None, **tid}
            assert d.legs[-1] == {"do_remote_decode": False, "do_remote_prefill": True, **COORDS,
                                  "remote_request_id": rid, **tid}
            assert not main or resp.headers["X-Transfer-Ids"].startswith("xfer-")
            assert len(p.legs) == len(d.legs) == 2 and not proxy.identities  # nothing learned: always parallel
