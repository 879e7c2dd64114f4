"""KVPushNeuronConnector's worker path on the simulated Neuron runtime: make_backend runs the Neuron
start-up checks, and every step's block ids pass strip_block_sentinels before the core sees them
(padding dropped; a request with a hole or an id out of range moves no KV and is settled)."""

from types import SimpleNamespace

import msgspec
import pytest

from kvpush_common.vllm.metadata import AbortOp, KVPushMetadata, RecvOp, SendOp
from kvpush_common.protocol.legs import ProducerIdentity
from kvpush_common.testing.vllm_config import parallel_config
from kvpush_neuron.kv_cache import NeuronKVCache
from kvpush_neuron.connector import BlockIdGuard, KVPushNeuronConnector
from kvpush_neuron.runtime import SimulatedNeuronRuntime
from kvpush_neuron.slab import plugin_kv_caches, ready_sim_runtime
from kvpush_neuron.startup import NeuronStartupError

NB = 10


def KVConnectorTransferResults():  # the fields vLLM's results carry (whatever its version names the class)
    return SimpleNamespace(finished_sending=set(), finished_recving=set(), failed_recving=set())
PROD = ProducerIdentity(engine_id="P", host="127.0.0.1", port=5700, tp_size=1)


class RecordingWorker:
    """Stands in for WorkerSide: records what the connector hands the core each step."""

    def __init__(self):
        self.metas: list[KVPushMetadata] = []
        self.pending = KVConnectorTransferResults()

    def start_load_kv(self, meta):
        self.metas.append(meta)

    def transfer_results(self, finished_req_ids):
        out, self.pending = self.pending, KVConnectorTransferResults()
        return out


def connector(runtime, cache_dtype="auto", speculative_config=None):
    conn = object.__new__(KVPushNeuronConnector)  # the worker role without vLLM's process group
    conn.runtime_factory = lambda: runtime
    conn._vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 4, get_head_size=lambda: 8),
        parallel_config=parallel_config(2), cache_config=SimpleNamespace(block_size=32, cache_dtype=cache_dtype),
        speculative_config=speculative_config, compilation_config=SimpleNamespace(static_forward_context={}))
    conn._worker = RecordingWorker()
    conn._connector_metadata = None
    return conn


def step(conn, meta, finished=()):
    conn._connector_metadata = meta  # what vLLM's bind_connector_metadata leaves for start_load_kv
    conn.start_load_kv(None)
    conn._connector_metadata = None
    return conn.get_transfer_results(set(finished))


def kv(runtime, dtype="bfloat16", dtype_size=2):
    return plugin_kv_caches(runtime, num_layers=2, num_heads=2, head_dim=8, num_blocks=NB, block_size=32,
                            dtype=dtype, dtype_size=dtype_size)


def test_make_backend_builds_the_neuron_backend_on_the_simulated_runtime():
    rt = ready_sim_runtime()
    conn = connector(rt)
    backend = conn.make_backend(kv(rt), 2)
    assert isinstance(backend, NeuronKVCache) and backend.layout().num_blocks == NB
    assert backend.layout().head_offset == 2 and backend.layout().num_heads == 2  # 4 KV heads / TP2

    unmapped = SimulatedNeuronRuntime({"NEURON_VISIBLE_DEVICES": "0"})  # NEURON_RT_MAP_HBM missing
    unmapped.init()
    with pytest.raises(NeuronStartupError, match="NEURON_RT_MAP_HBM"):
        connector(unmapped).make_backend(kv(unmapped), 0)


def test_block_ids_reach_the_core_without_sentinels():
    rt = ready_sim_runtime()
    conn = connector(rt)
    conn.make_backend(kv(rt), 0)
    meta = KVPushMetadata(recvs=[RecvOp("d1", "t1", 0, PROD, (4, 5, 0, 0), 64, 0)],
                          sends=[SendOp("p1", "t2", 0, (7, 8, -1), 40)],
                          aborts=[AbortOp("p0", "t0", 0, "client left")])
    res = step(conn, meta, finished={"p1"})
    seen = conn._worker.metas[-1]
    assert [op.block_ids for op in seen.recvs] == [(4, 5)] and [op.block_ids for op in seen.sends] == [(7, 8)]
    assert seen.aborts == meta.aborts and seen.recvs[0].producer == PROD
    assert not (res.finished_sending or res.finished_recving or res.failed_recving)


def test_a_sliding_windows_dropped_blocks_are_not_moved():
    """A sliding-window group's request starts with vLLM's null block where the window dropped blocks (the
    prefill side freed them; the decode side allocates none for them): the decode registers only the tokens
    after them, and the prefill marks its dropped blocks -1, which the planner refuses to read."""
    rt = ready_sim_runtime()
    conn = connector(rt)
    conn.make_backend(kv(rt), 0)
    meta = KVPushMetadata(recvs=[RecvOp("d", "t1", 0, PROD, (0, 0, 5, 6), 120, 0),
                                 RecvOp("d-cached", "t3", 0, PROD, (0, 7), 100, 32)],
                          sends=[SendOp("p", "t2", 0, (0, 0, 7, 8), 120)])
    step(conn, meta)
    seen = conn._worker.metas[-1]
    assert [(op.block_ids, op.first_token, op.num_tokens) for op in seen.recvs] == [((5, 6), 64, 120),
                                                                                  ((7,), 64, 100)]
    assert [op.block_ids for op in seen.sends] == [(-1, -1, 7, 8)] and not seen.aborts


def test_a_request_with_a_hole_moves_no_kv_and_is_settled():
    rt = ready_sim_runtime()
    conn = connector(rt)
    conn.make_backend(kv(rt), 0)
    meta = KVPushMetadata(recvs=[RecvOp("d-hole", "t1", 0, PROD, (5, 0, 6), 96, 0),
                                 RecvOp("d-ok", "t3", 1, PROD, (2,), 10, 0)],
                          sends=[SendOp("p-range", "t2", 1, (3, NB), 64)])
    res = step(conn, meta)
    seen = conn._worker.metas[-1]
    assert [op.req_id for op in seen.recvs] == ["d-ok"] and seen.sends == []
    assert seen.aborts == [AbortOp("p-range", "t2", 1, seen.aborts[0].reason)]  # P's side is told
    assert "out of range" in seen.aborts[0].reason
    assert res.finished_recving == res.failed_recving == {"d-hole"}  # vLLM recomputes (recompute policy)
    assert res.finished_sending == set()  # not before vLLM reported the request finished to this worker
    res = step(conn, KVPushMetadata(), finished={"p-range", "other"})
    assert res.finished_sending == {"p-range"} and res.failed_recving == set()
    res = step(conn, KVPushMetadata(), finished={"p-range"})
    assert res.finished_sending == set()  # reported once


def test_guard_remembers_a_finish_that_came_first():
    guard = BlockIdGuard(lambda ids: NeuronKVCache.block_ids(SimpleNamespace(_layout=SimpleNamespace(num_blocks=NB)),
                                                             ids))
    guard.filter(KVPushMetadata(sends=[SendOp("a", "t", 0, (3, 0, 4), 40)]))
    assert guard.settle(KVConnectorTransferResults(), {"x"}).finished_sending == set()
    guard.filter(KVPushMetadata(sends=[SendOp("b", "t", 1, (5, -1, 6), 40)]))
    assert guard.settle(KVConnectorTransferResults(), {"a", "b"}).finished_sending == {"a", "b"}
    assert guard.settle(KVConnectorTransferResults(), set()).finished_sending == set()


# ---- what the bytes mean: the layout of a Neuron cache, as the CUDA and CPU connectors describe theirs --------------

FP8 = dict(dtype="float8_e4m3fn", dtype_size=1)  # the plugin's FP8 KV tensors (dtype_utils: torch.float8_e4m3fn)


def fp8_layout(monkeypatch, clamp, env=None, host=None):
    """The layout the Neuron connector describes for an fp8 KV cache where the plugin clamps to `clamp`."""
    import kvpush_neuron.kv_cache as kv_cache

    monkeypatch.setattr(kv_cache, "plugin_fp8_clamp_max", lambda: clamp)
    rt = ready_sim_runtime()
    return connector(rt, cache_dtype="fp8").make_backend(kv(rt, **FP8), 0).layout()


def test_an_fp8_cache_is_told_apart_from_bf16_and_trn2_from_trn3(monkeypatch):
    """vLLM's fp8 (= fp8_e4m3) KV cache is a float8_e4m3fn tensor on both generations, but the plugin writes
    Trainium2's e4m3 (largest 240) on one and e4m3fn (largest 448) on the other: the layout names the range."""
    rt = ready_sim_runtime()
    bf16 = connector(rt).make_backend(kv(rt), 0).layout()
    assert (bf16.cache_dtype, bf16.kv_scales, bf16.dtype) == ("auto", "", "bfloat16")
    trn2, trn3 = fp8_layout(monkeypatch, 240.0), fp8_layout(monkeypatch, 448.0)
    assert (trn2.cache_dtype, trn2.kv_scales, trn2.dtype) == ("fp8_e4m3:max240", "checkpoint", "float8_e4m3fn")
    assert trn3.cache_dtype == "fp8_e4m3:max448" and trn3.dtype == trn2.dtype  # one torch dtype, two formats


def test_a_trn3_producer_and_a_trn2_consumer_are_refused_at_the_handshake_naming_the_fix(monkeypatch):
    from kvpush_common.endpoint.config import EndpointConfig
    from kvpush_common.endpoint.consumer import ConsumerEndpoint
    from kvpush_common.protocol.layout import VALUE_FORMAT_FIX

    def endpoint(layout_clamp):
        import kvpush_neuron.kv_cache as kv_cache

        monkeypatch.setattr(kv_cache, "plugin_fp8_clamp_max", lambda: layout_clamp)
        rt = ready_sim_runtime()
        backend = connector(rt, cache_dtype="fp8_e4m3").make_backend(kv(rt, **FP8), 0)
        return ConsumerEndpoint(EndpointConfig(engine_id=f"E{layout_clamp:g}", secret=b"k", tp_size=2,
                                               total_kv_heads=4, model="m"), backend)

    d_trn2, p_trn3, p_trn2 = endpoint(240.0), endpoint(448.0), endpoint(240.0)
    try:
        as_producer = lambda ep: msgspec.structs.replace(ep.local_hello(), role="producer")  # noqa: E731
        reason = d_trn2.check_peer_hello(as_producer(p_trn3), "producer")
        assert reason.startswith("compatibility hash mismatch: KV geometry differs (peer vs here: cache_dtype "
                                 "fp8_e4m3:max448 vs fp8_e4m3:max240; fix: "), reason
        assert VALUE_FORMAT_FIX in reason and "bf16 KV cache" in reason and "one generation" in reason
        assert d_trn2.check_peer_hello(as_producer(p_trn2), "producer") is None  # one generation: served
    finally:
        for ep in (d_trn2, p_trn3, p_trn2):
            ep.close()


def test_an_fp8_cache_of_unknown_range_is_refused_at_start_up(monkeypatch, tmp_path):
    import kvpush_neuron.kv_cache as kv_cache
    from kvpush_neuron.efa import TrnHost
    from kvpush_neuron.kv_cache import neuron_fp8_max

    monkeypatch.setattr(kv_cache, "plugin_fp8_clamp_max", lambda: None)  # an installed plugin without FP8_CLAMP_MAX
    monkeypatch.setattr(kv_cache, "TrnHost", lambda: TrnHost(product=tmp_path / "no-dmi"))
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    rt = ready_sim_runtime()
    with pytest.raises(ValueError, match="FP8 range of this host's KV cache is unknown.*NEURON_PLATFORM_TARGET_OVERRIDE"
                                         ".*--kv-cache-dtype auto"):
        connector(rt, cache_dtype="fp8").make_backend(kv(rt, **FP8), 0)
    # the generation, where the plugin's constant is absent: its platform override, else the DMI product name
    dmi = tmp_path / "product_name"
    dmi.write_text("trn3.48xlarge\n")
    assert neuron_fp8_max({}, TrnHost(product=dmi)) == 448.0
    assert neuron_fp8_max({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn2"}, TrnHost(product=dmi)) == 240.0
    monkeypatch.setattr(kv_cache, "plugin_fp8_clamp_max", lambda: 240.0)  # the plugin's own value comes first
    assert neuron_fp8_max({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn3"}, TrnHost(product=dmi)) == 240.0


def test_a_drafters_layers_are_named_in_the_layout():
    """A drafter of the target's KV shape joins its group (docs/neuron.md fact 5): its name travels in the layout, so
    a decode running another drafter is refused at the handshake, as on CUDA and CPU."""
    rt = ready_sim_runtime()
    spec = SimpleNamespace(method="eagle", draft_model_config=SimpleNamespace(model="/models/drafter"))
    assert connector(rt, speculative_config=spec).make_backend(kv(rt), 0).layout().drafter == "eagle:/models/drafter"
    assert connector(rt).make_backend(kv(rt), 0).layout().drafter == ""


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_the_neuron_connectors_dp_engines_take_disjoint_side_channels(role):
    """The plugin's tutorials run data parallelism (DP8 decode): each DP engine of KVPushNeuronConnector starts its
    side channel at port + dp_index * TP, as the CUDA and CPU connectors do (common/vllm/parallel.py)."""
    from vllm.config import ParallelConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    ports = []
    for index in range(2):
        pc = ParallelConfig(tensor_parallel_size=4, data_parallel_size=2, data_parallel_rank=index,
                            data_parallel_external_lb=True)
        kt = SimpleNamespace(kv_role=role, engine_id=f"e_dp{index}", kv_connector="KVPushNeuronConnector",
                             kv_connector_extra_config={"port": 5700})
        cfg = SimpleNamespace(kv_transfer_config=kt, parallel_config=pc, speculative_config=None,
                              model_config=SimpleNamespace(served_model_name="m", model="m", use_mla=False,
                                                           get_total_num_kv_heads=lambda: 8),
                              cache_config=SimpleNamespace(block_size=32, enable_prefix_caching=False))
        settings = KVPushNeuronConnector(cfg, KVConnectorRole.SCHEDULER, None).settings
        ports.append([settings.endpoint_config(r).base_port + r for r in range(4)])
    assert ports == [[5700, 5701, 5702, 5703], [5704, 5705, 5706, 5707]]
