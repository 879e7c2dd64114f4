"""kvpush as a vLLM KV connector (the only part of kvpush_common that imports vLLM or torch).

    --kv-transfer-config '{"kv_connector": "KVPushConnector",
                           "kv_connector_module_path": "kvpush_common.vllm.connector",
                           "kv_role": "kv_producer" | "kv_consumer", ...}'
"""
