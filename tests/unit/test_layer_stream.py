"""Layer streaming's pure state (common/state/layer_stream.py) and the layer slice the planner gets."""

import pytest

from kvpush_common.plan.layers import layer_slice
from kvpush_common.protocol.layout import KVLayout, Region
from kvpush_common.state.layer_stream import LayerChunk, LayerSpan, LayerStream

D = ("D", 0)
E = ("D", 1)


def stream(num_layers=4) -> LayerStream:
    return LayerStream(num_layers, 0.0)


def test_nothing_is_ready_before_its_fence_passes():
    s = stream()
    s.add(LayerChunk(0, 2, (1, 2), 20, fence="f1"))
    s.settle(lambda f: f != "f1")
    assert s.spans_for(D, 0, 64, 16) == []
    s.settle(lambda f: True)
    assert s.spans_for(D, 0, 64, 16) == [LayerSpan(0, 2, 0, 20, (1, 2))]


def test_one_batch_per_destination_in_flight_and_the_cut_block_goes_again():
    s = stream(2)
    s.add(LayerChunk(0, 2, (1, 2), 20))
    s.settle(lambda f: True)
    batch = s.spans_for(D, 0, 64, 16)
    s.posted(D, batch)
    s.add(LayerChunk(0, 2, (1, 2, 3, 4), 57))
    s.settle(lambda f: True)
    assert s.spans_for(D, 0, 64, 16) == []  # the first batch is still in flight
    assert s.spans_for(E, 0, 64, 16) == [LayerSpan(0, 2, 0, 57, (1, 2, 3, 4))]  # another rank is not held up
    assert s.busy(D) and s.busy() and not s.busy(E)
    s.ended(D, ok=True)
    assert s.streamed(D) and not s.streamed(E)
    # tokens 16..19 landed in a block that was cut: the next span restarts at the block both sides share
    assert s.spans_for(D, 0, 64, 16) == [LayerSpan(0, 2, 16, 57, (1, 2, 3, 4))]
    assert s.spans_for(D, 0, 64, 32) == [LayerSpan(0, 2, 0, 57, (1, 2, 3, 4))]  # lcm of block sizes 32


def test_layers_at_different_token_counts_go_as_separate_spans():
    s = stream(4)
    s.add(LayerChunk(0, 4, (1,), 16))
    s.add(LayerChunk(0, 2, (1, 2), 32))
    s.settle(lambda f: True)
    assert s.spans_for(D, 0, 64, 16) == [LayerSpan(0, 2, 0, 32, (1, 2)), LayerSpan(2, 4, 0, 16, (1, 2))]


def test_a_consumer_prefix_and_its_registered_length_bound_the_spans():
    s = stream(1)
    s.add(LayerChunk(0, 1, (1, 2, 3), 48))
    s.settle(lambda f: True)
    assert s.spans_for(D, 32, 40, 16) == [LayerSpan(0, 1, 32, 40, (1, 2, 3))]
    assert s.spans_for(D, 48, 64, 16) == []  # the consumer holds every ready token already


def test_a_failed_batch_stops_streaming_into_that_rank_and_covers_nothing():
    s = stream(2)
    s.add(LayerChunk(0, 2, (1,), 16))
    s.settle(lambda f: True)
    s.posted(D, s.spans_for(D, 0, 64, 16))
    s.ended(D, ok=False)
    assert not s.streamed(D) and s.spans_for(D, 0, 64, 16) == []
    s.closed = True
    assert s.spans_for(E, 0, 64, 16) == []


def test_once_the_whole_kv_is_ready_only_what_did_not_land_is_left():
    s = stream(3)
    s.add(LayerChunk(0, 3, (1, 2), 20))
    s.add(LayerChunk(0, 1, (1, 2, 3), 40))  # layer 0 of the next step; layers 1, 2 not handed over yet
    s.settle(lambda f: True)
    s.posted(D, s.spans_for(D, 0, 40, 16))
    s.ended(D, ok=True)
    s.complete(40, (1, 2, 3))
    assert s.spans_for(D, 0, 40, 16) == [LayerSpan(1, 3, 16, 40, (1, 2, 3))]  # layer 0 holds every token
    s.posted(D, s.spans_for(D, 0, 40, 16))
    s.ended(D, ok=True)
    assert s.spans_for(D, 0, 40, 16) == []  # nothing left: WriteDone goes alone


def test_a_chunk_outside_the_layers_is_refused():
    with pytest.raises(ValueError, match="out of range"):
        stream(2).add(LayerChunk(1, 3, (1,), 16))


def _layout(kv_planes: int) -> KVLayout:
    n = 3
    return KVLayout(num_layers=n, num_heads=1, head_dim=8, dtype_size=2, dtype="bfloat16", block_size=16, num_blocks=4,
                    order="NHD", regions=[Region(base=(i + 1) << 20, block_stride=256) for i in range(n * kv_planes)],
                    kv_planes=kv_planes)


@pytest.mark.parametrize("kv_planes", [1, 2])
def test_a_layer_slice_keeps_its_regions_addresses(kv_planes):
    full = _layout(kv_planes)
    part = layer_slice(full, 1, 3)
    assert part.num_layers == 2 and part.regions == full.regions[kv_planes:]
    part.validate()
    assert layer_slice(full, 1, 3) is part and layer_slice(full, 0, 3) is full
    with pytest.raises(ValueError):
        layer_slice(full, 2, 2)
