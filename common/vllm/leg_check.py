"""`vllm serve ... --middleware kvpush_common.vllm.leg_check.KVLegCheck`: bad kv_transfer_params get a 400.

vLLM gives a KV connector no hook that can refuse a request's kv_transfer_params with a client error: the
connector first sees them in the engine core (`get_num_new_matched_tokens`), where the cleanest way out is a
failed load (the connector does that: an error by `kv_load_failure_policy` fail, HTTP 500).  vLLM's API server
does take ASGI middleware (`--middleware`, `entrypoints/serve/middleware/register.py` in 0.32; the same option
in 0.29), which runs before the request reaches the engine.  This one reads the body of a completion or chat
request that mentions kv_transfer_params, checks them exactly as the connector will (`protocol.legs.read_leg`,
both contracts, against this instance's kv_role and mode from `app.state.vllm_config`), and answers 400 with
the reason in vLLM's error shape; nothing reaches the engine, so nothing is allocated on this instance.
Every other request passes through untouched (its body replayed as it came).
"""

from __future__ import annotations

import msgspec

from kvpush_common.protocol.legs import BadLeg, check_role, read_leg

CHECKED_PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_BODY_BYTES = 64 << 20  # a larger body is vLLM's to refuse


class _Body(msgspec.Struct):
    kv_transfer_params: dict | None = None


class KVLegCheck:
    """Pure ASGI middleware (vLLM adds a class with `app.add_middleware`)."""

    def __init__(self, app):
        self.app = app
        self._role_mode: tuple[str | None, str | None] | None = None

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in CHECKED_PATHS:
            await self.app(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let vLLM see it as it would
                await self.app(scope, _replay(b"".join(chunks), receive, message), send)
                return
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            more = message.get("more_body", False) and size <= MAX_BODY_BYTES
        body = b"".join(chunks)
        reason = self.reason(scope, body) if b"kv_transfer_params" in body and not more else None
        if reason is None:
            await self.app(scope, _replay(body, receive, None, more), send)
            return
        await _bad_request(send, reason)

    def reason(self, scope, body: bytes) -> str | None:
        """Why this body's kv_transfer_params cannot be served here, or None."""
        try:
            params = msgspec.json.decode(body, type=_Body).kv_transfer_params
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None  # not ours to judge: vLLM answers a body it cannot parse
        role, mode = self._instance(scope)
        leg = read_leg(params, None, mode)
        if role is not None:
            leg = check_role(leg, role)
        return leg.reason if isinstance(leg, BadLeg) else None

    def _instance(self, scope) -> tuple[str | None, str | None]:
        """This instance's kvpush role and mode, from the vLLM config the API server keeps (None: unknown)."""
        if self._role_mode is None:
            cfg = getattr(getattr(scope.get("app"), "state", None), "vllm_config", None)
            kt = getattr(cfg, "kv_transfer_config", None)
            if kt is None:
                return None, None
            role = {"kv_producer": "producer", "kv_consumer": "consumer"}.get(getattr(kt, "kv_role", None))
            mode = str((getattr(kt, "kv_connector_extra_config", None) or {}).get("mode", "push"))
            self._role_mode = (role, mode if mode in ("push", "pull") else None)
        return self._role_mode


def _replay(body: bytes, receive, last: dict | None, more: bool = False):
    """An ASGI receive that yields the body already read, then whatever comes next."""
    pending = [{"type": "http.request", "body": body, "more_body": more or last is not None}]
    if last is not None:
        pending.append(last)

    async def replay():
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


async def _bad_request(send, reason: str) -> None:
    payload = msgspec.json.encode({"error": {"message": f"kv_transfer_params: {reason}", "type": "BadRequestError",
                                             "param": "kv_transfer_params", "code": 400}})
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
