"""kv_connector_extra_config is read once into typed settings: user keys, internal tuning under `tuning`, unknown
keys refused with the list of known ones, and a config written for vLLM's NIXL connectors accepted."""

import logging

import pytest

from kvpush_common.testing.vllm_config import vllm_config
from kvpush_common.vllm.extra_config import KNOWN_KEYS, parse_extra_config
from kvpush_common.vllm.settings import ConnectorSettings


def settings(**extra) -> ConnectorSettings:
    return ConnectorSettings.from_vllm(vllm_config(**extra))


def test_a_typo_stops_start_up_and_names_the_known_keys():
    with pytest.raises(ValueError) as e:
        settings(transfer_timout_s=30)
    msg = str(e.value)
    assert "unknown key(s) transfer_timout_s" in msg and "transfer_timeout_s" in msg and "tuning" in msg


def test_an_internal_setting_at_the_top_level_is_pointed_to_tuning():
    with pytest.raises(ValueError, match=r"poll_s go\(es\) under `tuning`"):
        settings(poll_s=0.001)
    with pytest.raises(ValueError, match="kv_connector_extra_config.tuning: object contains unknown field "
                                         "`gil_switch_interval_s`"):
        settings(tuning={"gil_switch_interval_s": 0.001})


def test_values_are_typed_and_bounded_and_strings_from_a_cli_are_read():
    s = settings(lease_s="12", heartbeat_s=2, allow_unauthenticated="true", local_prefill_max_tokens="0",
                 tuning={"poll_s": "0.002"})
    ep = s.endpoint_config(0)
    assert (ep.lease_s, ep.heartbeat_s, ep.poll_s) == (12.0, 2.0, 0.002) and s.local_prefill_max_tokens == 0
    for bad, where in (({"lease_s": 0}, "lease_s"), ({"port": 70000}, "port"), ({"metrics_port": -1}, "metrics_port"),
                       ({"local_prefill_max_tokens": -1}, "local_prefill_max_tokens"),
                       ({"tuning": {"timer_slack_s": 0.5}}, "tuning.timer_slack_s"),
                       ({"mode": "both"}, "mode"), ({"backend_params": ["x"]}, "backend_params")):
        with pytest.raises(ValueError, match=f"kv_connector_extra_config.{where}: "):
            settings(**bad)


def test_defaults_leave_the_endpoint_its_own():
    ep = settings().endpoint_config(0)
    assert (ep.lease_s, ep.reg_ttl_s, ep.write_timeout_s, ep.transfer_timeout_s, ep.poll_s) == (30.0, 30.0, 30.0,
                                                                                                 120.0, 0.001)
    assert ep.transport.backend == "UCX" and not ep.transport.progress_thread_for("producer")


@pytest.mark.parametrize("key", ["staging_bytes", "staging_chunk_bytes", "staging_min_descs", "staging_partitions",
                                 "progress_thread"])
def test_a_removed_setting_stops_start_up_naming_it_as_removed(key):
    """Staged transfers and the progress-thread override are gone: a config still naming them is refused, at the
    top level or under `tuning`, never run as if they were set; EndpointConfig refuses them and its dead fields."""
    from kvpush_common.endpoint.config import EndpointConfig

    for extra, where in (({"tuning": {key: 1}}, f"tuning.{key}"), ({key: 1}, key)):
        with pytest.raises(ValueError, match=rf"kv_connector_extra_config\.{where} was removed \(.+\); delete it"):
            settings(**extra)
    for field in (key, "handshake_workers", "prepped_lists"):
        with pytest.raises(ValueError, match=rf"EndpointConfig\.{field} was removed"):
            EndpointConfig(engine_id="E", **{field: 1})


def test_a_nixl_connector_config_starts_kvpush_unchanged(caplog):
    """vLLM's NixlConnector keys (vllm/distributed/kv_transfer/kv_connector/v1/nixl/, get_from_extra_config)."""
    with caplog.at_level(logging.WARNING, logger="kvpush"):
        s = settings(backends=["LIBFABRIC"], enforce_handshake_compat=True, kv_lease_duration=60, num_threads=8)
    assert s.backend == "LIBFABRIC" and s.transport_keys()["backend"] == "LIBFABRIC"
    logged = caplog.text
    assert "enforce_handshake_compat" in logged and "kv_lease_duration" in logged and "backend_params.num_threads" in logged
    with caplog.at_level(logging.WARNING, logger="kvpush"):
        assert settings(backends=["UCX", "LIBFABRIC"]).backend == "UCX"
    assert "uses one NIXL backend" in caplog.text
    with pytest.raises(ValueError, match="disagree"):
        settings(backend="UCX", backends=["LIBFABRIC"])
    with pytest.raises(ValueError, match="backends must be a list"):
        settings(backends=[])


def test_every_user_key_is_in_the_readme_table():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    missing = [k for k in KNOWN_KEYS if k != "tuning" and f"`{k}`" not in readme]
    assert not missing, f"README's settings do not name {missing}"


def test_parse_accepts_no_config():
    assert parse_extra_config(None) == parse_extra_config({})
