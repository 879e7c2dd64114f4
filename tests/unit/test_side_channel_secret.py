"""Secure by default across hosts: a kvpush side channel other hosts can reach needs a secret (every control message
is HMAC-signed then) or an explicit allow_unauthenticated; `kvpush config` and `kvpush doctor` say so before start."""

import pytest

from kvpush_common.ops import deploy
from kvpush_common.testing.vllm_config import vllm_config
from kvpush_common.vllm.settings import ConnectorSettings, is_loopback


@pytest.fixture(autouse=True)
def no_env_secret(monkeypatch):
    monkeypatch.delenv("KVPUSH_SECRET", raising=False)
    monkeypatch.delenv("KVPUSH_SIDE_CHANNEL_HOST", raising=False)


@pytest.mark.parametrize("host", ["10.0.0.7", "0.0.0.0", "::", "ip-10-0-0-7.ec2.internal", "[fe80::1]"])
@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_a_reachable_side_channel_without_a_secret_is_refused_naming_the_fix(host, role):
    with pytest.raises(ValueError) as e:
        ConnectorSettings.from_vllm(vllm_config(role, host=host))
    msg = str(e.value)
    assert repr(host) in msg and "secret" in msg and "KVPUSH_SECRET" in msg and "allow_unauthenticated" in msg


def test_a_secret_an_explicit_opt_out_or_loopback_starts(monkeypatch):
    assert ConnectorSettings.from_vllm(vllm_config(host="10.0.0.7", secret="s3cret")).secret == b"s3cret"
    assert ConnectorSettings.from_vllm(vllm_config(host="10.0.0.7", allow_unauthenticated=True)).secret is None
    for host in ("127.0.0.1", "127.0.1.1", "localhost", "::1", "[::1]"):
        assert is_loopback(host) and ConnectorSettings.from_vllm(vllm_config(host=host)).host == host
    assert ConnectorSettings.from_vllm(vllm_config()).host == "127.0.0.1"  # the default stays on this host
    monkeypatch.setenv("KVPUSH_SECRET", "from-env")
    assert ConnectorSettings.from_vllm(vllm_config(host="10.0.0.7")).secret == b"from-env"
    with pytest.raises(ValueError, match=r"kv_connector_extra_config.allow_unauthenticated: expected `bool`"):
        ConnectorSettings.from_vllm(vllm_config(host="10.0.0.7", allow_unauthenticated="yes"))


def test_kvpush_config_notes_and_doctor_requires_a_secret_across_hosts(monkeypatch):
    plan = {"extra": {"host": "10.0.0.2"}}
    assert deploy.unsigned_across_hosts(plan["extra"])
    bad = deploy.check_secret({}, plan)
    assert not bad.ok and "KVPUSH_SECRET" in bad.problems[0]
    assert deploy.check_secret({"KVPUSH_SECRET": "x"}, plan).ok
    for extra in ({"host": "10.0.0.2", "secret": "x"}, {"host": "10.0.0.2", "allow_unauthenticated": True},
                  {"host": "127.0.0.1"}, {}):
        assert deploy.check_secret({}, {"extra": extra}).ok, extra
    assert deploy.check_secret({}, None).ok  # doctor without --plan: nothing to judge


def test_a_two_host_plan_says_what_it_needs(capsys):
    import json

    from kvpush_common.ops import cli

    args = ["config", "cuda", "--role", "decode", "--model", "m", "--format", "json"]
    assert cli.main(args + ["--topology", "two-host", "--advertise-host", "10.1.0.2"]) == 0
    assert deploy.SECRET_NOTE in json.loads(capsys.readouterr().out)["notes"]
    assert cli.main(args + ["--topology", "two-host", "--advertise-host", "10.1.0.2",
                            "--extra-config", '{"secret": "x"}']) == 0
    assert deploy.SECRET_NOTE not in json.loads(capsys.readouterr().out)["notes"]
    assert cli.main(args) == 0  # same host: loopback
    assert deploy.SECRET_NOTE not in json.loads(capsys.readouterr().out)["notes"]
