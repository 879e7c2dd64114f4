"""Settings of one kvpush endpoint (one engine rank), with the timing rules that keep requests bounded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvpush_common.transport.nixl import TransportConfig

# Settings kvpush once read and no longer does, with why: a config that still names one is refused, never run
# as if the setting were there (here for EndpointConfig's callers, and kv_connector_extra_config's `tuning`)
REMOVED_SETTINGS = {
    **{name: "staged transfers lost to the plain push end to end in vLLM (docs/benchmarks/README.md)"
       for name in ("staging_bytes", "staging_chunk_bytes", "staging_min_descs", "staging_partitions")},
    "progress_thread": "NIXL's progress thread follows the backend, off over UCX and on LIBFABRIC for the "
                       "side written into; forcing it was no faster",
    "handshake_workers": "a consumer runs a fixed 4 handshakes at once",
    "prepped_lists": "prepped descriptor lists are used wherever both sides' block geometry allows them",
}


def removed_setting_error(names, where: str) -> ValueError | None:
    """The error for settings in `names` that were removed (None when there are none); `where` names the config."""
    removed = sorted(n for n in names if n in REMOVED_SETTINGS)
    if not removed:
        return None
    return ValueError("; ".join(f"{where}{n} was removed ({REMOVED_SETTINGS[n]}); delete it" for n in removed))


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
    tombstone_s: float = 600.0
    fence_grace_s: float = 5.0  # allowance for a control message still in flight
    peer_idle_s: float = 600.0  # forget a peer silent this long with no live work (a restart under a new id)
    poll_s: float = 0.001  # worker poll period while work is outstanding
    # the producer's period while one of its WRITEs is on the wire: NIXL completes it, and sends the consumer
    # its notification, only from our progress calls, so this bounds what completion waits for after the bytes
    # landed.  It holds only while a WRITE is on the wire, so it can be short.
    write_poll_s: float = 0.00005
    # the consumer's poll while any key waits for its bytes (the whole prefill) when the engine does not step:
    # each engine step wakes the worker then (`engine_step`), so WriteDone is seen once per step, as vLLM's own
    # decode sees its notifications, not by a short poll waking the worker (and its GIL) many times a decode step
    wire_poll_s: float = 0.01
    idle_poll_s: float = 0.01  # and while idle (notifications still have to be drained)
    # the worker thread's timer slack (Linux): how late the kernel may end its timed waits.  Its default (50 us) is
    # longer than the write poll itself, so short polls would sleep far longer than set; 0 leaves the kernel's default
    timer_slack_s: float = 1e-6

    def __new__(cls, *args, **kwargs):
        err = removed_setting_error(kwargs, "EndpointConfig.")
        if err is not None:
            raise err
        return super().__new__(cls)

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
