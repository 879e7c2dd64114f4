"""What a producer rank has in flight for one (request, consumer rank): one class per kind of transfer.

A destination starts as `AwaitingFence` (the device has not finished writing the KV).  Once the fence
passes it becomes exactly one of `DirectWrite` (one NIXL WRITE) or `ReadPin` (pull: the consumer READs; the
blocks stay pinned).  Each kind has its
own poll on the producer (`ProducerEndpoint._poll_*`); each ends with exactly one write result for
the rendezvous.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvpush_common.protocol.identity import TransferKey
from kvpush_common.state.rendezvous import Dest, StartWrite


class Settled(enum.Enum):
    """How a posted NIXL transfer ended (`Endpoint._settle`): only then may anything be said about its memory."""

    DONE = "DONE"  # every byte landed (and, for a WRITE, its notification was sent)
    ERR = "ERR"  # NIXL reported an error: the destination's bytes are undefined
    TIMEOUT = "TIMEOUT"  # past its deadline and released: nothing more of it can land


@dataclass
class Transfer:
    start: StartWrite
    posted_at: float
    deadline: float
    nbytes: int = 0

    @property
    def key(self) -> TransferKey:
        return self.start.key

    @property
    def dest(self) -> Dest:
        return self.start.dest


@dataclass
class AwaitingFence(Transfer):
    """Registered and matched; waiting for the device to finish writing the KV (`kv_written(fence)`)."""


@dataclass
class DirectWrite(Transfer):
    """One NIXL WRITE (merged or prepped descriptors) carrying WriteDone as its notification."""

    handle: object = None


@dataclass
class ReadPin(Transfer):
    """Pull: a ReadGrant went out; the source blocks stay pinned until ReadResult or the deadline."""
