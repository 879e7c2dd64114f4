"""A disaggregation proxy written from vLLM's NIXL contract alone (test support): it knows nothing of kvpush.

What it sends is what vLLM's proxies and llm-d's decode sidecar send (read in vllm-project/vllm
`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py` and `toy_push_proxy_server.py`,
`examples/disaggregated/disaggregated_serving/disagg_proxy_pushconnector_demo.py`, and llm-d/llm-d-router
`pkg/sidecar/proxy/connector_nixlv2.go` and `nixl_push_identity.go`):

* pull (NixlConnector), serial: the prefill leg with `do_remote_decode`, `max_tokens` 1; then the decode leg
  with P's answer's `kv_transfer_params` as they came;
* push (NixlPushConnector), as the sidecar (`runNIXLProtocolV2PushParallel`, llm-d/llm-d-router
  `pkg/sidecar/proxy/connector_nixlv2.go`, the stored version with NIXLPushMode): while it knows no identity of
  the prefill instance, serial as above plus a fresh `transfer_id` on both legs; once an answer carried
  `transfer_mode: "push"` with `remote_engine_id`, `remote_host`, `remote_port`, `tp_size` (and `pp_size`,
  `dcp_size`), both legs at once, D's built from that identity plus `do_remote_prefill`, `remote_request_id` and
  the `transfer_id`.  D's answer reaches the client only after P answered 2xx with the same identity.  A decode
  leg that fails before P answered cancels P, and its error is the answer; a failed prefill cancels D and is
  retried serially with a new `transfer_id`; a prefill answer with another identity cancels D and sends the decode
  leg again, built from that answer, under the same `transfer_id`.  A failed parallel dispatch forgets the
  identity it used (`dropIfMatches`), so the next request is serial and learns it again;
* demo-push (NixlPushConnector), as vLLM's push demo `examples/disaggregated/disaggregated_serving/
  disagg_proxy_pushconnector_demo.py` sends it: both legs at once from the first request, D's built from P's
  coordinates given on the command line (`--prefill-engine-id`, `--prefill-kv-host`, `--prefill-side-channel-port`,
  `--prefill-tp-size`, `--prefill-pp-size`) plus `do_remote_prefill` and `remote_request_id` (the shared
  `X-Request-Id`); P's leg is the request with `max_tokens` 1 and `do_remote_decode`.  As released (vLLM 0.34.0
  sdist) neither leg carries a `transfer_id`: P and D pair the legs by the request id.  `--transfer-id` adds one
  fresh `transfer_id` per dispatch to both legs, as vLLM main's demo does (vllm-project/vllm 1db62a2d).

Both legs of a dispatch carry one `X-Request-Id`, also returned on the answer.  `X-Dispatch` says how an answer
was served: `serial`, `parallel`, `resent` (parallel, then D again with P's answer), `demo`; `X-Transfer-Ids` the
transfer ids it sent.  Test knobs (never in a real proxy): `prefill_delay_s` holds the prefill leg of a parallel
dispatch back (so D's registration arrives first), `first_prefill_timeout_s` gives up on the prefill leg of the
first parallel dispatch after that long (a retried leg).  Run: `python -m kvpush_common.testing.nixl_proxy --prefill URL --decode URL
--mode push|pull|demo-push --port N` (demo-push: plus P's coordinates, as the demo takes them).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import uuid

import aiohttp
from aiohttp import web

log = logging.getLogger("nixl_proxy")

IDENTITY_FIELDS = {"remote_engine_id": True, "remote_host": True, "remote_port": True, "tp_size": True,
                   "transfer_mode": True, "pp_size": False, "dcp_size": False}  # llm-d: required or not


class PrefillFailed(Exception):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"prefill answered {status}")
        self.status, self.body = status, body


def identity_of(kv: object) -> dict | None:
    """The push identity in a prefill answer's kv_transfer_params (llm-d's extractNIXLPushIdentity)."""
    if not isinstance(kv, dict) or kv.get("transfer_mode") != "push":
        return None
    out = {}
    for field, required in IDENTITY_FIELDS.items():
        if field not in kv and not required:
            continue
        if not isinstance(kv.get(field), (str, int, float)) or isinstance(kv.get(field), bool):
            return None
        out[field] = kv[field]
    return out


def prefill_body(body: dict, transfer_id: str | None) -> dict:
    kv = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
          "remote_host": None, "remote_port": None}
    if transfer_id is not None:
        kv["transfer_id"] = transfer_id
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    leg.update(kv_transfer_params=kv, stream=False, max_tokens=1)
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    return leg


def demo_legs(body: dict, coordinates: dict, request_id: str, transfer_id: str | None) -> tuple[dict, dict]:
    """vLLM's push demo's two legs (`PushProxy._push_completion`): P's, then D's."""
    prefill = dict(body, max_tokens=1)
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                     "remote_block_ids": None, "remote_host": None, "remote_port": None}
    decode = dict(body, kv_transfer_params={"do_remote_decode": False, "do_remote_prefill": True, **coordinates,
                                            "remote_request_id": request_id})
    if transfer_id is not None:  # vLLM main's demo only
        prefill["kv_transfer_params"]["transfer_id"] = decode["kv_transfer_params"]["transfer_id"] = transfer_id
    return prefill, decode


class NixlProxy:
    def __init__(self, prefill: str, decode: str, mode: str, *, retries: int = 1, prefill_delay_s: float = 0.0,
                 first_prefill_timeout_s: float | None = None, coordinates: dict | None = None,
                 demo_transfer_id: bool = False):
        self.prefill, self.decode, self.mode = prefill.rstrip("/"), decode.rstrip("/"), mode
        self.coordinates, self.demo_transfer_id = coordinates or {}, demo_transfer_id  # demo-push
        self.retries, self.prefill_delay_s, self.first_prefill_timeout_s = retries, prefill_delay_s, first_prefill_timeout_s
        self.identities: dict[str, dict] = {}  # prefill URL -> its push identity
        self.session: aiohttp.ClientSession | None = None
        self._first_prefill = True

    async def start(self, app) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))

    async def stop(self, app) -> None:
        await self.session.close()

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.mode == "demo-push":
            return await self._demo(request.path, body)
        rid = str(uuid.uuid4())
        tids: list[str] = []
        dispatch = "serial"
        last = None
        for _ in range(self.retries + 1):
            tid = f"xfer-{uuid.uuid4()}" if self.mode == "push" else None
            if tid:
                tids.append(tid)
            identity = self.identities.get(self.prefill) if self.mode == "push" and not last else None
            try:
                if identity is not None:
                    dispatch = "parallel"
                    status, raw, ctype, dispatch = await self._parallel(request.path, body, rid, tid, identity)
                else:
                    status, raw, ctype = await self._serial(request.path, body, rid, tid)
            except PrefillFailed as e:
                if identity is not None:
                    self._drop_if(identity)
                last = e
                if 400 <= e.status < 500:
                    break  # the request's own fault: passed through, never retried
                continue
            return self._answer(status, raw, ctype, dispatch, tids, rid)
        status = last.status if last and last.status else 502
        return self._answer(status, last.body if last else b"{}", "application/json", dispatch, tids, rid)

    @staticmethod
    def _answer(status, raw, ctype, dispatch, tids, rid) -> web.Response:
        return web.Response(status=status, body=raw, content_type=ctype.split(";")[0],
                            headers={"X-Dispatch": dispatch, "X-Transfer-Ids": ",".join(tids), "X-Request-Id": rid})

    async def _demo(self, path: str, body: dict) -> web.Response:
        """vLLM's push demo: P's leg started, D's answer awaited, then P's leg (its answer unread)."""
        rid = str(uuid.uuid4())
        tid = f"xfer-{uuid.uuid4()}" if self.demo_transfer_id else None
        prefill, decode = demo_legs(body, self.coordinates, rid, tid)

        async def drain_prefill():
            async with self.session.post(self.prefill + path, json=prefill, headers={"X-Request-Id": rid}) as resp:
                await resp.read()
                if resp.status >= 400:
                    log.error("prefill leg answered %d", resp.status)

        prefill_task = asyncio.create_task(drain_prefill())
        try:
            status, raw, ctype = await self._decode_leg(path, decode, rid, decode["kv_transfer_params"])
        finally:
            await asyncio.gather(prefill_task, return_exceptions=True)
        return self._answer(status, raw, ctype, "demo", [tid] if tid else [], rid)

    async def _prefill_leg(self, path: str, body: dict, rid: str, tid: str | None, timeout: float | None = None) -> dict:
        try:
            async with self.session.post(self.prefill + path, json=prefill_body(body, tid),
                                         headers={"X-Request-Id": rid},
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                raw = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise PrefillFailed(502, f'{{"error": "prefill: {type(e).__name__}"}}'.encode()) from e
        if resp.status != 200:
            raise PrefillFailed(resp.status, raw)
        answer = await asyncio.get_running_loop().run_in_executor(None, _json, raw)
        kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if self.mode == "push":
            identity = identity_of(kv)
            if identity is None:
                self.identities.pop(self.prefill, None)
            else:
                self.identities[self.prefill] = identity
        return kv if isinstance(kv, dict) else {}

    async def _decode_leg(self, path: str, body: dict, rid: str, kv: dict) -> tuple[int, bytes, str]:
        try:
            async with self.session.post(self.decode + path, json={**body, "kv_transfer_params": kv},
                                         headers={"X-Request-Id": rid}) as resp:
                return resp.status, await resp.read(), resp.headers.get("Content-Type", "application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return 502, f'{{"error": "decode: {type(e).__name__}"}}'.encode(), "application/json"

    def _drop_if(self, identity: dict) -> None:
        """A failed parallel dispatch may be a stale identity: forget it, unless a newer one replaced it."""
        if self.identities.get(self.prefill) == identity:
            del self.identities[self.prefill]

    async def _serial(self, path, body, rid, tid):
        kv = await self._prefill_leg(path, body, rid, tid)
        if tid is not None:  # P's answer carries no transfer_id of the proxy's (llm-d adds it)
            kv = {**kv, "transfer_id": tid}
        return await self._decode_leg(path, body, rid, kv)

    async def _parallel(self, path, body, rid, tid, identity):
        kv = {**identity, "do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": rid,
              "transfer_id": tid}
        decode = asyncio.create_task(self._decode_leg(path, body, rid, kv))
        prefill = asyncio.create_task(self._held_prefill(path, body, rid, tid))
        try:
            done, _ = await asyncio.wait({decode, prefill}, return_when=asyncio.FIRST_COMPLETED)
            if prefill not in done and decode.result()[0] >= 400:  # D failed first: cancel P, D's error answers
                prefill.cancel()
                await asyncio.gather(prefill, return_exceptions=True)
                self._drop_if(identity)
                return (*decode.result(), "parallel")
            answer = await prefill
        except BaseException:
            for task in (decode, prefill):  # closing D's connection makes vLLM abort it: no KV lands in freed blocks
                task.cancel()
            await asyncio.gather(decode, prefill, return_exceptions=True)
            raise
        if self.identities.get(self.prefill) != identity:  # P is another engine now: D was told the old one
            decode.cancel()
            await asyncio.gather(decode, return_exceptions=True)
            return (*await self._decode_leg(path, body, rid, {**answer, "transfer_id": tid}), "resent")
        status, raw, ctype = await decode
        if status >= 400:
            self._drop_if(identity)
        return status, raw, ctype, "parallel"

    async def _held_prefill(self, path, body, rid, tid) -> dict:
        if self.prefill_delay_s:
            await asyncio.sleep(self.prefill_delay_s)
        timeout = self.first_prefill_timeout_s if self._first_prefill else None
        self._first_prefill = False
        return await self._prefill_leg(path, body, rid, tid, timeout)


def _json(raw: bytes):
    import json

    try:
        return json.loads(raw)
    except ValueError:
        return None


def make_app(proxy: NixlProxy) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/completions", proxy.handle)
    app.router.add_post("/v1/chat/completions", proxy.handle)
    app.router.add_get("/health", lambda r: web.json_response({"ok": True}))
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefill", required=True)
    p.add_argument("--decode", required=True)
    p.add_argument("--mode", choices=("push", "pull", "demo-push"), required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--retries", type=int, default=1)
    p.add_argument("--prefill-delay-s", type=float, default=0.0)
    p.add_argument("--first-prefill-timeout-s", type=float, default=None)
    # demo-push: P's coordinates, under the demo's flag names, and vLLM main's transfer_id
    p.add_argument("--prefill-engine-id")
    p.add_argument("--prefill-kv-host")
    p.add_argument("--prefill-side-channel-port", type=int)
    p.add_argument("--prefill-tp-size", type=int, default=1)
    p.add_argument("--prefill-pp-size", type=int, default=1)
    p.add_argument("--transfer-id", action="store_true")
    a = p.parse_args(argv)
    coordinates = None
    if a.mode == "demo-push":
        if not (a.prefill_engine_id and a.prefill_kv_host and a.prefill_side_channel_port):
            p.error("demo-push needs --prefill-engine-id, --prefill-kv-host and --prefill-side-channel-port")
        coordinates = {"remote_engine_id": a.prefill_engine_id, "remote_host": a.prefill_kv_host,
                       "remote_port": a.prefill_side_channel_port, "tp_size": a.prefill_tp_size,
                       "pp_size": a.prefill_pp_size}
    logging.basicConfig(level=logging.INFO)
    proxy = NixlProxy(a.prefill, a.decode, a.mode, retries=a.retries, prefill_delay_s=a.prefill_delay_s,
                      first_prefill_timeout_s=a.first_prefill_timeout_s, coordinates=coordinates,
                      demo_transfer_id=a.transfer_id)
    web.run_app(make_app(proxy), host="127.0.0.1", port=a.port, print=None)


if __name__ == "__main__":
    main()
