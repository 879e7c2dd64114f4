"""How busy a vLLM instance says it is: its /metrics gauges, read by the router's health loop."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

# vLLM's gauge names (the KV one was gpu_cache_usage_perc before 0.8); summed over label sets (engines)
GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
          "vllm:kv_cache_usage_perc": "kv_usage", "vllm:gpu_cache_usage_perc": "kv_usage"}


def parse_vllm_load(text: str) -> dict[str, float]:
    """`running`, `waiting`, `kv_usage` (0-1) from a vLLM /metrics page; absent gauges are left out."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        key = GAUGES.get(family.name)
        if key is None:
            continue
        values = [s.value for s in family.samples if s.name == family.name]
        if values:
            out[key] = max(values) if key == "kv_usage" else sum(values)
    return out
