"""Scheduler side of KVPushConnector (runs in vLLM's EngineCore process).

It only decides and stages: which requests receive (consumer) or send (producer) KV, and which
blocks stay allocated until the worker side reports the transfer ended.  No NIXL here.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from typing import Any, Callable

from vllm.v1.request import RequestStatus

from kvpush_common.protocol.identity import TransferKey
from kvpush_common.vllm.compat import VLLM
from kvpush_common.vllm.kv_groups import sliding_window_of, window_block_missing, window_registration
from kvpush_common.vllm.metadata import AbortOp, DeclineOp, KVPushMetadata, RecvOp, RejectOp, SendOp
from kvpush_common.protocol.legs import (COMPUTED_HERE, BadLeg, DecodeLeg, IdentityProbe, PrefillLeg, check_role,
                                         nixl_answer, read_leg)
from kvpush_common.vllm.settings import ConnectorSettings

log = logging.getLogger(__name__)


RECEIVED_KEPT = 4096  # ended receives remembered for late sibling samples (they arrive with the first)
FAILED_KEPT = 4096  # failed receives remembered for the router's probe (RecvReport)


class SchedulerSide:
    # a device connector's own reason to compute a prompt here instead of receiving it, from
    # (num_prompt_tokens, num_computed_tokens); None: receive it
    computes_here: Callable[[int, int], str | None] | None = None

    def __init__(self, settings: ConnectorSettings, kv_cache_config=None):
        self.settings = settings
        # (window, block_size) of a sliding-window-only model: the decode registers the in-window blocks vLLM
        # allocated, and computes the prompt itself where vLLM nulled a block its recompute reads (kv_groups)
        self.window = sliding_window_of(kv_cache_config)
        if self.window:
            self.computes_here = functools.partial(window_block_missing, *self.window)
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
        self._rejecting: dict[str, str] = {}  # bad kv_transfer_params: request -> why, until its blocks are allocated
        self._failed: OrderedDict[TransferKey, str] = OrderedDict()  # consumer: failed receive -> producer engine
        self._recv_blocks: dict[str, frozenset[int]] = {}  # consumer, vLLM < 0.30: awaiting request -> its blocks
        self._marked: dict[str, dict] = {}  # consumer: request computed here -> its kv_transfer_params as they came

    def _computed_here(self, request) -> None:
        """This decode instance computes the request's prompt itself (a declined or failed receive, a sibling's
        prefix, a rejected leg): mark it a prefill (`COMPUTED_HERE`) so the vLLM Neuron plugin's scheduler pads it
        to a compiled bucket, as it pads every request without kv_transfer_params.  Unmarked, the plugin takes it
        for the one-token recompute after a KV load and runs the whole prompt unpadded.  The leg is still read
        from the params as they came."""
        params = request.kv_transfer_params
        if request.request_id in self._marked or not isinstance(params, dict) or params.get("do_remote_decode"):
            return
        self._marked[request.request_id] = params
        request.kv_transfer_params = {**params, **COMPUTED_HERE}

    def _leg(self, request):
        """The request's leg in either contract (protocol.legs), checked against this instance's role."""
        leg = read_leg(self._marked.get(request.request_id, request.kv_transfer_params), request.request_id,
                       self.settings.mode)
        return check_role(leg, self.settings.role)

    # ---- consumer ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        leg = self._leg(request)
        if isinstance(leg, BadLeg):
            return self._reject(request, num_computed_tokens, leg)
        if not isinstance(leg, DecodeLeg):
            return 0, False
        if request.request_id in self._handled:  # declined, or its receive failed and it is recomputed here
            self._computed_here(request)
            return 0, False
        key = TransferKey(leg.transfer_id, leg.attempt)
        if self._receiver.get(key, request.request_id) != request.request_id:
            return None, False  # a sibling sample receives this prompt: not schedulable yet (vLLM asks again)
        if key in self._received:
            self._computed_here(request)
            return 0, False  # a sibling received it: the prompt's full blocks are in the prefix cache now
        remaining = request.num_prompt_tokens - num_computed_tokens
        if remaining <= 0:
            return 0, False
        why = (f"{num_computed_tokens} prompt tokens cached here, {remaining} computed here"
               if self._computes_tail_locally(num_computed_tokens, remaining)
               else self.computes_here(request.num_prompt_tokens, num_computed_tokens) if self.computes_here else None)
        if why:
            self._computed_here(request)
            self._handled.add(request.request_id)  # asked again (no free blocks yet): still computed here
            self._meta.declines.append(DeclineOp(request.request_id, leg.transfer_id, leg.attempt, leg.producer, why))
            return 0, False
        return remaining, True

    def _reject(self, request, num_computed_tokens: int, leg: BadLeg) -> tuple[int, bool]:
        """Bad kv_transfer_params (either role): claim the uncached tokens as an async load that fails at once, the
        earliest point where vLLM can end the request cleanly (by kv_load_failure_policy), its blocks freed."""
        req_id = request.request_id
        if req_id in self._handled:
            if self.settings.role == "consumer":
                self._computed_here(request)
            return 0, False  # its failed load is being recomputed (kv_load_failure_policy recompute)
        remaining = request.num_prompt_tokens - num_computed_tokens
        log.error("kvpush: request %s: %s", req_id, leg.reason)
        if remaining <= 0:
            return 0, False  # the whole prompt is cached here: nothing to claim, it is served as it is
        self._handled.add(req_id)
        self._rejecting[req_id] = leg.reason
        return remaining, True

    def _computes_tail_locally(self, cached: int, remaining: int) -> bool:
        """A multi-turn follow-up: the history is in the local prefix cache and the new turn is short, so
        computing it here beats waiting for the prefill instance (push mode: the producer holds KV for us)."""
        return (self.settings.mode == "push" and cached > 0
                and remaining <= self.settings.local_prefill_max_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        reason = self._rejecting.pop(request.request_id, None)
        if reason is not None:
            block_ids = tuple(blocks.get_unhashed_block_ids_all_groups()[0])
            self._meta.rejects.append(RejectOp(request.request_id, block_ids, reason))
            return
        if self.settings.role == "producer":
            return
        if num_external_tokens <= 0 or request.request_id in self._handled:
            return
        leg = self._leg(request)
        if not isinstance(leg, DecodeLeg):
            return
        block_ids = tuple(blocks.get_unhashed_block_ids_all_groups()[0])
        first = request.num_prompt_tokens - num_external_tokens  # local prefix-cache hit, block aligned
        if self.window:
            first, block_ids = window_registration(request.num_prompt_tokens, first, block_ids, *self.window)
        self._awaiting[request.request_id] = leg
        self._track_recv_blocks(request.request_id, block_ids)
        self._handled.add(request.request_id)
        self._receiver[TransferKey(leg.transfer_id, leg.attempt)] = request.request_id
        self._meta.recvs.append(RecvOp(request.request_id, leg.transfer_id, leg.attempt, leg.producer, block_ids,
                                       request.num_prompt_tokens, first, follow_address=leg.contract == "nixl"))

    # ---- both ----------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> KVPushMetadata:
        meta, self._meta = self._meta, KVPushMetadata()
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        leg = self._leg(request)
        self._marked.pop(request.request_id, None)
        if leg is None:
            return False, None
        if isinstance(leg, BadLeg):
            self._rejecting.pop(request.request_id, None)
            self._handled.discard(request.request_id)
            return False, None
        if isinstance(leg, IdentityProbe):
            return False, self._probe_answer(leg)
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
        return True, self._answer(request, leg, block_ids)

    def _answer(self, request, leg: PrefillLeg, block_ids: list[int]) -> dict:
        """P's kv_transfer_params, in the contract the leg came in: a NIXL proxy forwards them to D (pull, or the
        first request of a push proxy) or learns P's identity from them."""
        s = self.settings
        if leg.contract == "nixl":
            return nixl_answer(engine_id=s.engine_id, host=s.host, port=s.port, tp_size=s.tp_size,
                               pp_size=s.parallel.pp, dcp_size=s.parallel.dcp, mode=s.mode,
                               request_id=request.request_id, transfer_id=leg.transfer_id, block_ids=block_ids,
                               num_tokens=request.num_prompt_tokens)
        return {"kvpush_transfer": {"transfer_id": leg.transfer_id, "attempt": leg.attempt, "engine_id": s.engine_id}}

    def update_connector_output(self, connector_output) -> None:
        self._note_failed_recvs(connector_output)
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

    # ---- consumer: failed receives, reported to the router's probe --------------------------------
    def _track_recv_blocks(self, req_id: str, block_ids) -> None:
        """vLLM before 0.30 hears of a failed receive only as its blocks (compat.LoadErrors), and so do we."""
        if not VLLM.transfer_results:
            self._recv_blocks[req_id] = frozenset(b for b in block_ids if b > 0)

    def _note_failed_recvs(self, connector_output) -> None:
        """Remember which awaited receives failed (bounded), before update_connector_output forgets them: the
        router asks after a failed decode leg whether it failed for its KV (RecvReport)."""
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        invalid = getattr(connector_output, "invalid_block_ids", None) or set()
        for req_id in connector_output.finished_recving or ():
            if self._recv_blocks.pop(req_id, frozenset()) & invalid:
                failed.add(req_id)
        for req_id in failed:
            leg = self._awaiting.get(req_id)
            if leg is not None:
                self._failed[TransferKey(leg.transfer_id, leg.attempt)] = leg.producer.engine_id
                while len(self._failed) > FAILED_KEPT:
                    self._failed.popitem(last=False)

    def _probe_answer(self, leg: IdentityProbe) -> dict:
        """Who this instance is; and, asked about a transfer attempt, whether its receive failed here."""
        answer = {"kvpush_identity": _identity_dict(self.settings)}
        if leg.transfer_id is not None:
            engine = self._failed.get(TransferKey(leg.transfer_id, leg.attempt))
            answer["kvpush_recv"] = {"transfer_id": leg.transfer_id, "attempt": leg.attempt,
                                     "failed": engine is not None, "producer_engine_id": engine}
        return answer

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while blocks wait for a transfer to end (so get_finished runs)."""
        return bool(self._sending or self._abandoned or self._meta.recvs or self._meta.sends or self._meta.aborts
                    or self._meta.declines or self._meta.rejects)


def _identity_dict(settings: ConnectorSettings) -> dict:
    ident = settings.identity()
    return {"engine_id": ident.engine_id, "host": ident.host, "port": ident.port, "tp_size": ident.tp_size}
