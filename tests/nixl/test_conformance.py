"""Backend conformance suite: push scenarios end to end over real NIXL (UCX, 127.0.0.1), producer
and consumer ranks in separate OS processes, every destination byte verified.

A device backend joins by adding its name to BACKENDS (and teaching kvpush_common.testing.peer_proc to build
it); the scenarios do not change.
"""

from __future__ import annotations

import base64
import os
import time

import numpy as np
import pytest

from kvpush_common.testing.procs import PeerError, PeerProcess
from kvpush_common.testing.vllm_cluster import free_port

BACKENDS = ["host", pytest.param("cuda", marks=pytest.mark.gpu), "neuron-sim"]
NIXL_BACKEND = os.environ.get("KVPUSH_TEST_NIXL_BACKEND", "UCX")  # tests/libfabric sets LIBFABRIC
POISON = 0xAB
GEO = dict(num_layers=2, head_dim=8, dtype="bfloat16", dtype_size=2)


def gpu_for_rank(gpus: int, consumer: bool, rank: int, p_tp: int, d_tp: int) -> int:
    if gpus >= p_tp + d_tp:
        return p_tp + rank if consumer else rank
    return 1 if consumer and gpus > 1 else 0


def test_each_rank_gets_its_own_gpu_when_there_are_enough():
    assert [gpu_for_rank(4, False, r, 2, 2) for r in range(2)] == [0, 1]
    assert [gpu_for_rank(4, True, r, 2, 2) for r in range(2)] == [2, 3]
    assert [gpu_for_rank(4, True, r, 1, 2) for r in range(2)] == [1, 2]
    assert [gpu_for_rank(2, c, r, 2, 2) for c in (False, True) for r in range(2)] == [0, 0, 1, 1]
    assert gpu_for_rank(2, True, 0, 1, 1) == 1 and gpu_for_rank(1, True, 0, 1, 1) == 0


@pytest.fixture(params=BACKENDS)
def backend_kind(request):
    return request.param


class Cluster:
    """Producer ranks and consumer ranks of one scenario, each its own process."""

    def __init__(self, kind: str, consumer_kind: str | None = None):
        self.kind = kind
        self.consumer_kind = consumer_kind or kind  # a mixed pair: e.g. Neuron layout into a host or CUDA one
        self.procs: list[PeerProcess] = []
        self.producers: list[PeerProcess] = []
        self.consumers: list[PeerProcess] = []
        self.p_port = 0
        self.p_tp = 1

    def _device(self, consumer: bool, rank: int, p_tp: int, d_tp: int) -> dict:
        """CUDA: one GPU per rank when there are enough (producer ranks first, then consumer ranks: the
        four-GPU runs of heterogeneous TP); else producers on GPU 0 and consumers on GPU 1 when there
        are two (VRAM to VRAM across GPUs)."""
        if (self.consumer_kind if consumer else self.kind) != "cuda":
            return {}
        import torch

        return {"device": gpu_for_rank(torch.cuda.device_count(), consumer, rank, p_tp, d_tp)}

    def _spawn(self, name):
        proc = PeerProcess(name)
        self.procs.append(proc)
        return proc

    def start(self, *, total_heads=2, p_tp=1, d_tp=1, p_block=16, d_block=16, p_order="HND", d_order="HND",
              p_blocks_first=False, d_blocks_first=False, num_blocks=32, p_cfg=None, d_cfg=None,
              p_faults=None, d_faults=None, d_agent_first=None, p_cross_layer=False, d_cross_layer=False,
              p_geo=None, d_geo=None):
        from kvpush_common.protocol.topology import local_heads

        self.p_tp = p_tp
        if NIXL_BACKEND != "UCX":  # the libfabric tier runs this module again with LIBFABRIC
            p_cfg = {"transport": {"backend": NIXL_BACKEND}, **(p_cfg or {})}
            d_cfg = {"transport": {"backend": NIXL_BACKEND}, **(d_cfg or {})}
        procs = []
        for r in range(p_tp):
            proc = self._spawn(f"P{r}")
            self.producers.append(proc)
            procs.append(proc)
        for r in range(d_tp):
            proc = self._spawn(f"D{r}")
            self.consumers.append(proc)
            procs.append(proc)
        # Producer ranks serve consecutive side-channel ports: one block below the ephemeral range, chosen
        # before any rank binds (rank 0's bind(0) port as the base lost base+1 to an outgoing connection once).
        self.p_port = free_port(span=p_tp) if p_tp > 1 else 0
        for r, proc in enumerate(self.producers):
            first, count = local_heads(total_heads, p_tp, r)
            cfg = dict(engine_id="P", rank=r, tp_size=p_tp, total_kv_heads=total_heads, **(p_cfg or {}))
            if self.p_port:
                cfg["base_port"] = self.p_port
            reply = proc.call("start", role="producer", cfg=cfg, faults=p_faults,
                              backend=dict(kind=self.kind, num_heads=count, head_offset=first, block_size=p_block,
                                           num_blocks=num_blocks, order=p_order, blocks_first=p_blocks_first,
                                           **(p_geo or GEO),
                                           **({"cross_layer": True} if p_cross_layer else {}),
                                           **self._device(False, r, p_tp, d_tp)))
            assert reply["nixl_backend"] == NIXL_BACKEND  # the agent really runs the backend under test
            if r == 0:
                self.p_port = reply["port"]  # rank r serves on base_port + r
            proc.call("fill", seed=100 + r)
        for r, proc in enumerate(self.consumers):
            first, count = local_heads(total_heads, d_tp, r)
            cfg = dict(engine_id="D", rank=r, tp_size=d_tp, total_kv_heads=total_heads, **(d_cfg or {}))
            reply = proc.call("start", role="consumer", cfg=cfg, faults=d_faults, agent_first=d_agent_first,
                      backend=dict(kind=self.consumer_kind, num_heads=count, head_offset=first, block_size=d_block,
                                   num_blocks=num_blocks, order=d_order, blocks_first=d_blocks_first,
                                   **(d_geo or GEO),
                                   **({"cross_layer": True} if d_cross_layer else {}),
                                   **self._device(True, r, p_tp, d_tp)))
            assert reply["nixl_backend"] == NIXL_BACKEND
            proc.call("poison", byte=POISON)
        return self

    def producer_ref(self):
        return dict(engine_id="P", host="127.0.0.1", port=self.p_port, tp_size=self.p_tp)

    def expect(self, tid, attempt, blocks, num_tokens, first_token=0, ranks=None):
        for r, proc in enumerate(self.consumers):
            if ranks is None or r in ranks:
                proc.call("expect", tid=tid, attempt=attempt, producer=self.producer_ref(), blocks=blocks,
                          num_tokens=num_tokens, first_token=first_token)

    def ready(self, tid, attempt, blocks, num_tokens):
        for proc in self.producers:
            proc.call("ready", tid=tid, attempt=attempt, blocks=blocks, num_tokens=num_tokens)

    def close(self):
        for proc in self.procs:
            proc.close()


def wait(proc: PeerProcess, n: int, seconds: float = 20.0) -> list[dict]:
    return proc.call("wait", n=n, seconds=seconds, timeout=seconds + 30)["results"]


def logical(proc: PeerProcess, blocks, num_tokens) -> np.ndarray:
    r = proc.call("logical", blocks=blocks, num_tokens=num_tokens)
    return np.frombuffer(base64.b64decode(r["data"]), dtype=np.uint8).reshape(r["shape"])


def assert_copied(cl: Cluster, p_blocks, d_blocks, num_tokens, first_token=0):
    """Consumer ranks' logical KV == producer ranks' logical KV (heads gathered/split by TP)."""
    src = np.concatenate([logical(p, p_blocks, num_tokens) for p in cl.producers], axis=2)
    dst = np.concatenate([logical(d, d_blocks, num_tokens - first_token) for d in cl.consumers], axis=2)
    total_heads = dst.shape[2]
    assert src.shape[2] == total_heads  # no replication in these scenarios
    np.testing.assert_array_equal(dst, src[:, first_token:])


def dirty(proc: PeerProcess) -> list[int]:
    return proc.call("dirty_blocks", poison=POISON)["blocks"]


@pytest.fixture
def cluster(backend_kind):
    cl = Cluster(backend_kind)
    yield cl
    cl.close()


# How the producer posts a WRITE: from the per-peer prepped lists (same block geometry), or, when preparing the
# consumer's list failed, from per-request merged lists (the path every other geometry takes)
PATHS = {"prepped": {}, "merged": {"fail_prep": True}}

MIXED = [("neuron-sim", "host"), pytest.param("neuron-sim", "cuda", marks=pytest.mark.gpu), ("host", "neuron-sim"),
         pytest.param("cuda", "neuron-sim", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("p_kind,d_kind", MIXED, ids=lambda k: k)
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2)])
def test_mixed_device_pair_moves_the_same_bytes(p_kind, d_kind, p_tp, d_tp):
    """A Neuron-layout side (the plugin's (2, blocks, heads, 32, dim) planes, block size 32) paired with a
    host or CUDA side in its own layout (block size 16, NHD token-major, blocks first), across TP splits:
    every consumer head's bytes equal the producer's, nothing outside the destination blocks is touched."""
    cl = Cluster(p_kind, d_kind)
    try:
        p_block, d_block = (32, 16) if p_kind == "neuron-sim" else (16, 32)
        cl.start(total_heads=2, p_tp=p_tp, d_tp=d_tp, p_block=p_block, d_block=d_block, p_order="NHD",
                 d_order="NHD", p_blocks_first=True, d_blocks_first=True)
        n = 150
        p_blocks = list(range(31, 31 - (-(-n // p_block)), -1))
        d_blocks = [7, 3, 11, 0, 30, 18, 22, 25, 12, 9][: -(-n // d_block)]
        cl.expect("mix", 0, d_blocks, n)
        cl.ready("mix", 0, p_blocks, n)
        for d in cl.consumers:
            assert wait(d, 1)[0]["ok"] is True
        assert_copied(cl, p_blocks, d_blocks, n)
        for d in cl.consumers:
            assert set(dirty(d)) == set(d_blocks)
    finally:
        cl.close()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("order", ["registration_first", "ready_first"])
def test_push_either_order(cluster, order, path):
    """Prepped per-block lists (same geometry) and per-request merged lists give the same bytes."""
    cl = cluster.start(p_faults=PATHS[path])
    p_blocks, d_blocks, n = [3, 4, 9, 10], [20, 21, 7, 1], 57
    if order == "registration_first":
        cl.expect("r1", 0, d_blocks, n)
        time.sleep(0.3)
        assert dirty(cl.consumers[0]) == []
        cl.ready("r1", 0, p_blocks, n)
    else:
        cl.ready("r1", 0, p_blocks, n)
        time.sleep(0.3)
        cl.expect("r1", 0, d_blocks, n)
    assert wait(cl.consumers[0], 1) == [{"tid": "r1", "attempt": 0, "ok": True, "reason": ""}]
    assert wait(cl.producers[0], 1)[0]["outcome"] == "done"
    assert_copied(cl, p_blocks, d_blocks, n)
    assert set(dirty(cl.consumers[0])) == set(d_blocks)  # nothing outside the destination blocks
    counters = cl.producers[0].call("stats")["counters"]
    assert counters["kvpush_writes_prepped_total"] == (1 if path == "prepped" else 0)
    # where the time from KV ready to the posted WRITE went (issue 15): each stage timed once for this one WRITE
    for stage in ("wake", "fence", "plan", "post"):
        assert counters[f"kvpush_write_stage_seconds_count[{stage}]"] == 1, (stage, counters)


@pytest.mark.parametrize("path", PATHS)
def test_two_producer_ranks_into_one_consumer(cluster, path):
    """P TP=2 (one head each) -> D TP=1 (both heads): D is ready only after both ranks wrote."""
    cl = cluster.start(total_heads=2, p_tp=2, d_tp=1, p_faults=PATHS[path])
    p_blocks, d_blocks, n = [0, 1, 2], [5, 9, 13], 40
    cl.expect("tp", 0, d_blocks, n)
    cl.producers[0].call("ready", tid="tp", attempt=0, blocks=p_blocks, num_tokens=n)
    time.sleep(0.5)
    assert wait(cl.consumers[0], 1, seconds=0.2) == []  # one rank done is not enough
    cl.producers[1].call("ready", tid="tp", attempt=0, blocks=p_blocks, num_tokens=n)
    assert wait(cl.consumers[0], 1)[0]["ok"] is True
    for p in cl.producers:
        assert wait(p, 1)[0]["outcome"] == "done"
    assert_copied(cl, p_blocks, d_blocks, n)


@pytest.mark.parametrize("heads,p_tp,d_tp", [(2, 4, 2), (2, 4, 4), (1, 2, 1), (2, 1, 4)],
                         ids=["P-replicates-D-fewer", "both-replicate", "one-head", "D-replicates"])
def test_head_replication_in_every_direction(cluster, heads, p_tp, d_tp):
    """Prefill or decode TP above the model's KV heads (replicated heads): every consumer head comes from a
    producer rank holding it, and a producer rank no consumer rank reads from (told the decode TP, as the
    router does) releases its KV at once instead of at the lease end (issue 16 item 1)."""
    from kvpush_common.protocol.topology import routes_from

    cl = cluster.start(total_heads=heads, p_tp=p_tp, d_tp=d_tp)
    p_blocks, d_blocks, n = [3, 4, 9], [20, 7, 1], 40
    cl.expect("rep", 0, d_blocks, n)
    t0 = time.monotonic()
    for p in cl.producers:
        p.call("ready", tid="rep", attempt=0, blocks=p_blocks, num_tokens=n, consumer_tp=d_tp)
    for d in cl.consumers:
        assert wait(d, 1)[0]["ok"] is True
    for r, p in enumerate(cl.producers):
        [res] = wait(p, 1)
        assert res["outcome"] == "done", (r, res)
    assert time.monotonic() - t0 < 10.0  # no rank waited for its lease (30 s)
    for r, p in enumerate(cl.producers):
        src = logical(p, p_blocks, n)
        for route in routes_from(heads, p_tp, d_tp, r):
            dst = logical(cl.consumers[route.dst_rank], d_blocks, n)
            np.testing.assert_array_equal(dst[:, :, route.dst_head_start:route.dst_head_start + route.num_heads],
                                          src[:, :, route.src_head_start:route.src_head_start + route.num_heads])
    unread = [r for r in range(p_tp) if not routes_from(heads, p_tp, d_tp, r)]
    assert bool(unread) == (p_tp > d_tp), unread  # the cases that leave ranks unread have them


@pytest.mark.parametrize("path", PATHS)
def test_one_producer_rank_into_two_consumer_ranks(cluster, path):
    """P TP=1 (two heads) -> D TP=2 (one head each): the producer splits heads across ranks."""
    cl = cluster.start(total_heads=2, p_tp=1, d_tp=2, p_faults=PATHS[path])
    p_blocks, d_blocks, n = [4, 5], [30, 2], 32
    cl.ready("split", 0, p_blocks, n)
    cl.expect("split", 0, d_blocks, n)
    for d in cl.consumers:
        assert wait(d, 1)[0]["ok"] is True
    assert wait(cl.producers[0], 1)[0]["outcome"] == "done"
    assert_copied(cl, p_blocks, d_blocks, n)


@pytest.mark.parametrize("path", PATHS)
def test_two_producer_ranks_into_two_consumer_ranks(cluster, path):
    """P TP=2 -> D TP=2 (two heads per rank): rank r writes only into consumer rank r, every
    consumer rank is ready only after its own producer rank wrote."""
    cl = cluster.start(total_heads=4, p_tp=2, d_tp=2, p_faults=PATHS[path])
    p_blocks, d_blocks, n = [7, 1, 2, 3], [0, 11, 12, 20], 60
    cl.expect("tp22", 0, d_blocks, n)
    cl.producers[1].call("ready", tid="tp22", attempt=0, blocks=p_blocks, num_tokens=n)
    assert wait(cl.consumers[1], 1)[0]["ok"] is True
    assert wait(cl.consumers[0], 1, seconds=0.3) == []  # rank 0's producer has not written yet
    cl.producers[0].call("ready", tid="tp22", attempt=0, blocks=p_blocks, num_tokens=n)
    assert wait(cl.consumers[0], 1)[0]["ok"] is True
    for p in cl.producers:
        assert wait(p, 1)[0]["outcome"] == "done"
    assert_copied(cl, p_blocks, d_blocks, n)
    for d in cl.consumers:
        assert set(dirty(d)) == set(d_blocks)


@pytest.mark.parametrize("p_block,d_block,p_order,d_order", [
    (32, 16, "HND", "HND"), (16, 32, "HND", "NHD"), (16, 128, "NHD", "HND"), (16, 16, "NHD", "HND"),
])
def test_different_block_sizes_and_orders(cluster, p_block, d_block, p_order, d_order):
    cl = cluster.start(p_block=p_block, d_block=d_block, p_order=p_order, d_order=d_order, d_blocks_first=True)
    n = 150
    p_blocks = list(range(31, 31 - (-(-n // p_block)), -1))
    d_blocks = [7, 3, 11, 0, 30, 18, 22, 25, 12, 9][: -(-n // d_block)]
    cl.expect("bs", 0, d_blocks, n)
    cl.ready("bs", 0, p_blocks, n)
    assert wait(cl.consumers[0], 1)[0]["ok"] is True
    assert_copied(cl, p_blocks, d_blocks, n)
    assert set(dirty(cl.consumers[0])) == set(d_blocks)


@pytest.mark.parametrize("path", PATHS)
def test_partial_prefix_hit_writes_only_the_tail(cluster, path):
    """The consumer holds the first 2 blocks already and registers the tail from token 32."""
    cl = cluster.start(p_faults=PATHS[path])
    p_blocks, n = [1, 2, 3, 4], 60
    cl.expect("pfx", 0, [10, 11], n, first_token=32)
    cl.ready("pfx", 0, p_blocks, n)
    assert wait(cl.consumers[0], 1)[0]["ok"] is True
    assert_copied(cl, p_blocks, [10, 11], n, first_token=32)
    assert set(dirty(cl.consumers[0])) == {10, 11}


def test_stale_attempt_is_never_paired(cluster):
    cl = cluster.start()
    d_blocks, n = [5, 6], 20
    cl.expect("retry", 1, d_blocks, n)  # the consumer is on attempt 1
    time.sleep(0.3)
    cl.ready("retry", 0, [1, 2], n)  # old execution's KV arrives late
    res = wait(cl.producers[0], 1)
    assert res[0]["attempt"] == 0 and res[0]["outcome"] == "failed" and "stale" in res[0]["reason"]
    assert dirty(cl.consumers[0]) == []  # nothing written from attempt 0
    cl.ready("retry", 1, [3, 4], n)
    got = wait(cl.consumers[0], 1)
    assert got[0]["attempt"] == 1 and got[0]["ok"] is True
    assert_copied(cl, [3, 4], d_blocks, n)
    # and a registration from an older attempt is refused outright
    cl.expect("retry", 0, [8], 10)
    late = wait(cl.consumers[0], 2)[1]
    assert late["attempt"] == 0 and late["ok"] is False


def test_out_of_range_registration_gets_write_failed(cluster):
    cl = cluster.start(num_blocks=32)
    cl.ready("oob", 0, [1], 10)
    cl.expect("oob", 0, [31 + 5], 10)  # beyond the consumer's own 32 blocks
    res = wait(cl.consumers[0], 1)[0]
    assert res["ok"] is False and "bad_registration" in res["reason"]
    assert wait(cl.producers[0], 1)[0]["outcome"] == "failed"
    assert dirty(cl.consumers[0]) == []


def test_failed_post_sends_write_failed(cluster):
    cl = cluster.start(p_faults=dict(fail_post=1.0))
    cl.expect("fp", 0, [2, 3], 20)
    cl.ready("fp", 0, [2, 3], 20)
    res = wait(cl.consumers[0], 1)[0]
    assert res["ok"] is False and "post_failed" in res["reason"]
    assert wait(cl.producers[0], 1)[0]["outcome"] == "failed"


def test_revoke_during_inflight_write_never_touches_freed_blocks(cluster):
    """The consumer aborts while the WRITE is in flight (held 1.5 s): it may free its blocks only
    after the producer's acknowledgement, which comes after the WRITE ended."""
    cl = cluster.start(p_faults=dict(post_delay_s=1.5))
    d_blocks, n = [4, 5, 6], 40
    cl.expect("rv", 0, d_blocks, n)
    cl.ready("rv", 0, [7, 8, 9], n)
    time.sleep(0.4)  # the WRITE is posted and held
    t0 = time.monotonic()
    cl.consumers[0].call("abort", tid="rv", attempt=0)
    res = wait(cl.consumers[0], 1)
    freed_after = time.monotonic() - t0
    assert res[0]["ok"] is False
    assert freed_after > 0.8, "blocks were handed back while the WRITE could still land"
    # The engine now reuses the blocks: poison them, give any straggling WRITE time, check.
    cl.consumers[0].call("poison", byte=POISON, blocks=d_blocks)
    time.sleep(1.0)
    assert dirty(cl.consumers[0]) == []
    assert wait(cl.producers[0], 1)[0]["outcome"] in ("cancelled", "done")


def test_registration_expires_without_heartbeats(cluster):
    """The producer never hears the consumer's heartbeats: the registration's TTL runs out there and the
    consumer is told (WriteFailed "expired") long before its own transfer timeout."""
    fast = dict(reg_ttl_s=1.0, heartbeat_s=0.4, lease_s=1.0, write_timeout_s=1.0)
    cl = cluster.start(p_cfg=fast, d_cfg=dict(fast, transfer_timeout_s=30.0),
                       p_faults=dict(drop_notif=1.0, match_tag="hb"))
    t0 = time.monotonic()
    cl.expect("never", 0, [1], 10)
    res = wait(cl.consumers[0], 1, seconds=15)
    assert res[0]["ok"] is False and "expired" in res[0]["reason"]
    assert time.monotonic() - t0 < 10
    assert cl.producers[0].call("stats")["faults"]["drop"] >= 1


def test_consumer_gives_up_after_transfer_timeout(cluster):
    fast = dict(reg_ttl_s=1.0, transfer_timeout_s=2.0, heartbeat_s=0.4, lease_s=1.0, write_timeout_s=1.0)
    cl = cluster.start(p_cfg=fast, d_cfg=fast)
    cl.expect("never", 0, [1], 10)
    res = wait(cl.consumers[0], 1, seconds=15)
    assert res and res[0]["ok"] is False and "timed out" in res[0]["reason"]


def test_ready_kv_released_when_lease_expires(cluster):
    cl = cluster.start(p_cfg=dict(lease_s=1.0, reg_ttl_s=1.0, heartbeat_s=0.4))
    cl.ready("orphan", 0, [1, 2], 20)
    res = wait(cl.producers[0], 1, seconds=10)
    assert res[0]["outcome"] == "expired"


@pytest.mark.parametrize("order", ["declined_first", "ready_first"])
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (1, 2), (2, 1)])
def test_unneeded_kv_is_released_at_once_not_at_the_lease_end(cluster, order, p_tp, d_tp):
    """The decode computes a short tail itself (issue 14 item 1): every consumer rank tells the producer
    ranks it reads from; each releases its KV as `unneeded` as soon as it is ready (lease 30 s here), a
    later attempt of the same transfer still pairs normally, and nothing lands in the consumer."""
    cl = cluster.start(total_heads=2, p_tp=p_tp, d_tp=d_tp, p_cfg=dict(lease_s=30.0))

    def decline():
        for d in cl.consumers:
            d.call("decline", tid="turn2", attempt=0, producer=cl.producer_ref())

    t0 = time.monotonic()
    if order == "declined_first":
        decline()
        time.sleep(0.5)  # the Unneeded messages are in before the KV is ready
        cl.ready("turn2", 0, [1, 2], 20)
    else:
        cl.ready("turn2", 0, [1, 2], 20)
        time.sleep(0.3)
        decline()
    for p in cl.producers:
        res = wait(p, 1)
        assert res[0]["outcome"] == "unneeded" and "tail computed here" in res[0]["reason"], res
    assert time.monotonic() - t0 < 10  # not the 30 s lease
    for d in cl.consumers:
        assert d.call("stats")["counters"]["kvpush_requests_declined_total"] == 1
        assert wait(d, 1, seconds=0.2) == []  # nothing to report to the engine: it registered nothing
    assert all(dirty(d) == [] for d in cl.consumers)
    cl.expect("turn2", 1, [3, 4], 20)  # a retry of the transfer (a new attempt) is served as usual
    cl.ready("turn2", 1, [1, 2], 20)
    for d in cl.consumers:
        assert wait(d, 1)[0]["ok"] is True


def test_lost_completion_notification_fails_cleanly(cluster):
    """WriteDone is dropped: the consumer times out, revokes, and ends; never hangs."""
    fast = dict(transfer_timeout_s=2.0, heartbeat_s=0.4, reg_ttl_s=1.0, lease_s=1.0, write_timeout_s=1.0)
    cl = cluster.start(p_cfg=fast, d_cfg=fast, d_faults=dict(drop_notif=1.0))
    cl.expect("lost", 0, [1], 10)
    cl.ready("lost", 0, [1], 10)
    res = wait(cl.consumers[0], 1, seconds=15)
    assert res[0]["ok"] is False and "timed out" in res[0]["reason"]


@pytest.mark.parametrize("kind", ["neuron-sim"])
@pytest.mark.parametrize("agent_first", ["kvpush", "other"])
def test_libfabric_started_before_the_neuron_runtime_is_refused(kind, agent_first):
    """libfabric started in a worker (a NIXL agent with LIBFABRIC, kvpush's or another component's) before
    the Neuron runtime was initialised registers HBM as host memory without an error: the connector must
    refuse to start, naming it.  Over UCX libfabric is never started, and the same order works."""
    cl = Cluster(kind)
    try:
        if NIXL_BACKEND == "LIBFABRIC":
            with pytest.raises(PeerError, match="FI_HMEM_SYSTEM"):
                cl.start(d_agent_first=agent_first)
        else:
            cl.start(d_agent_first=agent_first)
            cl.expect("order", 0, [3], 16)
            cl.ready("order", 0, [4], 16)
            assert wait(cl.consumers[0], 1)[0]["ok"] is True
            assert_copied(cl, [4], [3], 16)
    finally:
        cl.close()


def test_hmac_on_both_sides(cluster):
    cl = cluster.start(p_cfg=dict(secret="s3cret"), d_cfg=dict(secret="s3cret"))
    cl.expect("mac", 0, [3], 16)
    cl.ready("mac", 0, [4], 16)
    assert wait(cl.consumers[0], 1)[0]["ok"] is True
    assert_copied(cl, [4], [3], 16)


@pytest.mark.parametrize("p_cfg,d_cfg,needle", [
    (dict(secret="one"), dict(secret="two"), "handshake"),
    (dict(mode="pull"), dict(), "mode mismatch"),
    (dict(model="a"), dict(model="b"), "compatibility hash"),
    (dict(write_timeout_s=60.0), dict(write_timeout_s=30.0), "write_timeout_s"),
])
def test_incompatible_peers_fail_fast(cluster, p_cfg, d_cfg, needle):
    cl = cluster.start(p_cfg=p_cfg, d_cfg=d_cfg)
    t0 = time.monotonic()
    cl.expect("bad", 0, [1], 10)
    res = wait(cl.consumers[0], 1, seconds=15)
    assert res[0]["ok"] is False and needle in res[0]["reason"]
    assert time.monotonic() - t0 < 10
    assert dirty(cl.consumers[0]) == []


def test_heartbeats_keep_a_long_prefill_alive(cluster):
    """Registration TTL 1 s, prefill takes 3 s: the consumer's heartbeats renew the registration."""
    cfg = dict(reg_ttl_s=1.0, lease_s=1.0, heartbeat_s=0.25, write_timeout_s=2.0)
    cl = cluster.start(p_cfg=cfg, d_cfg=cfg)
    cl.expect("long", 0, [2, 3], 30)
    time.sleep(3.0)
    cl.ready("long", 0, [5, 6], 30)
    assert wait(cl.consumers[0], 1)[0]["ok"] is True
    assert_copied(cl, [5, 6], [2, 3], 30)


def test_consumer_abort_before_kv_ready_frees_fast_and_nothing_lands(cluster):
    cl = cluster.start()
    cl.expect("early", 0, [8, 9], 20)
    time.sleep(0.3)
    t0 = time.monotonic()
    cl.consumers[0].call("abort", tid="early", attempt=0)
    res = wait(cl.consumers[0], 1)
    assert res[0]["ok"] is False and time.monotonic() - t0 < 3  # acked, not the fence wait
    cl.ready("early", 0, [1, 2], 20)  # the prefill finishes afterwards
    assert wait(cl.producers[0], 1)[0]["outcome"] in ("failed", "cancelled")
    time.sleep(0.3)
    assert dirty(cl.consumers[0]) == []


def test_producer_abort_tells_the_consumer(cluster):
    cl = cluster.start()
    cl.expect("pab", 0, [4], 10)
    time.sleep(0.3)
    cl.producers[0].call("abort", tid="pab", attempt=0, reason="prefill aborted")
    res = wait(cl.consumers[0], 1)[0]
    assert res["ok"] is False and "prefill aborted" in res["reason"]
    assert dirty(cl.consumers[0]) == []


def test_full_prefix_hit_needs_no_bytes(cluster):
    """The consumer already caches every token: it registers nothing to write and is done at once."""
    cl = cluster.start()
    cl.expect("hit", 0, [], 32, first_token=32)
    cl.ready("hit", 0, [1, 2], 32)
    assert wait(cl.consumers[0], 1)[0]["ok"] is True
    assert wait(cl.producers[0], 1)[0]["outcome"] == "done"
    assert dirty(cl.consumers[0]) == []


def test_duplicated_delayed_reordered_notifications(cluster):
    """Both sides receive duplicates, delays and reorderings: every request still ends exactly once, with
    the right bytes."""
    noisy = dict(seed=7, dup_notif=0.4, delay_notif=0.3, delay_s=(0.05, 0.4), reorder_notif=0.3)
    cl = cluster.start(p_faults=noisy, d_faults={**noisy, "seed": 8}, num_blocks=64)
    reqs = [(f"n{i}", [2 * i, 2 * i + 1], [63 - 2 * i, 62 - 2 * i], 20 + i) for i in range(8)]
    for i, (tid, pb, db, n) in enumerate(reqs):
        if i % 2:
            cl.expect(tid, 0, db, n)
            cl.ready(tid, 0, pb, n)
        else:
            cl.ready(tid, 0, pb, n)
            cl.expect(tid, 0, db, n)
    got = wait(cl.consumers[0], len(reqs), seconds=30)
    assert sorted(r["tid"] for r in got) == sorted(t for t, *_ in reqs)  # each exactly once
    assert all(r["ok"] for r in got), got
    for tid, pb, db, n in reqs:
        assert_copied(cl, pb, db, n)
    time.sleep(0.5)
    assert len(wait(cl.consumers[0], len(reqs) + 1, seconds=0.5)) == len(reqs)  # no late duplicates
    faults = cl.consumers[0].call("stats")["faults"]
    assert faults.get("dup", 0) + faults.get("delay", 0) + faults.get("reorder", 0) > 0


def test_write_ending_in_err_sends_write_failed(cluster):
    cl = cluster.start(p_faults=dict(err_xfer=1.0))
    cl.expect("err", 0, [2], 10)
    cl.ready("err", 0, [3], 10)
    res = wait(cl.consumers[0], 1)[0]
    assert res["ok"] is False and "write_error" in res["reason"]
    assert wait(cl.producers[0], 1)[0]["outcome"] == "failed"


def test_token_count_mismatch_is_refused(cluster):
    cl = cluster.start()
    cl.expect("tok", 0, [2, 3], 30)
    cl.ready("tok", 0, [4, 5], 20)
    res = wait(cl.consumers[0], 1)[0]
    assert res["ok"] is False and "token_mismatch" in res["reason"]
    assert dirty(cl.consumers[0]) == []


def test_handshake_timeout_fails_the_request(cluster):
    import socket

    cl = cluster.start(d_cfg=dict(handshake_timeout_s=1.0))
    with socket.socket() as s:  # a port with nobody behind it
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    t0 = time.monotonic()
    cl.consumers[0].call("expect", tid="hs", attempt=0, blocks=[1], num_tokens=10,
                         producer=dict(engine_id="P", host="127.0.0.1", port=dead_port, tp_size=1))
    res = wait(cl.consumers[0], 1, seconds=15)[0]
    assert res["ok"] is False and "handshake" in res["reason"]
    assert time.monotonic() - t0 < 8


# ---- pull mode: the consumer READs after a ReadGrant; the producer keeps its blocks pinned till then ----

PULL = {"mode": "pull"}


@pytest.mark.parametrize("order", ["registration_first", "ready_first"])
def test_pull_either_order(cluster, order):
    cl = cluster.start(p_cfg=PULL, d_cfg=PULL)
    p_blocks, d_blocks, n = [3, 4, 9], [20, 21, 7], 40
    if order == "registration_first":
        cl.expect("pr", 0, d_blocks, n)
        time.sleep(0.3)
        cl.ready("pr", 0, p_blocks, n)
    else:
        cl.ready("pr", 0, p_blocks, n)
        time.sleep(0.3)  # late destination choice: the KV waits under its lease
        cl.expect("pr", 0, d_blocks, n)
    assert wait(cl.consumers[0], 1)[0]["ok"] is True
    assert wait(cl.producers[0], 1)[0]["outcome"] == "done"
    assert_copied(cl, p_blocks, d_blocks, n)
    assert set(dirty(cl.consumers[0])) == set(d_blocks)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_pull_across_tp_sizes(cluster, p_tp, d_tp):
    cl = cluster.start(total_heads=2, p_tp=p_tp, d_tp=d_tp, p_cfg=PULL, d_cfg=PULL)
    p_blocks, d_blocks, n = [0, 5], [9, 2], 30
    cl.ready("ptp", 0, p_blocks, n)
    cl.expect("ptp", 0, d_blocks, n)
    for d in cl.consumers:
        assert wait(d, 1)[0]["ok"] is True
    for p in cl.producers:
        assert wait(p, 1)[0]["outcome"] == "done"
    assert_copied(cl, p_blocks, d_blocks, n)


def test_pull_different_block_sizes_and_prefix_tail(cluster):
    cl = cluster.start(p_block=32, d_block=16, p_order="NHD", d_order="HND", p_cfg=PULL, d_cfg=PULL)
    p_blocks, n = [6, 2, 4], 80
    cl.ready("pbs", 0, p_blocks, n)
    cl.expect("pbs", 0, [11, 12, 13], n, first_token=32)
    assert wait(cl.consumers[0], 1)[0]["ok"] is True
    assert_copied(cl, p_blocks, [11, 12, 13], n, first_token=32)
    assert set(dirty(cl.consumers[0])) == {11, 12, 13}


def test_pull_abort_during_read_frees_only_after_the_read_ended(cluster):
    cl = cluster.start(p_cfg=PULL, d_cfg=PULL, d_faults=dict(post_delay_s=1.5))
    d_blocks, n = [4, 5], 30
    cl.ready("pab", 0, [7, 8], n)
    cl.expect("pab", 0, d_blocks, n)
    time.sleep(0.4)  # the READ is posted and held
    t0 = time.monotonic()
    cl.consumers[0].call("abort", tid="pab", attempt=0)
    res = wait(cl.consumers[0], 1)
    assert res[0]["ok"] is False and time.monotonic() - t0 > 0.8
    cl.consumers[0].call("poison", byte=POISON, blocks=d_blocks)
    time.sleep(1.0)
    assert dirty(cl.consumers[0]) == []
    assert wait(cl.producers[0], 1)[0]["outcome"] in ("cancelled", "done")


def test_pull_failed_read_unpins_the_producer(cluster):
    cl = cluster.start(p_cfg=PULL, d_cfg=PULL, d_faults=dict(err_xfer=1.0))
    cl.ready("perr", 0, [1], 10)
    cl.expect("perr", 0, [2], 10)
    res = wait(cl.consumers[0], 1)[0]
    assert res["ok"] is False and "READ failed" in res["reason"]
    assert wait(cl.producers[0], 1)[0]["outcome"] == "failed"  # told by ReadResult, not by its timeout


def test_push_and_pull_peers_refuse_each_other(cluster):
    cl = cluster.start(p_cfg=PULL)
    cl.expect("mix", 0, [1], 10)
    res = wait(cl.consumers[0], 1, seconds=15)[0]
    assert res["ok"] is False and "mode mismatch" in res["reason"]


# ---- cross-layer caches ----------------------------------------------------------------------------------
def push_seven_blocks(cl: Cluster, tid: str, arrangement: str) -> None:
    """One push of 7 blocks (the last partly filled), consecutive or shuffled on both sides: both ends report it
    done, the bytes are the producer's, nothing else was touched."""
    n = 16 * 7 - 5
    p_blocks, d_blocks = ([30, 2, 17, 9, 4, 25, 11], [5, 28, 13, 0, 21, 8, 19]) if arrangement == "shuffled" \
        else (list(range(3, 10)), list(range(12, 19)))
    cl.expect(tid, 0, d_blocks, n)
    cl.ready(tid, 0, p_blocks, n)
    assert wait(cl.consumers[0], 1) == [{"tid": tid, "attempt": 0, "ok": True, "reason": ""}]
    assert wait(cl.producers[0], 1)[0]["outcome"] == "done"
    assert_copied(cl, p_blocks, d_blocks, n)
    assert set(dirty(cl.consumers[0])) == set(d_blocks)


CROSS_LAYER_KINDS = ["host", pytest.param("cuda", marks=pytest.mark.gpu)]  # Neuron's plugin has no such cache


@pytest.mark.parametrize("kind", CROSS_LAYER_KINDS)
@pytest.mark.parametrize("p_cross,d_cross", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("arrangement", ["consecutive", "shuffled"])
def test_cross_layer_caches_move_a_run_as_one_descriptor_and_pair_with_per_layer_ones(kind, p_cross, d_cross,
                                                                                       arrangement):
    """vLLM's cross-layer cache (`cross_layer_blocks`) on either side or both: the same bytes as always; with both,
    a run of consecutive blocks is one descriptor."""
    cl = Cluster(kind)
    try:
        cl.start(p_cross_layer=p_cross, d_cross_layer=d_cross)
        push_seven_blocks(cl, "xl", arrangement)
        descs = cl.producers[0].call("stats")["counters"]["kvpush_descriptors_posted_total"]
        assert (descs == 1) == (p_cross and d_cross and arrangement == "consecutive"), descs
    finally:
        cl.close()


# ---- value formats and MLA (issue 49) -------------------------------------------------------------------------
FP8 = dict(num_layers=2, head_dim=8, dtype="uint8", dtype_size=1)  # vLLM stores every fp8 KV cache as uint8
# The Neuron plugin lays out its own bf16 K/V planes (kvpush_neuron.slab takes no value format or latent form yet)


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def fmt_cluster(request):
    cl = Cluster(request.param)
    yield cl
    cl.close()


@pytest.mark.parametrize("p_tp,d_tp,p_block,d_block", [(1, 1, 16, 16), (1, 2, 16, 32), (2, 1, 32, 16)])
def test_fp8_cache_moves_byte_for_byte(fmt_cluster, p_tp, d_tp, p_block, d_block):
    """An fp8_e4m3 cache (1-byte values, every byte pattern filled in) moves unchanged across TP splits and block
    sizes: nothing converts or rounds the values."""
    geo = {**FP8, "cache_dtype": "fp8_e4m3", "kv_scales": "k=0.5,v=0.25"}
    cl = fmt_cluster.start(total_heads=2, p_tp=p_tp, d_tp=d_tp, p_block=p_block, d_block=d_block, p_geo=geo, d_geo=geo)
    n = 90
    p_blocks = list(range(20, 20 + -(-n // p_block)))
    d_blocks = [9, 2, 30, 4, 17, 11][: -(-n // d_block)]
    cl.expect("fp8", 0, d_blocks, n)
    cl.ready("fp8", 0, p_blocks, n)
    for d in cl.consumers:
        assert wait(d, 1)[0]["ok"] is True
    assert_copied(cl, p_blocks, d_blocks, n)
    for d in cl.consumers:
        assert set(dirty(d)) == set(d_blocks)


@pytest.mark.parametrize("d_fmt", [{"cache_dtype": "fp8_e5m2", "kv_scales": "k=1.0,v=1.0"},
                                   {"cache_dtype": "fp8_e4m3", "kv_scales": "k=2.0,v=1.0"}], ids=["e5m2", "scales"])
def test_fp8_format_or_scale_mismatch_is_refused_at_the_handshake(fmt_cluster, d_fmt):
    """fp8_e4m3 and fp8_e5m2 (or one format under other K/V scales) are the same uint8 storage: the handshake
    refuses the pair, naming both sides' values, and no byte of the consumer's blocks is written."""
    p_fmt = {"cache_dtype": "fp8_e4m3", "kv_scales": "k=1.0,v=1.0"}
    cl = fmt_cluster.start(total_heads=2, p_geo={**FP8, **p_fmt}, d_geo={**FP8, **d_fmt})
    cl.expect("fmt", 0, [3, 4], 20)
    cl.ready("fmt", 0, [1, 2], 20)
    [res] = wait(cl.consumers[0], 1)
    assert res["ok"] is False
    field = "cache_dtype" if d_fmt["cache_dtype"] != p_fmt["cache_dtype"] else "kv_scales"
    assert field in res["reason"] and p_fmt[field] in res["reason"] and d_fmt[field] in res["reason"], res
    assert dirty(cl.consumers[0]) == []


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2)])
def test_mla_latent_reaches_every_decode_rank_from_one_prefill_rank(fmt_cluster, p_tp, d_tp):
    """MLA's latent cache (one 576-wide row per token, the same on every TP rank) across TP: each consumer rank gets
    the whole latent from exactly one producer rank (one WRITE per consumer rank, none redundant), a producer rank
    no consumer reads from releases at once, and block sizes may differ (AMX_MLA 32-multiples, FlashMLA 64)."""
    from kvpush_common.protocol.topology import routes_from

    geo = dict(num_layers=2, head_dim=576, dtype="bfloat16", dtype_size=2, latent=True)
    cl = fmt_cluster.start(total_heads=1, p_tp=p_tp, d_tp=d_tp, p_block=32, d_block=64, p_geo=geo, d_geo=geo,
                       num_blocks=8)
    n = 100
    p_blocks, d_blocks = [5, 1, 7, 2], [6, 0]
    cl.expect("mla", 0, d_blocks, n)
    for p in cl.producers:
        p.call("ready", tid="mla", attempt=0, blocks=p_blocks, num_tokens=n, consumer_tp=d_tp)
    for d in cl.consumers:
        assert wait(d, 1)[0]["ok"] is True
    for p in cl.producers:
        assert wait(p, 1)[0]["outcome"] == "done"
    writes = 0
    for r, p in enumerate(cl.producers):  # each producer rank was filled with its own bytes: its readers show them
        routed = routes_from(1, p_tp, d_tp, r)
        src = logical(p, p_blocks, n)
        for route in routed:
            np.testing.assert_array_equal(logical(cl.consumers[route.dst_rank], d_blocks, n), src)
        posted = p.call("stats")["counters"].get("kvpush_writes_posted_total", 0)
        assert posted == len(routed), (r, posted, routed)
        writes += posted
    assert writes == d_tp  # one WRITE per consumer rank
    for d in cl.consumers:
        assert set(dirty(d)) == set(d_blocks)
