"""A stand-in for the parts of vLLM's VllmConfig that `ConnectorSettings.from_vllm` reads (unit tests)."""

from __future__ import annotations

from types import SimpleNamespace


def vllm_config(role: str = "kv_producer", **extra) -> SimpleNamespace:
    """One TP-1 instance of a model with 8 KV heads; `extra` is its kv_connector_extra_config."""
    kt = SimpleNamespace(kv_role=role, kv_connector_extra_config=extra, engine_id="p0" if role == "kv_producer" else "d0")
    model = SimpleNamespace(served_model_name="m", model="m", get_total_num_kv_heads=lambda: 8)
    return SimpleNamespace(kv_transfer_config=kt, model_config=model,
                           parallel_config=SimpleNamespace(tensor_parallel_size=1))
