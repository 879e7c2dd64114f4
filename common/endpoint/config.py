"""Settings of one kvpush endpoint (one engine rank), with the timing rules that keep requests bounded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvpush_common.transport.nixl import TransportConfig


@dataclass(frozen=True)
class EndpointConfig:
    engine_id: str
    rank: int = 0
    tp_size: int = 1
    total_kv_heads: int = 1
    model: str = "unknown"
    mode: Literal["push", "pull"] = "push"
    host: str = "127.0.0.1"
    base_port: int = 0  # producer side channel: rank r listens on base_port + r (0: pick a free port)
    transport: TransportConfig = field(default_factory=TransportConfig)
    secret: bytes | None = None  # HMAC-SHA256 on every control message when set (both sides)
    lease_s: float = 30.0  # producer keeps ready KV this long without a heartbeat
    reg_ttl_s: float = 30.0  # producer keeps an unmatched registration this long without a heartbeat
    write_timeout_s: float = 30.0  # a posted WRITE that has not finished by then is failed
    transfer_timeout_s: float = 120.0  # consumer gives up on a request's KV after this long
    heartbeat_s: float = 5.0
    handshake_timeout_s: float = 5.0
    handshake_workers: int = 4  # concurrent handshakes: a slow peer never blocks the others
    tombstone_s: float = 600.0
    fence_grace_s: float = 5.0  # allowance for a control message still in flight
    prepped_lists: bool = True  # same block geometry on both sides: post from per-peer prepped lists
    peer_idle_s: float = 600.0  # forget a peer silent this long with no live work (a restart under a new id)
    # staged transfers (push, whole-block routes): a registered pool of this many bytes, 0 = off
    staging_bytes: int = 0
    staging_chunk_bytes: int = 64 << 20  # one gather / WRITE / scatter unit
    # stage when the direct plan would post at least this many descriptors: a direct WRITE pays a few us per
    # non-contiguous descriptor, staging about a millisecond per half GiB gathered
    staging_min_descs: int = 320
    staging_partitions: int = 4  # a consumer lends each producer rank 1/N of its pool (N producer ranks at most)
    poll_s: float = 0.001  # worker poll period while work is outstanding
    # the producer's period while one of its WRITEs is on the wire: NIXL completes it, and sends the consumer
    # its notification, only from our progress calls, so this bounds what completion waits for after the bytes
    # landed (a 0.1 ms copy over cuda_ipc is seen done within about one period).  Short-lived (a WRITE lasts
    # 0.1-80 ms), so it can be short.
    write_poll_s: float = 0.00005
    # the consumer's poll while any key waits for its bytes (the whole prefill) when the engine does not step:
    # each engine step wakes the worker then (`engine_step`), so WriteDone is seen once per step, as vLLM's own
    # decode sees its notifications, not by a 0.2 ms poll waking the worker (and its GIL) ~35 times a decode step
    wire_poll_s: float = 0.01
    idle_poll_s: float = 0.01  # and while idle (notifications still have to be drained)
    # the worker thread's timer slack (Linux): how late the kernel may end its timed waits.  Its default, 50 us,
    # nearly triples a 0.05 ms poll's sleep; 0 leaves the kernel's default
    timer_slack_s: float = 1e-6

    @property
    def agent_name(self) -> str:
        return f"{self.engine_id}/r{self.rank}"

    @property
    def fence_wait_s(self) -> float:
        """After a revoke, how long a silent producer could still write into our blocks.

        A producer posts only while a registration is alive (TTL renewed by our heartbeats, which stop
        on failure) and fails any WRITE that runs past write_timeout_s.
        """
        return self.reg_ttl_s + self.write_timeout_s + self.fence_grace_s

    def validate(self) -> "EndpointConfig":
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank {self.rank} out of range for tp_size {self.tp_size}")
        if self.heartbeat_s * 2 > min(self.lease_s, self.reg_ttl_s):
            raise ValueError("heartbeat_s must be at most half of lease_s and reg_ttl_s, or leases lapse between beats")
        for name in ("lease_s", "reg_ttl_s", "write_timeout_s", "transfer_timeout_s", "handshake_timeout_s",
                     "poll_s", "idle_poll_s", "wire_poll_s", "write_poll_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not 0 <= self.timer_slack_s <= 0.01:
            raise ValueError("timer_slack_s must be in [0, 0.01] (0: the kernel's default)")
        if self.peer_idle_s <= max(self.lease_s, self.reg_ttl_s) + self.write_timeout_s:
            raise ValueError("peer_idle_s must exceed max(lease_s, reg_ttl_s) + write_timeout_s: a silent peer's "
                             "registrations and leases must have ended before it is forgotten")
        return self
