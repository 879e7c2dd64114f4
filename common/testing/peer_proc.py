"""One kvpush endpoint in its own OS process, driven by JSON lines on stdin (tests only).

Each command is a JSON object with "op"; each reply is one JSON line.  The endpoint runs over real
NIXL (UCX on 127.0.0.1); the device backend is chosen by name so that device backends can join the
conformance suite unchanged.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import importlib
import os
import sys
import threading
import time
import traceback

import msgspec
import numpy as np


from kvpush_common.testing.kvref import logical_view  # noqa: E402

from kvpush_common.endpoint.config import EndpointConfig  # noqa: E402
from kvpush_common.endpoint.consumer import ConsumerEndpoint
from kvpush_common.protocol.legs import ProducerIdentity  # noqa: E402
from kvpush_common.endpoint.base import nixl_transport  # noqa: E402
from kvpush_common.testing.faults import FaultPlan, FaultyTransport  # noqa: E402
from kvpush_common.endpoint.producer import ProducerEndpoint  # noqa: E402
from kvpush_common.state.rendezvous import Release  # noqa: E402


def _unfix(names: str) -> None:
    """Chaos tests only (KVPUSH_CHAOS_UNFIX=stall,incarnation,guard,rejoin): put back the behaviour from
    before a core fix, to show that the chaos test catches its bug."""
    from kvpush_common.endpoint.base import Endpoint

    for name in filter(None, names.split(",")):
        if name == "stall":  # heartbeats and registrations fetched after a stall were trusted
            orig_on_msg = ProducerEndpoint._on_msg
            ProducerEndpoint._on_msg = lambda self, peer, msg, now, arrived_after: orig_on_msg(self, peer, msg, now, now)
        elif name == "incarnation":  # a registration's block ids were written into any incarnation
            ProducerEndpoint._same_incarnation = lambda self, a, peer: True
        elif name == "guard":  # one exception dropped the rest of the worker step
            from kvpush_common.transport.nixl import TransportError
            from kvpush_common.protocol.wire import WireError

            def send(self, peer, msg):  # and only TransportError / WireError counted as a failed send
                try:
                    self.transport.send_notif(peer.agent, self.codec.encode(msg))
                    return True
                except (TransportError, WireError):
                    return False

            Endpoint._guard = lambda self, fn, *args: fn(*args) or []
            Endpoint._send = send
        elif name == "rejoin":  # a known producer was never handshaken again
            class _Never(set):
                def add(self, item):
                    pass

            orig_init, orig_register = ConsumerEndpoint.__init__, ConsumerEndpoint._register

            def init(self, *a, **kw):
                orig_init(self, *a, **kw)
                self._suspect = _Never()

            ConsumerEndpoint.__init__ = init
            ConsumerEndpoint._register = lambda self, e, peer, now, retry=False: orig_register(self, e, peer, now, False)
        else:
            raise SystemExit(f"unknown KVPUSH_CHAOS_UNFIX {name!r}")


_unfix(os.environ.get("KVPUSH_CHAOS_UNFIX", ""))


def make_backend(spec: dict):
    """Device backends of the conformance suite; each offers slab_base, read_bytes and write_bytes."""
    kind = spec.pop("kind", "host")
    if kind == "host":
        from kvpush_common.device.host import HostBackend

        return HostBackend(**spec)
    if kind not in DEVICE_SLABS:
        raise SystemExit(f"unknown backend {kind!r}")
    # device backends are loaded by name, as `kvpush.targets` entry points are: the core never imports them
    module, _, cls = DEVICE_SLABS[kind].partition(":")
    if kind == "neuron-sim":  # the Neuron plugin's layout is fixed: HND, K plane then V plane
        spec.pop("order", None)
        spec.pop("blocks_first", None)
    return getattr(importlib.import_module(module), cls)(**spec)


DEVICE_SLABS = {"cuda": "kvpush_cuda.slab:CudaSlab", "neuron-sim": "kvpush_neuron.slab:NeuronSlab"}


def block_spans(layout, blocks):
    """(offset from slab base, length) of every region's copy of each block."""
    base = min(r.base for r in layout.regions)
    return [(r.base - base + b * r.block_stride, layout.block_bytes) for r in layout.regions for b in blocks]


class Peer:
    def __init__(self):
        self.ep = None
        self.backend = None
        self.results: list[dict] = []
        self.lock = threading.Lock()
        self.seen_at: dict[tuple[str, int], float] = {}  # CLOCK_MONOTONIC, comparable across processes

    def op_start(self, role, cfg, backend, faults=None, agent_first=None):
        """`agent_first`: "kvpush" or "other" creates a NIXL agent of the configured backend before the
        device backend (a Neuron runtime initialised after libfabric started: the start-up mistake)."""
        cfg = dict(cfg)
        if cfg.get("secret"):
            cfg["secret"] = cfg["secret"].encode()
        if "transport" in cfg:  # e.g. {"backend": "LIBFABRIC"} (the libfabric test tier)
            from kvpush_common.transport.nixl import TransportConfig

            cfg["transport"] = TransportConfig(**cfg["transport"])
        config = EndpointConfig(**cfg)
        if agent_first == "kvpush":
            self.early_agent = nixl_transport(dataclasses.replace(config, engine_id="early"), False)
        elif agent_first == "other":  # another component's agent, made with NIXL's own API
            from nixl._api import nixl_agent, nixl_agent_config

            self.early_agent = nixl_agent("other", nixl_agent_config(enable_listen_thread=False, backends=[]))
            self.early_agent.create_backend(config.transport.backend)
        self.backend = make_backend(dict(backend))
        factory = nixl_transport
        if faults:
            plan = FaultPlan(**{k: tuple(v) if k == "delay_s" else v for k, v in faults.items()})
            factory = lambda c, p: FaultyTransport(nixl_transport(c, p), plan)  # noqa: E731
        cls = ProducerEndpoint if role == "producer" else ConsumerEndpoint
        self.ep = cls(config, self.backend, transport_factory=factory).start()
        threading.Thread(target=self._collector, daemon=True).start()
        port = self.ep.address[1] if role == "producer" else None
        transport = getattr(self.ep.transport, "inner", self.ep.transport)  # under FaultyTransport: the real one
        return {"port": port, "nixl_backend": transport.config.backend}

    def op_fill(self, seed):
        rng = np.random.default_rng(seed)
        size = self.backend.read_bytes().size
        self.backend.write_bytes(rng.integers(0, 256, size, dtype=np.uint8))
        return {}

    def op_poison(self, byte, blocks=None):
        if blocks is None:
            self.backend.write_bytes(np.full(self.backend.read_bytes().size, byte, dtype=np.uint8))
        else:
            for off, length in block_spans(self.backend.layout(), blocks):
                self.backend.write_bytes(np.full(length, byte, dtype=np.uint8), off)
        return {}

    def op_ready(self, tid, attempt, blocks, num_tokens, consumer_tp=None):
        self.ep.kv_ready(tid, attempt, blocks, num_tokens, consumer_tp=consumer_tp)
        return {}

    def op_expect(self, tid, attempt, producer, blocks, num_tokens, first_token=0):
        self.ep.expect(tid, attempt, ProducerIdentity(**producer), blocks, num_tokens, first_token)
        return {}

    def op_decline(self, tid, attempt, producer, reason="test: tail computed here"):
        self.ep.decline(tid, attempt, ProducerIdentity(**producer), reason)
        return {}

    def op_abort(self, tid, attempt, reason="test abort"):
        self.ep.abort(tid, attempt, reason)
        return {}

    def _collector(self):
        """Take results as they come, so their timestamps are the endpoint's, not the driver's."""
        while True:
            with self.lock:
                self._collect()
            time.sleep(0.001)

    def _collect(self):
        for r in self.ep.take_finished():
            if isinstance(r, Release):
                self.results.append({"tid": r.key.transfer_id, "attempt": r.key.attempt,
                                     "outcome": r.outcome.value, "reason": r.reason})
            else:
                self.results.append({"tid": r.key.transfer_id, "attempt": r.key.attempt,
                                     "ok": r.ok, "reason": r.reason})
            self.seen_at[(r.key.transfer_id, r.key.attempt)] = time.monotonic()

    def op_wait(self, n, seconds):
        deadline = time.monotonic() + seconds
        while True:
            with self.lock:
                self._collect()
            if len(self.results) >= n or time.monotonic() >= deadline:
                return {"results": list(self.results)}
            time.sleep(0.005)

    def op_times(self):
        with self.lock:
            self._collect()
        return {"times": [[tid, attempt, t] for (tid, attempt), t in self.seen_at.items()]}

    def op_logical(self, blocks, num_tokens):
        layout = self.backend.layout()
        view = logical_view(self.backend.read_bytes(), layout, self.backend.slab_base, blocks, num_tokens)
        return {"shape": list(view.shape), "data": base64.b64encode(view.tobytes()).decode()}

    def op_dirty_blocks(self, poison):
        """Block ids that hold any byte other than `poison`, in any region."""
        layout = self.backend.layout()
        data = self.backend.read_bytes()
        dirty = {b for b in range(layout.num_blocks)
                 for off, length in block_spans(layout, [b]) if (data[off:off + length] != poison).any()}
        return {"blocks": sorted(dirty)}

    def op_logical_digest(self, blocks, num_tokens):
        layout = self.backend.layout()
        view = logical_view(self.backend.read_bytes(), layout, self.backend.slab_base, blocks, num_tokens)
        return {"sha256": hashlib.sha256(view.tobytes()).hexdigest()}

    def op_results(self):
        with self.lock:
            self._collect()
            return {"results": list(self.results), "times": [[t, a, s] for (t, a), s in self.seen_at.items()]}

    def op_state(self):
        """What the endpoint still holds: live keys, in-flight transfers, peers (with incarnations)."""
        ep = self.ep
        live = len(ep.rendezvous) if hasattr(ep, "rendezvous") else len(ep.completion)
        inflight = len(getattr(ep, "_inflight", ())) + len(getattr(ep, "_reads", ()))
        peers = sorted([k[0], k[1], p.incarnation] for k, p in ep._peers.items())
        return {"live": live, "inflight": inflight, "peers": peers, "outbox": len(ep._outbox)}

    def op_digest(self):
        return {"sha256": hashlib.sha256(self.backend.read_bytes().tobytes()).hexdigest()}

    def op_stats(self):
        counts = {}
        for metric in self.ep.stats.registry.collect():
            for s in metric.samples:
                if s.name.endswith(("_total", "_count")):  # counters, and how often each histogram observed
                    label = (s.labels.get("code") or s.labels.get("reason") or s.labels.get("outcome")
                             or s.labels.get("stage"))
                    counts[s.name + (f"[{label}]" if label else "")] = s.value
        faults = dict(getattr(self.ep.transport, "counts", {}))
        return {"counters": counts, "faults": faults}

    def op_quit(self):
        if self.ep is not None:
            self.ep.close()
        return {}


def main() -> None:
    peer = Peer()
    enc = msgspec.json.Encoder()
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        if not line.strip():
            continue
        cmd = msgspec.json.decode(line)
        op = cmd.pop("op")
        try:
            reply = {"ok": True, **getattr(peer, f"op_{op}")(**cmd)}
        except Exception as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        out.write(enc.encode(reply) + b"\n")
        out.flush()
        if op == "quit":
            break
    os._exit(0)  # skip interpreter teardown: NIXL/UCX exit paths are not what these tests check


if __name__ == "__main__":
    main()
