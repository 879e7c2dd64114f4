"""Prometheus metrics of an endpoint, in a registry of its own (several endpoints may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class EndpointStats:
    def __init__(self, engine_id: str, role: str):
        self.registry = CollectorRegistry()
        labels = {"engine": engine_id, "role": role}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            c = Counter(f"kvpush_{name}", doc, list(labels) + list(extra), registry=self.registry)
            return c.labels(**labels) if not extra else _Partial(c, labels)

        self.writes_posted = counter("writes_posted", "WRITEs posted into a destination rank")
        self.writes_prepped = counter("writes_prepped", "WRITEs posted from per-peer prepped block lists")
        self.writes_done = counter("writes_done", "WRITEs that completed")
        self.writes_failed = counter("writes_failed", "WRITEs refused, failed or timed out", ("code",))
        self.bytes_written = counter("bytes_written", "payload bytes moved by completed WRITEs")
        self.descs_posted = counter("descriptors_posted", "NIXL descriptors posted")
        self.failed_notifs = counter("failed_notifications", "control messages that could not be sent")
        self.rejected_msgs = counter("rejected_messages", "incoming messages refused", ("reason",))
        self.worker_errors = counter("worker_errors", "unexpected exceptions in the worker loop")
        # the worker thread's share of the process: every step it takes, and its CPU time (thread clock), of which
        # the part inside NIXL calls (which release the GIL); the rest held the GIL the engine thread needs
        self.worker_steps = counter("worker_steps", "worker thread steps (each wake-up: a poll or an engine hand-over)")
        self.worker_cpu = counter("worker_cpu_seconds", "worker thread CPU time (thread clock), NIXL calls included")
        self.worker_nixl_cpu = counter("worker_nixl_cpu_seconds", "worker thread CPU time inside NIXL calls (the "
                                       "GIL released there)")
        self.peers_evicted = counter("peers_evicted", "peers forgotten: idle, unreachable, or replaced by a restart")
        self.peers_gone = counter("peers_gone", "peers found dead (NIXL cannot reach them and their process exited): "
                                  "what they owed ended at once")
        self.stale_batches = counter("stalled_steps", "worker steps after a stall longer than fence_grace_s")
        self.registrations_sent = counter("registrations_sent", "consumer registrations sent to a producer rank (its "
                                          "destination blocks, before the producer has the KV or after)")
        self.received_ok = counter("requests_received", "consumer requests whose KV became usable")
        self.received_failed = counter("requests_failed", "consumer requests that ended without usable KV")
        self.released = counter("requests_released", "producer requests whose blocks were released (outcome "
                                "`unneeded`: the decode computed the tail itself)", ("outcome",))
        self.declined = counter("requests_declined", "consumer requests that needed no bytes: the engine computes the "
                                "short uncached tail itself and the producer was told")
        self.post_seconds = Histogram("kvpush_post_seconds", "time to plan and post one WRITE", list(labels),
                                      registry=self.registry).labels(**labels)
        self.handoff_seconds = Histogram("kvpush_handoff_seconds", "producer: KV ready to every WRITE done",
                                         list(labels), registry=self.registry).labels(**labels)
        self.recv_wait_seconds = Histogram("kvpush_recv_wait_seconds", "consumer: blocks registered to KV usable",
                                           list(labels), registry=self.registry).labels(**labels)
        # where the time between KV ready and a posted WRITE goes : wake (engine thread's kv_ready to the
        # writer thread taking it), fence (write started to the device fence seen done), plan, post (the NIXL call)
        self.stage_seconds = _Partial(Histogram(
            "kvpush_write_stage_seconds", "producer: one stage between KV ready and a posted WRITE",
            list(labels) + ["stage"], registry=self.registry,
            buckets=(25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 0.1, 1.0, 10.0)), labels)
        # the engine thread's time in kvpush's per-step worker hooks (a decode step's budget for them: p99 <= 50 us)
        self.hook_seconds = _Partial(Histogram(
            "kvpush_engine_hook_seconds", "engine thread: one call of a per-step worker hook",
            list(labels) + ["hook"], registry=self.registry,
            buckets=(5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 1e-3, 10e-3, 0.1)), labels)
        self.xfer_seconds = Histogram("kvpush_xfer_seconds", "time from post to WRITE completion", list(labels),
                                      registry=self.registry).labels(**labels)


class _Partial:
    """A counter with the endpoint labels bound and the rest given at use.  Each child is looked up once:
    prometheus_client's `labels` takes a lock and checks every value, and the push path observes four stages."""

    def __init__(self, counter: Counter, bound: dict[str, str]):
        self._counter = counter
        self._bound = bound
        self._children: dict[tuple, object] = {}

    def labels(self, **extra: str):
        key = tuple(extra.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._counter.labels(**self._bound, **extra)
        return child
