"""The three ways the benchmark hands KV from the prefill engine to the decode engine.

Each side exposes the hooks an engine loop calls (they must stay cheap in kvpush's modes):
prefill: `kv_ready(req, blocks)` after the step that wrote the KV, `poll()` -> tids whose blocks may
be freed.  decode: `start(req, blocks)` once blocks are allocated, `poll()` -> (tid, ok) whose KV is
usable (or failed).

- push: kvpush endpoints; decode registers at arrival, the producer's worker thread WRITEs.
- kvpush-pull: kvpush endpoints in pull mode; decode registers after the router relays the
  finished prefill, the consumer's worker thread READs (preparation off the engine thread).
- vllm-pull: what vLLM's NixlConnector does: per-block descriptor lists prepared once, and per
  request the decode engine thread builds the index arrays, calls make_prepped_xfer and transfer()
  (where UCX pays per non-contiguous descriptor) and polls check_xfer_state every step; the
  prefill side frees its blocks on the request-id notification.
"""

from __future__ import annotations

import numpy as np

from kvpush_common.plan.blockplan import unit_table
from kvpush_common.endpoint.config import EndpointConfig
from kvpush_common.endpoint.consumer import ConsumerEndpoint
from kvpush_common.protocol.legs import ProducerIdentity
from kvpush_common.endpoint.producer import ProducerEndpoint
from kvpush_common.transport.nixl import NixlTransport, TransportConfig

MODES = ("push", "kvpush-pull", "vllm-pull")
MULTI_RANK_MODES = ("push", "kvpush-pull")  # several ranks per engine (vllm-pull: one rank each)


def endpoint_config(engine_id: str, mode: str, poll_s: float, ranks: dict | None = None) -> EndpointConfig:
    """`ranks`: this rank's place in its engine (rank, tp_size, total_kv_heads, and base_port for
    producer ranks after the first)."""
    return EndpointConfig(engine_id=engine_id, mode="push" if mode == "push" else "pull", model="qwen3-32b-bench",
                          poll_s=poll_s, write_timeout_s=60.0, transfer_timeout_s=300.0, **(ranks or {}))


class KvpushPrefill:
    def __init__(self, slab, mode: str, poll_s: float, ranks: dict | None = None):
        self.ep = ProducerEndpoint(endpoint_config("P", mode, poll_s, ranks), slab.backend).start()

    def hello(self) -> dict:
        host, port = self.ep.address
        return {"host": host, "port": port}

    def kv_ready(self, tid: str, blocks: list[int], tokens: int) -> None:
        self.ep.kv_ready(tid, 0, blocks, tokens)

    def poll(self) -> list[str]:
        return [r.key.transfer_id for r in self.ep.take_finished()]

    def close(self) -> None:
        self.ep.close()


class KvpushDecode:
    def __init__(self, slab, mode: str, poll_s: float, prefill_hello: dict, ranks: dict | None = None):
        p_tp = prefill_hello.get("tp", 1)
        self.ep = ConsumerEndpoint(endpoint_config("D", mode, poll_s, ranks), slab.backend).start()
        self.ref = ProducerIdentity(engine_id="P", host=prefill_hello["host"], port=prefill_hello["port"], tp_size=p_tp)

    def start(self, tid: str, blocks: list[int], tokens: int, remote_blocks=None) -> None:
        self.ep.expect(tid, 0, self.ref, blocks, tokens)

    def poll(self) -> list[tuple[str, bool, str]]:
        return [(r.key.transfer_id, r.ok, r.reason) for r in self.ep.take_finished()]

    def close(self) -> None:
        self.ep.close()


class VllmPullPrefill:
    """Source side of vLLM-style pull: blocks stay held until the decode's request-id notification."""

    def __init__(self, slab, mode: str, poll_s: float, ranks: dict | None = None):
        slab.backend.bind_thread()
        self.layout = slab.backend.layout()
        self.nixl = NixlTransport("P-vllm", TransportConfig(), progress_thread=False)
        self.nixl.register(slab.backend.registration_regions(), self.layout.mem_type)

    def hello(self) -> dict:
        import msgspec

        return {"agent": self.nixl.metadata(), "layout": msgspec.msgpack.encode(self.layout)}

    def kv_ready(self, tid: str, blocks: list[int], tokens: int) -> None:
        pass  # the engine keeps the blocks until poll() returns the tid

    def poll(self) -> list[str]:
        return [m.decode() for msgs in self.nixl.get_notifs().values() for m in msgs]

    def close(self) -> None:
        self.nixl.close()


class VllmPullDecode:
    def __init__(self, slab, mode: str, poll_s: float, prefill_hello: dict, ranks: dict | None = None):
        import msgspec

        from kvpush_common.protocol.layout import KVLayout

        slab.backend.bind_thread()
        self.layout = slab.backend.layout()
        remote = msgspec.msgpack.decode(prefill_hello["layout"], type=KVLayout)
        # vLLM's agent runs NIXL's progress thread; the engine thread posts and polls
        self.nixl = NixlTransport("D-vllm", TransportConfig(), progress_thread=True)
        self.nixl.register(slab.backend.registration_regions(), self.layout.mem_type)
        self.peer = self.nixl.add_peer(prefill_hello["agent"])
        self.local = self.nixl.prep(None, unit_table(self.layout, 0, self.layout.num_heads), self.layout.mem_type)
        self.remote = self.nixl.prep(self.peer, unit_table(remote, 0, remote.num_heads), remote.mem_type)
        self.regions = np.arange(len(self.layout.regions), dtype=np.int64)[:, None]
        self.nb_local, self.nb_remote = self.layout.num_blocks, remote.num_blocks
        self.inflight: dict[str, object] = {}

    def start(self, tid: str, blocks: list[int], tokens: int, remote_blocks=None) -> None:
        """vLLM's start_load_kv on the engine thread: descriptor ids, make_prepped_xfer, transfer()."""
        n = len(remote_blocks)
        lidx = (self.regions * self.nb_local + np.asarray(blocks[:n])[None, :]).ravel().astype(np.int32)
        ridx = (self.regions * self.nb_remote + np.asarray(remote_blocks)[None, :]).ravel().astype(np.int32)
        self.inflight[tid] = self.nixl.post_prepped("READ", self.local, lidx, self.remote, ridx, tid.encode())

    def poll(self) -> list[tuple[str, bool, str]]:
        out = []
        for tid, handle in list(self.inflight.items()):
            state = self.nixl.state(handle)
            if state != "PROC":
                self.nixl.release(handle)
                del self.inflight[tid]
                out.append((tid, state == "DONE", "" if state == "DONE" else "READ failed"))
        return out

    def close(self) -> None:
        self.nixl.close()


def prefill_side(mode: str):
    return VllmPullPrefill if mode == "vllm-pull" else KvpushPrefill


def decode_side(mode: str):
    return VllmPullDecode if mode == "vllm-pull" else KvpushDecode
