"""gil_switch_interval_s: a vLLM worker process's GIL switch interval, set when kvpush binds its endpoint and
restored at shutdown (a woken kvpush thread waits at most this long for a busy engine thread's GIL)."""

import sys
from types import SimpleNamespace

import pytest

from kvpush_common.vllm.settings import ConnectorSettings
from kvpush_common.vllm.worker import WorkerSide


def vllm_config(**extra):
    kt = SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config=extra, engine_id="d0")
    model = SimpleNamespace(served_model_name="m", model="m", get_total_num_kv_heads=lambda: 8)
    return SimpleNamespace(kv_transfer_config=kt, model_config=model,
                           parallel_config=SimpleNamespace(tensor_parallel_size=1))


def test_unset_by_default_and_read_from_the_connector_config():
    assert ConnectorSettings.from_vllm(vllm_config()).gil_switch_interval_s is None
    assert ConnectorSettings.from_vllm(vllm_config(gil_switch_interval_s=0.0005)).gil_switch_interval_s == 0.0005
    assert ConnectorSettings.from_vllm(vllm_config(gil_switch_interval_s="0.001")).gil_switch_interval_s == 0.001


@pytest.mark.parametrize("bad", [0, -1, 1e-6, 0.5, "fast", [0.001]])
def test_out_of_range_or_non_numbers_are_refused(bad):
    with pytest.raises(ValueError, match="kv_connector_extra_config.gil_switch_interval_s must be seconds"):
        ConnectorSettings.from_vllm(vllm_config(gil_switch_interval_s=bad))


def test_the_worker_sets_it_and_shutdown_restores_python_s():
    before = sys.getswitchinterval()
    w = WorkerSide(settings=SimpleNamespace(gil_switch_interval_s=0.0005), rank=0, make_backend=None)
    try:
        w._set_switch_interval()
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        w.shutdown()
    assert sys.getswitchinterval() == before
    untouched = WorkerSide(settings=SimpleNamespace(gil_switch_interval_s=None), rank=0, make_backend=None)
    untouched._set_switch_interval()
    assert sys.getswitchinterval() == before
    untouched.shutdown()
    assert sys.getswitchinterval() == before
