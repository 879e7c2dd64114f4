"""stream_wake_every: a layer hand-over wakes the producer's worker only on every k-th layer and the last one
(each wake lets the worker take the GIL from a launch-bound engine thread; h200-hook-gil.md)."""

from types import SimpleNamespace

import pytest

from kvpush_common.endpoint.config import EndpointConfig
from kvpush_common.endpoint.inbox import LayersReady
from kvpush_common.endpoint.producer import ProducerEndpoint
from kvpush_common.testing.vllm_config import vllm_config
from kvpush_common.vllm.settings import ConnectorSettings


def handed_over(every: int, layers: int = 12) -> list[tuple[int, bool]]:
    """(end layer, woke the worker) of each hand-over of one step that prefills one streamed request."""
    queued = []
    endpoint = SimpleNamespace(cfg=EndpointConfig("p", stream_layers=True, stream_wake_every=every).validate(),
                               layout=SimpleNamespace(num_layers=layers),
                               backend=SimpleNamespace(mark_kv_written=lambda: "fence"),
                               _enqueue=lambda item, wake=True: queued.append((item, wake)))
    chunks = ProducerEndpoint.layer_chunks([("t", 0, [1, 2], 20)])
    for layer in range(layers):
        ProducerEndpoint.layers_ready(endpoint, chunks, layer, layer + 1)
    assert all(isinstance(item, LayersReady) and item.fence == "fence" for item, _ in queued)
    return [(item.end, wake) for item, wake in queued]


def test_every_layer_wakes_the_worker_by_default():
    assert EndpointConfig("p").stream_wake_every == 1
    assert [wake for _, wake in handed_over(1)] == [True] * 12


def test_every_kth_layer_and_the_last_wake_it_and_every_layer_is_still_queued():
    got = handed_over(5)
    assert [end for end, _ in got] == list(range(1, 13))
    assert [end for end, wake in got if wake] == [5, 10, 12]


def test_the_setting_comes_from_the_connector_config_and_zero_is_refused():
    settings = ConnectorSettings.from_vllm(vllm_config(stream_layers=True, stream_wake_every=6))
    assert settings.endpoint_config(0).stream_wake_every == 6
    for bad, why in ((0, "must be at least 1"), (-2, "must be a whole number >= 0"), ("six", "must be a whole number >= 0")):
        with pytest.raises(ValueError, match=f"kv_connector_extra_config.stream_wake_every {why}"):
            ConnectorSettings.from_vllm(vllm_config(stream_wake_every=bad))
    with pytest.raises(ValueError, match="stream_wake_every must be at least 1"):
        EndpointConfig("p", stream_wake_every=0).validate()
