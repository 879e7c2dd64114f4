"""The router's Prometheus series (served on its /metrics), labelled by mode."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class RouterMetrics:
    """The router's Prometheus series, in a registry of its own (tests run several routers in a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        seconds = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.requests = Counter("kvpush_router_requests", "client requests by mode and outcome",
                                ["mode", "outcome"], registry=self.registry)
        self.retries = Counter("kvpush_router_retries", "attempts started again after a prefill failure",
                               ["mode"], registry=self.registry)
        self.failures = Counter("kvpush_router_failures", "failed legs and requests by cause",
                                ["mode", "cause"], registry=self.registry)
        self.ttft = Histogram("kvpush_router_ttft_seconds", "arrival to the first byte of D's answer",
                              ["mode"], buckets=seconds, registry=self.registry)
        self.prefill = Histogram("kvpush_router_prefill_seconds", "prefill leg: dispatch to P's whole answer",
                                 ["mode"], buckets=seconds, registry=self.registry)
        self.migrations = Counter("kvpush_router_migrations", "requests moved to another decode instance after a "
                                  "decode failure before the client saw a byte", ["mode"], registry=self.registry)
        self.prefill_cancelled = Counter("kvpush_router_prefill_cancelled",
                                         "prefill legs aborted because D answered first (it computed the prompt "
                                         "from its own prefix cache)", ["mode"], registry=self.registry)
        self.prefill_skipped = Counter("kvpush_router_prefill_skipped",
                                       "requests sent to a decode instance alone because it probably holds all "
                                       "but a short tail of the prompt", ["mode"], registry=self.registry)
        self.identity_changes = Counter("kvpush_router_identity_changes",
                                        "prefill identities that changed (a restarted instance), learned by a probe",
                                        ["mode"], registry=self.registry)
        self.fallbacks = Counter("kvpush_router_fallbacks", "attempts served by one instance alone because no "
                                 "prefill (no_prefill) or no decode instance (no_decode) was usable",
                                 ["mode", "kind"], registry=self.registry)
