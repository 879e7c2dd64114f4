"""A stand-in for the parts of vLLM's VllmConfig that `ConnectorSettings.from_vllm` reads (unit tests)."""

from __future__ import annotations

from types import SimpleNamespace


def vllm_config(role: str = "kv_producer", **extra) -> SimpleNamespace:
    """One TP-1 instance of a model with 8 KV heads; `extra` is its kv_connector_extra_config."""
    kt = SimpleNamespace(kv_role=role, kv_connector_extra_config=extra, engine_id="p0" if role == "kv_producer" else "d0")
    model = SimpleNamespace(served_model_name="m", model="m", get_total_num_kv_heads=lambda: 8)
    return SimpleNamespace(kv_transfer_config=kt, model_config=model, parallel_config=parallel_config())


def parallel_config(tp: int = 1, **sizes) -> SimpleNamespace:
    """The fields of vLLM's ParallelConfig that `vllm.parallel.ParallelSizes.read` reads, at vLLM's defaults
    (tests/unit/test_parallel_sizes.py checks them against the real class)."""
    fields = {"tensor_parallel_size": tp, "pipeline_parallel_size": 1, "data_parallel_size": 1,
              "data_parallel_index": 0, "data_parallel_external_lb": False, "decode_context_parallel_size": 1,
              "prefill_context_parallel_size": 1}
    return SimpleNamespace(**{**fields, **sizes})
