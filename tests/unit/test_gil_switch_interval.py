"""gil_switch_interval_s: a vLLM worker process's GIL switch interval, set when kvpush binds its endpoint and
restored at shutdown (an experiment on the worker's wait for a busy engine thread's GIL: h200-gil-wake.md)."""

import sys
from types import SimpleNamespace

import pytest

from kvpush_common.testing.vllm_config import vllm_config
from kvpush_common.vllm.settings import ConnectorSettings
from kvpush_common.vllm.worker import WorkerSide


def interval(**extra):
    return ConnectorSettings.from_vllm(vllm_config("kv_consumer", **extra)).gil_switch_interval_s


def test_unset_by_default_and_read_from_the_connector_config():
    assert interval() is None
    assert interval(gil_switch_interval_s=0.0005) == 0.0005
    assert interval(gil_switch_interval_s="0.001") == 0.001


@pytest.mark.parametrize("bad", [0, -1, 1e-6, 0.5, "fast", [0.001]])
def test_out_of_range_or_non_numbers_are_refused(bad):
    with pytest.raises(ValueError, match="kv_connector_extra_config.gil_switch_interval_s must be seconds"):
        interval(gil_switch_interval_s=bad)


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
