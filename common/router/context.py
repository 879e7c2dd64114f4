"""One client request as the router carries it through its attempts: ids, timeline stamps, route, failures."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from kvpush_common.router.policy import Instance


@dataclass
class RequestContext:
    path: str
    chat: bool
    body: dict
    stream: bool
    request_id: str
    headers: dict[str, str]
    transfer_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival: float = field(default_factory=time.monotonic)
    arrival_unix: float = field(default_factory=time.time)  # joins timelines with the endpoints' event logs
    attempt: int = 0
    outcome: str | None = None
    stamps: dict[str, float] = field(default_factory=dict)
    streamed: web.StreamResponse | None = None  # set once bytes went to the client
    hashes: list[bytes] = field(default_factory=list)  # the prompt's prefix hash chain (routing)
    prompt_tokens: int | None = None  # estimated (prefix_index.estimated_tokens); None: unknown shape
    route: dict = field(default_factory=dict)  # this attempt's instances and why (timeline)
    failed_decodes: set[str] = field(default_factory=set)  # decode instances that failed this request
    failed_prefills: set[str] = field(default_factory=set)  # prefill instances gone during this request
    relaying: Instance | None = None  # the instance whose answer is relayed (entered until relayed)

    def stamp(self, name: str) -> None:
        self.stamps[name] = round((time.monotonic() - self.arrival) * 1000, 3)

    @property
    def leg_request_id(self) -> str:
        """Both legs of an attempt carry one X-Request-Id; a retry gets its own, so vLLM never sees a duplicate."""
        return self.request_id if self.attempt == 0 else f"{self.request_id}-{self.attempt}"

    def leg_headers(self) -> dict[str, str]:
        return {**self.headers, "X-Request-Id": self.leg_request_id}

    def timeline(self, mode: str, outcome: str) -> dict:
        """What /timelines shows of this request once it ended."""
        entry = {"transfer_id": self.transfer_id, "attempt": self.attempt, "mode": mode,
                 "request_id": self.request_id, "outcome": outcome, "arrival_unix": round(self.arrival_unix, 6),
                 **self.stamps, "route": self.route}
        if self.failed_decodes:
            entry["migrated_from"] = sorted(self.failed_decodes)
        return entry
