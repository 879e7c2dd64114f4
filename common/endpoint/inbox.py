"""What the engine thread and the handshake threads hand an endpoint's worker thread: one type per
message, dispatched by type (`Endpoint._on_item`), never tagged tuples."""

from __future__ import annotations

import operator
from dataclasses import dataclass

from kvpush_common.protocol.identity import TransferKey
from kvpush_common.protocol.legs import ProducerIdentity
from kvpush_common.protocol.wire import Hello
from kvpush_common.state.rendezvous import ReadyKV

ProducerRank = tuple[str, int]  # (producer engine id, rank)


def block_ids_as_ints(block_ids) -> tuple[int, ...]:
    """The worker thread's copy of block ids the engine thread handed over as they were (`tuple()` only): the
    conversion on the engine thread lengthened the decode's receive hand-over, inside a decode step
    (docs/benchmarks/README.md#decode-hook-vllm).  Raises TypeError for ids that are not integers (1.5 -> 1 would
    address another block).  One pass with `operator.index`, cheaper than `int` and a compare: a push waits for it."""
    return tuple(map(operator.index, block_ids))


@dataclass(frozen=True)
class KVReady:
    """Producer, engine thread: the step that computed this request's KV was issued."""

    key: TransferKey
    ready: ReadyKV
    consumer_tp: int | None = None  # known: a rank that no consumer rank reads from releases at once
    enqueued_at: float | None = None  # the endpoint's clock on the engine thread: the wake-up stage starts here


@dataclass(frozen=True)
class LocalAbort:
    """Either role, engine thread: the engine gave this request up."""

    key: TransferKey
    reason: str


@dataclass(frozen=True)
class Expect:
    """Consumer, engine thread: blocks are allocated for this request; register them with its producer ranks
    (`first_token` > 0 when a local prefix is cached).  Kept by the consumer until the request ends."""

    key: TransferKey
    producer: ProducerIdentity
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int
    # vLLM's NIXL contract names the producer by its side channel (the engine id is what a proxy learned last):
    # when that address answers as another engine, this request follows it (ConsumerEndpoint._on_moved)
    follow_address: bool = False


@dataclass(frozen=True)
class Decline:
    """Consumer, engine thread: this attempt needs no bytes (the engine computes the prompt's short tail
    itself); tell its producer ranks so that they release the KV once ready."""

    key: TransferKey
    producer: ProducerIdentity
    reason: str


@dataclass(frozen=True)
class ConsumerHello:
    """Producer, handshake thread: a consumer rank's Hello passed every check; add it as a peer."""

    hello: Hello


@dataclass(frozen=True)
class HandshakeDone:
    """Consumer, handshake pool: a producer rank answered and passed every check."""

    producer: ProducerRank
    hello: Hello
    addr: tuple[str, int]  # the side channel it answered on


@dataclass(frozen=True)
class HandshakeMoved:
    """Consumer, handshake pool: a producer rank's side channel answered, passed every check, but as another
    engine than the request named (the producer restarted there with a new engine id)."""

    producer: ProducerRank  # the one the request named
    hello: Hello  # who answers there now
    addr: tuple[str, int]
    reason: str  # why a request that must not follow the address fails


@dataclass(frozen=True)
class HandshakeFailed:
    """Consumer, handshake pool: no usable answer from a producer rank; its waiting requests fail."""

    producer: ProducerRank
    reason: str


@dataclass(frozen=True)
class ProbeResult:
    """Consumer, handshake pool: what a producer rank's side channel did when a connection was tried, after
    NIXL could not reach that rank (`liveness.ProducerLiveness`)."""

    producer: ProducerRank
    refused: bool  # nothing listens there: the process that held the port has exited
    detail: str
