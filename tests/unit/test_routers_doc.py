"""docs/routers.md's examples are checked, not run: every YAML block parses, every kv-transfer-config in it (JSON
blocks and the manifests' --kv-transfer-config) is one kvpush's settings parser accepts for its role, and the llm-d
sidecar's arguments are flags its options.go declares."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from kvpush_common.testing.vllm_config import parallel_config
from kvpush_common.vllm.settings import ConnectorSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "routers.md"
# llm-d/llm-d-router pkg/sidecar/proxy/options.go at ebab6879 (2026-08-22): the flag names it declares
SIDECAR_FLAGS = {"port", "model-server-port", "vllm-port", "data-parallel-size", "kv-connector", "ec-connector",
                 "mooncake-bootstrap-port", "p2p-connector-port", "enable-p2p-pull", "enable-ssrf-protection",
                 "enable-prefiller-sampling", "enable-tls", "tls-insecure-skip-verify", "secure-proxy", "cert-path",
                 "inference-pool", "pool-group", "max-idle-conns-per-host", "prefill-max-retries",
                 "prefill-retry-backoff", "decode-chunk-size", "configuration", "configuration-file", "tracing",
                 "metrics-port"}
CONNECTORS = {"KVPushCudaConnector": "kvpush_cuda.connector", "KVPushNeuronConnector": "kvpush_neuron.connector",
              "KVPushConnector": "kvpush_common.vllm.connector"}


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


def kv_configs() -> list[dict]:
    out = [json.loads(b) for b in blocks("json")]
    for doc in blocks("yaml"):
        text = json.dumps(list(yaml.safe_load_all(doc)))
        for arg in re.findall(r'"(\{\\"kv_connector.*?\})"', text):
            out.append(json.loads(json.loads(f'"{arg}"')))
    return out


def test_every_yaml_block_parses_and_names_only_declared_sidecar_flags():
    docs = [d for b in blocks("yaml") for d in yaml.safe_load_all(b)]
    assert len(docs) >= 3
    sidecars = [c for d in docs if isinstance(d, dict) for c in d.get("spec", {}).get("initContainers", [])]
    assert sidecars, "the llm-d example has the routing sidecar"
    for c in sidecars:
        for arg in c["args"]:
            flag = arg.lstrip("-").split("=")[0]
            assert flag in SIDECAR_FLAGS, arg
        assert "--kv-connector=nixlv2" in c["args"]


@pytest.mark.parametrize("cfg", kv_configs(), ids=lambda c: f"{c['kv_connector']}-{c['kv_role']}")
def test_every_kv_transfer_config_is_accepted_by_kvpush(cfg, monkeypatch):
    monkeypatch.setenv("KVPUSH_SECRET", "doc")  # the manifests take it from a Kubernetes secret
    monkeypatch.setenv("KVPUSH_SIDE_CHANNEL_HOST", "10.0.0.9")  # ... and the pod IP
    if cfg["kv_connector"] == "MultiConnector":  # Dynamo: kvpush inside vLLM's MultiConnector
        (cfg,) = cfg["kv_connector_extra_config"]["connectors"]
    assert CONNECTORS[cfg["kv_connector"]] == cfg["kv_connector_module_path"]
    kt = SimpleNamespace(kv_role=cfg["kv_role"], engine_id=cfg.get("engine_id", "e"),
                         kv_connector_extra_config=cfg.get("kv_connector_extra_config", {}))
    model = SimpleNamespace(served_model_name="m", model="m", get_total_num_kv_heads=lambda: 8)
    s = ConnectorSettings.from_vllm(SimpleNamespace(kv_transfer_config=kt, model_config=model,
                                                    parallel_config=parallel_config(8)))
    assert s.role == {"kv_producer": "producer", "kv_consumer": "consumer"}[cfg["kv_role"]] and s.secret == b"doc"


def section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def bullet(text: str, head: str) -> str:
    """The bullet of `text` starting with `- head`, up to the next bullet or block."""
    return re.search(rf"^- {re.escape(head)}.*?(?=^- |^```|\Z)", text, re.S | re.M).group(0)


# vLLM 0.34.0 sdist, examples/disaggregated/disaggregated_serving/disagg_proxy_pushconnector_demo.py parse_args();
# the same names in common/testing/nixl_proxy.py's demo-push mode
PUSH_DEMO_FLAGS = {"model", "prefill", "decode", "port", "prefill-engine-id", "prefill-kv-host",
                   "prefill-side-channel-port", "prefill-tp-size", "prefill-pp-size"}


def test_vllms_proxies_are_listed_by_what_they_send():
    """disagg_proxy_demo.py sends no kv_transfer_params (0.34.0 sdist: P gets max_tokens 1, D the request as it came):
    it is no pull proxy for NIXL-contract connectors, D would recompute every prompt.  The push demo's release
    sends no transfer_id; main's does."""
    proxies = section("vLLM's proxies")
    assert "disagg_proxy_demo.py" not in bullet(proxies, "Pull")
    assert "no `kv_transfer_params`" in bullet(proxies, "Not `examples/disaggregated/disaggregated_serving/disagg_proxy_demo.py`")
    push = bullet(proxies, "Push")
    assert "0.34.0" in push and "no `transfer_id`" in push and "1db62a2d" in push
    (command,) = re.findall(r"```bash\n(.*?)```", proxies, re.S)
    assert set(re.findall(r"--([a-z-]+)", command)) <= PUSH_DEMO_FLAGS
    assert "--prefill-engine-id" in command


def test_transfer_id_is_never_said_to_be_what_vllms_releases_read():
    text = DOC.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| pairing of the two legs"))
    assert "0.32–0.34" in row and "reads no `transfer_id`" in row and "1db62a2d" in row
    assert "and in push `transfer_id`" not in text and "newer proxies also send" not in text
