"""The --middleware of vLLM's API server that answers bad kv_transfer_params with a 400 before the engine sees
them (common/vllm/leg_check.py), driven as Starlette drives an ASGI middleware: checked against this instance's
kv_role and mode from app.state.vllm_config; every other request's body reaches vLLM byte for byte."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from kvpush_common.vllm.leg_check import KVLegCheck

COORDS = {"remote_engine_id": "p", "remote_host": "10.0.0.7", "remote_port": 5700, "tp_size": 1}


def app_state(role="kv_consumer", mode="push"):
    kt = SimpleNamespace(kv_role=role, kv_connector_extra_config={"mode": mode})
    return SimpleNamespace(state=SimpleNamespace(vllm_config=SimpleNamespace(kv_transfer_config=kt)))


def call(body: bytes, path="/v1/completions", app=None, chunks=1):
    """Run the middleware once: (status, response body, what the inner app received or None)."""
    seen = {}

    async def inner(scope, receive, send):
        got = b""
        while True:
            m = await receive()
            got += m.get("body", b"")
            if not m.get("more_body"):
                break
        seen["body"] = got
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    parts = [body[i * len(body) // chunks:(i + 1) * len(body) // chunks] for i in range(chunks)]
    messages = [{"type": "http.request", "body": p, "more_body": i < chunks - 1} for i, p in enumerate(parts)]
    sent = []

    async def receive():
        return messages.pop(0)

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "method": "POST", "path": path, "app": app or app_state()}
    asyncio.run(KVLegCheck(inner)(scope, receive, send))
    status = sent[0]["status"]
    return status, b"".join(m.get("body", b"") for m in sent[1:]), seen.get("body")


def body(kv, **extra):
    return json.dumps({"model": "tiny", "prompt": "hi", **extra, "kv_transfer_params": kv}).encode()


@pytest.mark.parametrize("kv, match", [
    ({"do_remote_prefill": True, "remote_engine_id": "p"}, "remote_host, remote_port, tp_size"),
    ({**COORDS, "do_remote_prefill": True, "do_remote_decode": True}, "both true"),
    ({**COORDS, "do_remote_prefill": True, "transfer_mode": "pull"}, "'push' mode"),
    ({"do_remote_decode": True, "remote_host": None}, "reached a kv_consumer"),  # a prefill leg at D
    ({"kvpush": "decode", "transfer_id": "t"}, "malformed kvpush"),
])
def test_bad_params_get_a_400_in_vllms_error_shape_and_never_reach_vllm(kv, match):
    status, out, inner = call(body(kv), chunks=3)
    assert status == 400 and inner is None
    err = json.loads(out)["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["param"] == "kv_transfer_params"
    assert match in err["message"], err["message"]


def test_good_or_unrelated_bodies_pass_through_untouched():
    good = body({**COORDS, "do_remote_prefill": True, "transfer_id": "xfer-1"})
    for raw, path in ((good, "/v1/completions"), (good, "/v1/chat/completions"), (b"not json", "/v1/completions"),
                      (json.dumps({"prompt": "kv_transfer_params"}).encode(), "/v1/completions"),
                      (body({"do_remote_decode": True}), "/v1/embeddings"),  # not a path it checks
                      (body({"do_remote_decode": True}, n=1), "/v1/completions")):
        app = app_state("kv_producer") if b"do_remote_decode" in raw else app_state()
        status, out, inner = call(raw, path, app, chunks=2)
        assert (status, out, inner) == (200, b"ok", raw), (raw, path)


def test_role_and_mode_come_from_the_instance_and_are_skipped_when_unknown():
    leg = body({**COORDS, "do_remote_prefill": True, "transfer_mode": "pull"})
    assert call(leg, app=app_state(mode="pull"))[0] == 200
    assert call(leg, app=app_state(role="kv_producer", mode="pull"))[0] == 400  # a decode leg at P
    assert call(leg, app=SimpleNamespace())[0] == 200  # no vLLM config: only the shape is checked
    assert call(body({"do_remote_prefill": True}), app=SimpleNamespace())[0] == 400
