"""What each leg carries: `kv_transfer_params` built from protocol.legs' typed legs, and the leg bodies (pure).

`LegPlan` is the one interface between the request flow and a mode: which params go on the prefill and the
decode leg, whether the decode leg goes out with the prefill leg, and how a prefill instance says who it
is.  `KVPushLegs` is the product's (`push`, `pull`); vLLM's own connectors are benchmark baselines
(`baselines.py`).  Why the product speaks kvpush's legs and not vLLM's NIXL contract: docs/routers.md.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvpush_common.protocol.legs import COMPUTED_HERE, DecodeLeg, IdentityProbe, Leg, PrefillLeg, ProducerIdentity
from kvpush_common.router.context import RequestContext
from kvpush_common.router.replies import IdentityParams, UpstreamReply


def leg_params(leg: Leg) -> dict:
    """A typed leg as kv_transfer_params: its fields but the connector-internal `contract`, unset optionals
    left out; a probe names an attempt only with its transfer."""
    params = {k: v for k, v in msgspec.to_builtins(leg).items() if k != "contract" and v is not None}
    if isinstance(leg, IdentityProbe) and leg.transfer_id is None:
        params.pop("attempt", None)
    return params


def push_prefill_params(transfer_id: str, attempt: int, consumer_tp: int | None = None) -> dict:
    """A prefill leg, marked a prefill the instance computes (`COMPUTED_HERE`: the Neuron plugin pads it)."""
    return {**leg_params(PrefillLeg(transfer_id=transfer_id, attempt=attempt, consumer_tp=consumer_tp)),
            **COMPUTED_HERE}


def push_decode_params(transfer_id: str, attempt: int, producer: ProducerIdentity) -> dict:
    return leg_params(DecodeLeg(transfer_id=transfer_id, producer=producer, attempt=attempt))


def identity_probe_params(transfer_id: str | None = None, attempt: int = 0) -> dict:
    """Who are you (an instance answers its ProducerIdentity); naming an attempt also asks a decode instance
    whether that attempt's KV receive failed (RecvReport).  The instance computes the probe's prompt itself."""
    return {**leg_params(IdentityProbe(transfer_id=transfer_id, attempt=attempt)), **COMPUTED_HERE}


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


class LegPlan:
    """How one mode drives its instances."""

    parallel: bool = True  # the decode leg goes out with the prefill leg (push), else once P answered (pull)
    kvpush_instances: bool = True  # they answer identity and receive probes (RecvReport), and decline KV
    identity_hint: str = ""  # what a prefill instance that did not say who it is should have answered

    def identity_probe(self) -> dict | None:
        """kv_transfer_params of a prefill identity probe; None: this mode needs no identity."""
        raise NotImplementedError

    def identity(self, kv: Any) -> Any:
        """The identity in a probe's answer; msgspec.ValidationError when there is none."""
        raise NotImplementedError

    def prefill(self, ctx: RequestContext, consumer_tp: int | None) -> dict:
        raise NotImplementedError

    def decode(self, ctx: RequestContext, producer: Any, reply: UpstreamReply | None) -> dict | None:
        """The decode leg's params: at dispatch (`reply` None) when parallel, else from P's answer.  None:
        P's answer did not say enough."""
        raise NotImplementedError


class KVPushLegs(LegPlan):
    """kvpush's own legs (protocol.legs): the transfer id with the attempt, the decode instance's TP, and the
    prefill identity the router learned by probing."""

    identity_hint = ("kv_transfer_params.kvpush_identity {engine_id, host, port, tp_size}: is it serving with "
                     "KVPushConnector as kv_producer?")

    def __init__(self, push: bool):
        self.parallel = push

    def identity_probe(self) -> dict:
        return identity_probe_params()

    def identity(self, kv: Any) -> ProducerIdentity:
        return msgspec.convert(kv, IdentityParams).kvpush_identity

    def prefill(self, ctx: RequestContext, consumer_tp: int | None) -> dict:
        return push_prefill_params(ctx.transfer_id, ctx.attempt, consumer_tp)

    def decode(self, ctx: RequestContext, producer: ProducerIdentity, reply: UpstreamReply | None) -> dict:
        return push_decode_params(ctx.transfer_id, ctx.attempt, producer)  # pull: the same, sent later
