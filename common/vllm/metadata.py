"""What the scheduler side hands the worker side each step (it rides in SchedulerOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvpush_common.protocol.legs import ProducerIdentity


@dataclass(frozen=True)
class RecvOp:
    """Consumer: blocks allocated for tokens [first_token, num_tokens); register them."""

    req_id: str
    transfer_id: str
    attempt: int
    producer: ProducerIdentity
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int
    follow_address: bool = False  # vLLM's NIXL contract: the producer is its side channel (consumer._on_moved)


@dataclass(frozen=True)
class SendOp:
    """Producer: the prompt's KV is computed in these blocks; push it once registered."""

    req_id: str
    transfer_id: str
    attempt: int
    block_ids: tuple[int, ...]
    num_tokens: int
    consumer_tp: int | None = None  # the decode instance's TP, when the router said


@dataclass(frozen=True)
class AbortOp:
    req_id: str
    transfer_id: str
    attempt: int
    reason: str


@dataclass(frozen=True)
class DeclineOp:
    """Consumer: the engine computes this prompt's short uncached tail itself; tell the producer."""

    req_id: str
    transfer_id: str
    attempt: int
    producer: ProducerIdentity
    reason: str


@dataclass(frozen=True)
class RejectOp:
    """A request whose kv_transfer_params cannot be served (protocol.legs.BadLeg): report its load failed at once, so
    vLLM ends it by `kv_load_failure_policy` (fail: an error; recompute: computed here) and frees these blocks."""

    req_id: str
    block_ids: tuple[int, ...]
    reason: str


@dataclass
class KVPushMetadata(KVConnectorMetadata):
    recvs: list[RecvOp] = field(default_factory=list)
    sends: list[SendOp] = field(default_factory=list)
    aborts: list[AbortOp] = field(default_factory=list)
    declines: list[DeclineOp] = field(default_factory=list)
    rejects: list[RejectOp] = field(default_factory=list)
