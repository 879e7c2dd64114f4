"""The worker thread's timed waits end when asked: its timer slack (`timer_slack_s`, 1 us) is set in that thread
only, and comes from the connector config."""

import ctypes
import threading

from kvpush_common.endpoint.base import set_timer_slack
from kvpush_common.endpoint.config import EndpointConfig
from kvpush_common.testing.vllm_config import parallel_config

_PR_GET_TIMERSLACK = 30


def test_timer_slack_is_set_for_the_calling_thread_only():
    libc = ctypes.CDLL(None, use_errno=True)
    before = libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    seen = {}

    def worker():
        seen["set"] = set_timer_slack(round(EndpointConfig(engine_id="P").timer_slack_s * 1e9))
        seen["slack"] = libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"set": True, "slack": 1000}
    assert libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0) == before  # this thread keeps its own


def test_timer_slack_is_a_connector_setting_and_bounded():
    from types import SimpleNamespace

    import pytest

    from kvpush_common.vllm.settings import ConnectorSettings

    kt = SimpleNamespace(kv_role="kv_consumer", engine_id="d0", kv_connector_extra_config={"tuning": {"timer_slack_s": 0}})
    model = SimpleNamespace(served_model_name="m", model="m", get_total_num_kv_heads=lambda: 8)
    cfg = SimpleNamespace(kv_transfer_config=kt, model_config=model, parallel_config=parallel_config(1))
    assert ConnectorSettings.from_vllm(cfg).endpoint_config(0).validate().timer_slack_s == 0.0  # the kernel's default
    for bad in (-1e-6, 0.5):
        with pytest.raises(ValueError, match="timer_slack_s"):
            EndpointConfig(engine_id="P", timer_slack_s=bad).validate()
