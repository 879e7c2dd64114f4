"""`kv_transfer_params` on each leg, in either of the two contracts kvpush serves, and what P answers.

Two contracts reach the connectors, and both become one internal form (`PrefillLeg`, `DecodeLeg`,
`IdentityProbe`; `contract` says which one it came in, so the answer takes the same shape):

* kvpush's own, `{"kvpush": "prefill" | "decode" | "identity", ...}` (`kvpush router`);
* vLLM's NIXL contract, as vLLM 0.32-0.34's `kv_connector/v1/nixl/{push,pull}_scheduler.py` read and write
  it and vLLM's proxies and llm-d's sidecar send it: the prefill leg sets `do_remote_decode`, the decode leg
  `do_remote_prefill` plus P's coordinates (`remote_engine_id`, `remote_host`, `remote_port`, `tp_size`,
  `pp_size`, `remote_request_id`, `transfer_mode`), either built from P's answer (pull, and a push proxy's first
  request), from P's identity learned from an earlier answer (llm-d's push: both legs at once) or from P's
  coordinates given to the proxy up front (vLLM's push demo: both legs at once).  `remote_host` and
  `remote_port` are kvpush's own side channel (ProducerIdentity.host/port), which the proxies copy unread.

The transfer key of a NIXL leg is its `transfer_id` when it has one: vLLM main's push demo (1db62a2d) and llm-d's
sidecar mint one per dispatch, retries included, but vLLM's releases 0.32-0.34 read none (their nixl code pairs by
request id and their push demo sends none).  Without one it is those releases' pairing rule: the request id without
the `-<8 hex>` suffix vLLM's input processor appends (`nixl/utils.get_base_request_id`), P's own on P; on D its own
in push (`push_worker._pop_matching_registration`) and P's `remote_request_id` in pull.  A NIXL leg carries no attempt:
a retry is a new id, hence a new key.  Values arrive from HTTP, so they are typed and bounded here; a malformed
or inconsistent leg becomes a `BadLeg` naming the problem, never an exception inside the engine.
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta

from kvpush_common.protocol.wire import Attempt, Id, TpSize

log = logging.getLogger(__name__)

Host = Annotated[str, Meta(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9_.:\-\[\]]+\Z")]
Port = Annotated[int, Meta(ge=1, le=65535)]
Contract = Literal["kvpush", "nixl"]
_Text = Annotated[str, Meta(min_length=1, max_length=1024)]


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
    contract: Contract = "kvpush"


class DecodeLeg(_Leg, tag="decode"):
    transfer_id: Id
    producer: ProducerIdentity
    attempt: Attempt = 0
    contract: Contract = "kvpush"


class IdentityProbe(_Leg, tag="identity"):
    """The router's probe: the instance answers with its ProducerIdentity (at start-up, in the health loop and
    after a failed decode leg).  Naming a transfer attempt also asks a decode instance for its RecvReport."""

    transfer_id: Id | None = None
    attempt: Attempt = 0


class RecvReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A decode instance's answer about one transfer attempt (`kvpush_recv` in a probe's kv_transfer_params):
    whether its KV receive failed here, and which producer engine it expected the KV from.  vLLM drops the
    kv_transfer_params of a request that failed (kv_load_failure_policy=fail answers 500 "Internal server
    error", streamed as an SSE error event), so the router asks afterwards to tell such a failure from a
    model error."""

    transfer_id: Id
    attempt: Attempt
    failed: bool
    producer_engine_id: Id | None = None


Leg = Union[PrefillLeg, DecodeLeg, IdentityProbe]


class BadLeg(msgspec.Struct, frozen=True):
    """kv_transfer_params that ask for a transfer but cannot be served: why, in words a proxy's operator can act on."""

    reason: str


class _NixlParams(msgspec.Struct, frozen=True):
    """The fields of vLLM's NIXL contract kvpush reads (others, e.g. remote_block_ids, are vLLM's or a proxy's)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: Id | None = None
    remote_host: Host | None = None
    remote_port: Port | None = None
    tp_size: TpSize | None = None
    pp_size: TpSize | None = None
    dcp_size: TpSize | None = None
    remote_request_id: _Text | None = None
    transfer_id: _Text | None = None
    transfer_mode: Literal["push", "pull"] | None = None


# kv_transfer_params fields that mark a request an instance computes itself as a prefill, for the vLLM Neuron
# plugin's scheduler: it pads a prefill to a compiled bucket unless the request's kv_transfer_params lack
# `do_remote_decode`, which it takes for a decode node's one-token recompute after a KV load
# (`NeuronScheduler._should_skip_prefilling_padding_in_di`, docs/neuron.md).  A kvpush leg is read from its own
# fields only, so the mark changes nothing else.
COMPUTED_HERE = {"do_remote_decode": True}

_KVPUSH_FIELDS = ("kvpush", "transfer_id", "attempt", "producer", "consumer_tp")
_COORDINATES = ("remote_engine_id", "remote_host", "remote_port", "tp_size")
_VLLM_SUFFIX = re.compile(r"-[0-9a-f]{8}\Z", re.IGNORECASE)  # vLLM's input_processor.assign_request_id
_ID_OK = re.compile(r"^[A-Za-z0-9_.:\-/]{1,128}\Z")  # wire.Id


def parse_leg(params: dict | None) -> Leg | None:
    """The kvpush leg in kv_transfer_params, or None (absent, or malformed: logged).  The router's view; the
    connectors read both contracts with `read_leg`."""
    leg = read_leg(params)
    if isinstance(leg, BadLeg):
        log.error("ignoring kv_transfer_params %r: %s", params, leg.reason)
        return None
    return leg


def read_leg(params: dict | None, request_id: str | None = None, mode: str | None = "push") -> Leg | BadLeg | None:
    """The leg in a request's kv_transfer_params: None when it asks for no transfer, BadLeg when it cannot be served.
    `request_id` (vLLM's) and `mode` (this instance's) key a NIXL leg that carries no transfer_id; mode None
    (unknown) skips the transfer_mode check."""
    if not isinstance(params, dict) or not params:
        return None
    if "kvpush" in params:
        fields = {k: params[k] for k in _KVPUSH_FIELDS if k in params}
        try:
            return msgspec.convert(fields, Leg)
        except (msgspec.ValidationError, TypeError) as e:
            return BadLeg(f"malformed kvpush kv_transfer_params: {e}")
    if not (params.get("do_remote_decode") or params.get("do_remote_prefill")):
        return None
    return _nixl_leg(params, request_id or "-", mode)


def _nixl_leg(params: dict, request_id: str, mode: str | None) -> Leg | BadLeg | None:
    try:
        p = msgspec.convert(params, _NixlParams)
    except (msgspec.ValidationError, TypeError) as e:
        return BadLeg(f"malformed kv_transfer_params: {e}")
    if p.do_remote_decode and p.do_remote_prefill:
        return BadLeg("inconsistent kv_transfer_params: do_remote_decode and do_remote_prefill are both true; the "
                      "prefill leg sets do_remote_decode, the decode leg do_remote_prefill")
    if p.do_remote_decode:
        key = transfer_key(p.transfer_id) if p.transfer_id is not None else request_key(request_id)
        return PrefillLeg(transfer_id=key, contract="nixl")
    missing = [f for f in _COORDINATES if getattr(p, f) is None]
    if missing:
        return BadLeg(f"malformed kv_transfer_params: a decode leg (do_remote_prefill) needs the prefill instance's "
                      f"{', '.join(missing)}, as its answer's kv_transfer_params carry them")
    for name in ("pp_size", "dcp_size"):
        if getattr(p, name) not in (None, 1):
            return BadLeg(f"inconsistent kv_transfer_params: {name} {getattr(p, name)}; kvpush's prefill instances "
                          f"run without pipeline or decode-context parallelism ({name} 1)")
    if mode is not None and p.transfer_mode not in (None, mode):
        return BadLeg(f"inconsistent kv_transfer_params: transfer_mode {p.transfer_mode!r}, but this decode instance "
                      f"runs kvpush in {mode!r} mode (kv_connector_extra_config.mode must be the same on P and D)")
    if p.transfer_id is not None:
        key = transfer_key(p.transfer_id)
    elif mode == "pull" and p.remote_request_id is not None:
        key = request_key(p.remote_request_id)
    else:
        key = request_key(request_id)
    producer = ProducerIdentity(engine_id=p.remote_engine_id, host=p.remote_host, port=p.remote_port,
                                tp_size=p.tp_size)
    return DecodeLeg(transfer_id=key, producer=producer, contract="nixl")


def transfer_key(text: str) -> str:
    """A NIXL leg's transfer_id as a wire Id: as it is when it fits, else a digest (both legs map one text to one
    key, and two texts to two keys)."""
    if _ID_OK.match(text):
        return text
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:48]


def request_key(request_id: str) -> str:
    """The key of a leg without transfer_id: vLLM's request id without the random suffix its input processor
    appends, which both legs of one dispatch share (same X-Request-Id, same endpoint)."""
    return transfer_key(_VLLM_SUFFIX.sub("", request_id))


def check_role(leg: Leg | BadLeg | None, role: str) -> Leg | BadLeg | None:
    """A prefill leg belongs at a kv_producer, a decode leg at a kv_consumer; anything else is a routing mistake."""
    if isinstance(leg, PrefillLeg) and role != "producer":
        return BadLeg("a prefill leg (do_remote_decode, or kvpush prefill) reached a kv_consumer: send it to a "
                      "prefill instance (kv_role kv_producer)")
    if isinstance(leg, DecodeLeg) and role != "consumer":
        return BadLeg("a decode leg (do_remote_prefill, or kvpush decode) reached a kv_producer: send it to a "
                      "decode instance (kv_role kv_consumer)")
    return leg


def nixl_answer(*, engine_id: str, host: str, port: int, tp_size: int, pp_size: int, dcp_size: int, mode: str,
                request_id: str, transfer_id: str, block_ids: list[int], num_tokens: int) -> dict:
    """P's answer to a NIXL prefill leg, in the shape vLLM's NIXL schedulers answer (`request_finished`), so a
    proxy builds the decode leg from it (pull) or learns P's identity from it (push: llm-d's sidecar caches
    remote_engine_id, remote_host, remote_port, tp_size, pp_size, dcp_size when transfer_mode is push).
    `transfer_id` is the key P used, for proxies that forward the whole answer."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(block_ids)],
            "remote_engine_id": engine_id, "remote_request_id": request_id, "remote_host": host, "remote_port": port,
            "tp_size": tp_size, "pp_size": pp_size, "dcp_size": dcp_size, "remote_num_tokens": num_tokens,
            "transfer_mode": mode,
            "transfer_id": transfer_id}
