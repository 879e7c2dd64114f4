"""What `kvpush router` is told (`kvpush router --help`), checked before anything starts."""

from __future__ import annotations

from dataclasses import dataclass

from kvpush_common.router.policy import POLICIES

PRODUCT_MODES = ("push", "pull")  # kvpush connectors on both sides (legs.py)
BASELINE_MODES = ("nixl-pull", "nixl-push", "single")  # benchmark references (baselines.py)
MODES = PRODUCT_MODES + BASELINE_MODES


@dataclass(frozen=True)
class RouterConfig:
    """What `kvpush router` was told; validated here so a bad combination fails before anything starts."""

    mode: str
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    retries: int = 2
    request_timeout_s: float = 300.0
    prefill_timeout_s: float | None = None  # per attempt, so a hung P is retried; None: no bound but the request's
    connect_timeout_s: float = 10.0
    startup_timeout_s: float = 600.0
    health_interval_s: float = 5.0
    warm_up: bool = True  # push: one tiny request per (prefill, decode) pair at start-up (handshakes early)
    policy: str = "kv-aware"  # router/policy.py: kv-aware or round-robin
    # kvpush modes: no prefill leg when the chosen decode instance probably holds all of the prompt but at most
    # this many tokens (prefix index estimate); it computes them itself.  0 (default): every request has both
    # legs, so `push` means push (benchmarks of the transfer stay that); chat traffic: e.g. 256
    skip_prefill_max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if not self.decode_urls:
            raise ValueError("at least one decode URL is needed")
        if self.mode != "single" and not self.prefill_urls:
            raise ValueError(f"mode {self.mode} needs at least one prefill URL")
        if self.retries < 0 or self.request_timeout_s <= 0:
            raise ValueError("retries must be >= 0 and request_timeout_s > 0")
        if self.skip_prefill_max_tokens < 0:
            raise ValueError("skip_prefill_max_tokens must be >= 0")


class StartupError(RuntimeError):
    """The router cannot serve: an upstream stayed down or did not tell who it is."""
