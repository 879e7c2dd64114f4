"""kv_fence: under vLLM the producer needs no device fence (the host already read the output of the step
that wrote the KV); `event` keeps recording one.  Why: design.md section 5, "Fence"."""

from types import SimpleNamespace

import pytest

from kvpush_common.endpoint.inbox import KVReady
from kvpush_common.endpoint.producer import ProducerEndpoint
from kvpush_common.testing.vllm_config import vllm_config
from kvpush_common.vllm.metadata import KVPushMetadata, SendOp
from kvpush_common.vllm.settings import ConnectorSettings
from kvpush_common.vllm.worker import WorkerSide


def test_the_default_is_output_and_an_unknown_value_is_refused():
    assert ConnectorSettings.from_vllm(vllm_config()).kv_fence == "output"
    assert ConnectorSettings.from_vllm(vllm_config(kv_fence="event")).kv_fence == "event"
    with pytest.raises(ValueError, match="kv_connector_extra_config.kv_fence: invalid enum value 'cuda'"):
        ConnectorSettings.from_vllm(vllm_config(kv_fence="cuda"))


class Backend:
    def __init__(self):
        self.marked = 0

    def mark_kv_written(self):
        self.marked += 1
        return ("event", self.marked)


def producer_kv_ready(fence: str) -> tuple[Backend, list]:
    """What the producer endpoint queues when the vLLM worker hook hands it a finished prefill."""
    backend, queued = Backend(), []
    endpoint = SimpleNamespace(backend=backend, _enqueue=queued.append, event=lambda *a, **k: None, clock=lambda: 1.0,
                               engine_step=lambda: None)
    endpoint.kv_ready = lambda *args: ProducerEndpoint.kv_ready(endpoint, *args)
    side = WorkerSide(ConnectorSettings.from_vllm(vllm_config(kv_fence=fence)), 0, make_backend=None)
    side.endpoint = endpoint
    meta = KVPushMetadata()
    meta.sends.append(SendOp("r1", "t1", 0, (3, 4), 20))
    side.start_load_kv(meta)
    return backend, queued


def test_output_fence_records_no_device_event():
    backend, queued = producer_kv_ready("output")
    assert backend.marked == 0
    assert len(queued) == 1 and isinstance(queued[0], KVReady)
    assert queued[0].ready.fence is None and queued[0].ready.block_ids == (3, 4) and queued[0].ready.num_tokens == 20


def test_event_fence_records_one_when_the_worker_hears_of_the_kv():
    backend, queued = producer_kv_ready("event")
    assert backend.marked == 1 and queued[0].ready.fence == ("event", 1)
