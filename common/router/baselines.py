"""Benchmark-only modes, the references kvpush is measured against: vLLM's own connectors and one instance.

* `nixl-pull` (vLLM's NixlConnector): P, then D with P's answer's kv_transfer_params as they came;
* `nixl-push` (vLLM's NixlPushConnector): both legs at once under one X-Request-Id, D's with P's coordinates from a
  start-up probe (vLLM releases 0.32-0.34 pair the legs by that request id; the `transfer_id` sent beside it is
  what vLLM main's push demo sends, read by no release so far);
* `single`: every request to the first decode URL, unchanged: no prefill leg, no retry.

They plug into the request flow through `legs.LegPlan` (the NIXL modes) or replace it (`SingleInstance`), so
the product path (`flow.py`) has no branch for any of them.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from kvpush_common.router.context import RequestContext
from kvpush_common.router.legs import LegPlan
from kvpush_common.router.relay import LegError, Relay
from kvpush_common.router.replies import UpstreamReply


class NixlProducer(msgspec.Struct, frozen=True):
    """P's side channel as NixlPushConnector reports it in a prefill's kv_transfer_params."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    tp_size: int


def nixl_prefill_params(transfer_id: str | None = None) -> dict:
    """NixlConnector's prefill request, with `transfer_id` when given: vLLM main's push demo (1db62a2d) and llm-d's
    sidecar send one on both legs; vLLM's NIXL connectors of releases 0.32-0.34 read none and pair the legs by the
    request id without its random suffix (both legs carry one X-Request-Id)."""
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
    if transfer_id is not None:
        params["transfer_id"] = transfer_id
    return params


def nixl_push_decode_params(producer: NixlProducer, request_id: str, transfer_id: str) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": producer.remote_engine_id,
            "remote_host": producer.remote_host, "remote_port": producer.remote_port, "tp_size": producer.tp_size,
            "remote_request_id": request_id, "transfer_id": transfer_id}


class NixlLegs(LegPlan):
    """vLLM's NIXL contract as its connectors expect it from a proxy (no attempt, no consumer TP)."""

    kvpush_instances = False
    identity_hint = ("remote_engine_id, remote_host, remote_port, tp_size in kv_transfer_params: is it serving "
                     "with NixlPushConnector?")

    def __init__(self, push: bool):
        self.parallel = push

    def identity_probe(self) -> dict | None:
        return nixl_prefill_params() if self.parallel else None  # pull: D's params are P's answer

    def identity(self, kv) -> NixlProducer:
        return msgspec.convert(kv, NixlProducer)

    def prefill(self, ctx: RequestContext, consumer_tp: int | None) -> dict:
        return nixl_prefill_params(ctx.transfer_id) if self.parallel else nixl_prefill_params()

    def decode(self, ctx: RequestContext, producer: NixlProducer, reply: UpstreamReply | None) -> dict | None:
        if self.parallel:
            return nixl_push_decode_params(producer, ctx.leg_request_id, ctx.transfer_id)
        return reply.kv_transfer_params or None  # exactly what P answered


class SingleInstance:
    """`single`: the first decode instance serves every request as it came (the body is not touched)."""

    def __init__(self, relay: Relay, url: str):
        self.relay, self.url = relay, url

    async def serve(self, request: web.Request, ctx: RequestContext) -> web.StreamResponse:
        ctx.stamp("dispatched")
        try:
            upstream = await self.relay.first_output(self.url, ctx, None)
        except LegError as e:
            return await self.relay.leg_failed(ctx, e)
        return await self.relay.relay(request, ctx, upstream)


def baseline_legs(mode: str) -> LegPlan:
    return NixlLegs(push=mode == "nixl-push")
