"""The layer-streaming micro-benchmark's summary (scripts/bench/gpu/layer_stream.py): the keys issue 15 asks for,
computed from rows of both modes (its run is exercised on the GPU and by hand here; the summary is pure)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("layer_stream", ROOT / "scripts/bench/gpu/layer_stream.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def row(tokens, mode, exposed, wire=None):
    return {"tokens": tokens, "mode": mode, "exposed_after_prefill_ms_p50": exposed, "one_layer_wire_ms_p50": wire}


def test_the_summary_takes_the_worst_size_of_each_mode_and_checks_the_goal():
    rows = [row(4096, "whole", 18.0), row(4096, "stream", 1.8, 0.5), row(16384, "whole", 50.0),
            row(16384, "stream", 2.0, 1.0)]
    s = bench.summarize(rows)
    assert s["exposed_after_prefill_ms_p50_max"] == {"whole": 50.0, "stream": 2.0}
    assert s["one_layer_wire_ms"] == 1.0 and s["goal_ms"] == 2.0 and s["goal_met"] is True
    assert s["stream_over_whole_p50"] == 0.1  # 1.8 / 18: the worse of the two sizes


def test_without_a_one_layer_batch_there_is_no_goal_to_judge():
    s = bench.summarize([row(4096, "whole", 18.0), row(4096, "stream", 9.0)])
    assert s["one_layer_wire_ms"] is None and "goal_met" not in s and s["stream_over_whole_p50"] == 0.5


def test_the_engine_threads_cost_per_layer_is_summarized():
    assert bench.hook_stats([], []) == {}
    hooks = [10.0] * 98 + [100.0, 200.0]
    got = bench.hook_stats(hooks, [4.0, 5.0, 6.0])
    assert got["layers_ready_us_p50"] == 10.0 and got["layers_ready_us_p99"] > 100.0 and got["fence_us_p50"] == 5.0
    rows = [row(4096, "whole", 18.0), {**row(4096, "stream", 2.0, 1.0), **got}]
    assert bench.summarize(rows)["layers_ready_us_p99_max"] == got["layers_ready_us_p99"]
