"""Scheduler side of KVPushConnector (runs in vLLM's EngineCore process).

It only decides and stages: which requests receive (consumer) or send (producer) KV, and which
blocks stay allocated until the worker side reports the transfer ended.  No NIXL here.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.request import RequestStatus

from kvpush_common.protocol.identity import TransferKey
from kvpush_common.vllm.metadata import AbortOp, DeclineOp, KVPushMetadata, RecvOp, SendOp, StreamOp
from kvpush_common.protocol.legs import DecodeLeg, IdentityProbe, PrefillLeg, parse_leg
from kvpush_common.vllm.settings import ConnectorSettings

log = logging.getLogger(__name__)


RECEIVED_KEPT = 4096  # ended receives remembered for late sibling samples (they arrive with the first)


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings):
        self.settings = settings
        self._meta = KVPushMetadata()
        self._awaiting: dict[str, DecodeLeg] = {}  # consumer: registered, not yet finished_recving
        self._handled: set[str] = set()  # consumer: registered once; a later pass (recompute) loads nothing
        self._abandoned: set[str] = set()  # consumer: finished while awaiting; blocks held until recv ends
        self._sending: dict[str, TransferKey] = {}  # producer: request -> key, blocks held until finished_sending
        # n > 1: vLLM runs each sample as a child request with the parent's kv_transfer_params, so several
        # requests carry one transfer key.  One receives (consumer) or sends (producer) it; the others wait
        # for that receive and then find the prompt in the local prefix cache, or send nothing.
        self._receiver: dict[TransferKey, str] = {}  # consumer: key -> the request receiving it
        self._received: OrderedDict[TransferKey, None] = OrderedDict()  # consumer: receives that ended (bounded)
        self._sender: dict[TransferKey, str] = {}  # producer: key -> the request sending it
        self._prefilling: dict[str, Prefill] = {}  # producer, layer streaming: requests still being prefilled

    # ---- consumer ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        leg = parse_leg(request.kv_transfer_params)
        if not isinstance(leg, DecodeLeg) or request.request_id in self._handled:
            return 0, False
        key = TransferKey(leg.transfer_id, leg.attempt)
        if self._receiver.get(key, request.request_id) != request.request_id:
            return None, False  # a sibling sample receives this prompt: not schedulable yet (vLLM asks again)
        if key in self._received:
            return 0, False  # a sibling received it: the prompt's full blocks are in the prefix cache now
        remaining = request.num_prompt_tokens - num_computed_tokens
        if remaining <= 0:
            return 0, False
        if self._computes_tail_locally(num_computed_tokens, remaining):
            self._handled.add(request.request_id)  # asked again (no free blocks yet): still computed here
            self._meta.declines.append(DeclineOp(
                request.request_id, leg.transfer_id, leg.attempt, leg.producer,
                f"{num_computed_tokens} prompt tokens cached here, {remaining} computed here"))
            return 0, False
        return remaining, True

    def _computes_tail_locally(self, cached: int, remaining: int) -> bool:
        """A multi-turn follow-up: the history is in the local prefix cache and the new turn is short, so
        computing it here beats waiting for the prefill instance (push mode: the producer holds KV for us)."""
        return (self.settings.mode == "push" and cached > 0
                and remaining <= self.settings.local_prefill_max_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self.settings.role == "producer":
            self._track_prefill(request)
            return
        if num_external_tokens <= 0 or request.request_id in self._handled:
            return
        leg = parse_leg(request.kv_transfer_params)
        if not isinstance(leg, DecodeLeg):
            return
        block_ids = tuple(blocks.get_unhashed_block_ids_all_groups()[0])
        first = request.num_prompt_tokens - num_external_tokens  # local prefix-cache hit, block aligned
        self._awaiting[request.request_id] = leg
        self._handled.add(request.request_id)
        self._receiver[TransferKey(leg.transfer_id, leg.attempt)] = request.request_id
        self._meta.recvs.append(RecvOp(request.request_id, leg.transfer_id, leg.attempt, leg.producer, block_ids,
                                       request.num_prompt_tokens, first))

    # ---- both ----------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> KVPushMetadata:
        meta, self._meta = self._meta, KVPushMetadata()
        if self._prefilling:
            meta.streams = self._stream_ops(scheduler_output)
        return meta

    # ---- producer, layer streaming -------------------------------------------------------------
    def _track_prefill(self, request) -> None:
        if not (self.settings.stream_layers and self.settings.mode == "push"):
            return
        leg = parse_leg(request.kv_transfer_params)
        if isinstance(leg, PrefillLeg):
            self._prefilling[request.request_id] = Prefill(TransferKey(leg.transfer_id, leg.attempt),
                                                           request.num_prompt_tokens)

    def _stream_ops(self, so) -> list[StreamOp]:
        """This step's prompt chunk of each request being prefilled (vLLM's block lists grow per step)."""
        ops = []
        for new in so.scheduled_new_reqs:
            p = self._prefilling.get(new.req_id)
            if p is not None:
                p.block_ids = list(new.block_ids[0])
                ops.append(self._stream_op(new.req_id, p, new.num_computed_tokens, so))
        cached = so.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", None) or ())
        flags = getattr(cached, "resumed_from_preemption", None) or ()
        for i, req_id in enumerate(cached.req_ids):
            p = self._prefilling.get(req_id)
            if p is None:
                continue
            if req_id in resumed or (i < len(flags) and flags[i]):
                del self._prefilling[req_id]  # preempted: its blocks were freed; the whole push sends it
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids:
                p.block_ids.extend(new_ids[0])
            ops.append(self._stream_op(req_id, p, cached.num_computed_tokens[i], so))
        return [op for op in ops if op is not None]

    def _stream_op(self, req_id: str, p: "Prefill", computed: int, so) -> StreamOp | None:
        upto = min(computed + so.num_scheduled_tokens.get(req_id, 0), p.num_prompt_tokens)
        if upto >= p.num_prompt_tokens:
            del self._prefilling[req_id]  # its last prompt chunk: the whole push follows
        if upto <= computed:
            return None
        return StreamOp(req_id, p.key.transfer_id, p.key.attempt, tuple(p.block_ids), upto)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._prefilling.pop(request.request_id, None)
        leg = parse_leg(request.kv_transfer_params)
        if leg is None:
            return False, None
        if isinstance(leg, IdentityProbe):
            return False, {"kvpush_identity": _identity_dict(self.settings)}
        if isinstance(leg, DecodeLeg):
            self._handled.discard(request.request_id)
            if request.request_id in self._awaiting:  # aborted while its KV may still be landing
                self._abandoned.add(request.request_id)
                self._meta.aborts.append(AbortOp(request.request_id, leg.transfer_id, leg.attempt,
                                                 f"decode request ended ({request.status.name})"))
                return True, None
            return False, None
        # PrefillLeg
        if self.settings.role != "producer":
            return False, None
        key = TransferKey(leg.transfer_id, leg.attempt)
        if self._sender.get(key, request.request_id) != request.request_id:
            return False, None  # a sibling sample (n > 1 sent straight to P) already sends this prompt's KV
        normal = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not normal or not block_ids:
            self._meta.aborts.append(AbortOp(request.request_id, leg.transfer_id, leg.attempt,
                                             f"prefill ended {request.status.name}"))
            return False, None
        self._sending[request.request_id] = key
        self._sender[key] = request.request_id
        self._meta.sends.append(SendOp(request.request_id, leg.transfer_id, leg.attempt, tuple(block_ids),
                                       request.num_prompt_tokens, leg.consumer_tp))
        return True, {"kvpush_transfer": {"transfer_id": leg.transfer_id, "attempt": leg.attempt,
                                          "engine_id": self.settings.engine_id}}

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_sending or ():
            key = self._sending.pop(req_id, None)
            if key is not None and self._sender.get(key) == req_id:
                del self._sender[key]
        for req_id in connector_output.finished_recving or ():
            leg = self._awaiting.pop(req_id, None)
            self._abandoned.discard(req_id)
            if leg is not None:
                key = TransferKey(leg.transfer_id, leg.attempt)
                if self._receiver.pop(key, None) is not None:
                    self._received[key] = None
                    while len(self._received) > RECEIVED_KEPT:
                        self._received.popitem(last=False)

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while blocks wait for a transfer to end (so get_finished runs)."""
        return bool(self._sending or self._abandoned or self._meta.recvs or self._meta.sends or self._meta.aborts
                    or self._meta.declines)


@dataclass
class Prefill:
    """A producer request being prefilled: its transfer key, prompt length and blocks so far."""

    key: TransferKey
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)


def _identity_dict(settings: ConnectorSettings) -> dict:
    ident = settings.identity()
    return {"engine_id": ident.engine_id, "host": ident.host, "port": ident.port, "tp_size": ident.tp_size}
