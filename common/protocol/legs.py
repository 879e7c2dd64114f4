"""`kv_transfer_params` that the router puts on each leg, and what the producer answers.

They arrive from HTTP, so they are typed, bounded and validated here; a malformed value never
raises inside the engine: the connector logs it and serves the request without kvpush.
"""

from __future__ import annotations

import logging
from typing import Annotated, Union

import msgspec
from msgspec import Meta

from kvpush_common.protocol.wire import Attempt, Id, TpSize

log = logging.getLogger(__name__)

Host = Annotated[str, Meta(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9_.:\-\[\]]+\Z")]
Port = Annotated[int, Meta(ge=1, le=65535)]


class ProducerIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a decode instance reaches a prefill instance: learned by the router at start-up."""

    engine_id: Id
    host: Host
    port: Port  # side channel of TP rank 0; rank r serves on port + r
    tp_size: TpSize


class _Leg(msgspec.Struct, tag_field="kvpush", frozen=True):
    pass


class PrefillLeg(_Leg, tag="prefill"):
    transfer_id: Id
    attempt: Attempt = 0
    # the decode instance's TP size when the router knows it: a producer rank that no consumer rank
    # reads from then releases its KV at once instead of holding it to the lease end
    consumer_tp: TpSize | None = None


class DecodeLeg(_Leg, tag="decode"):
    transfer_id: Id
    producer: ProducerIdentity
    attempt: Attempt = 0


class IdentityProbe(_Leg, tag="identity"):
    """The router's start-up request: the prefill instance answers with its ProducerIdentity."""


Leg = Union[PrefillLeg, DecodeLeg, IdentityProbe]


def parse_leg(params: dict | None) -> Leg | None:
    """The kvpush leg in a request's kv_transfer_params, or None (absent or malformed: logged)."""
    if not params or "kvpush" not in params:
        return None
    fields = {k: params[k] for k in ("kvpush", "transfer_id", "attempt", "producer", "consumer_tp") if k in params}
    try:
        return msgspec.convert(fields, Leg)
    except (msgspec.ValidationError, TypeError) as e:
        log.error("ignoring malformed kvpush kv_transfer_params %r: %s", params, e)
        return None
