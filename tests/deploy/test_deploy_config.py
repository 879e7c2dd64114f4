"""`kvpush config neuron|cuda`: launch plans found through the kvpush.targets entry points, their
environment, device splits, kv-transfer-config, and the shell/JSON renderings."""

import json
import subprocess

import pytest

from kvpush_common.ops import cli, deploy
from kvpush_common.ops.deploy import LaunchPlan, device_slice, format_range, parse_range


def config(capsys, *argv) -> str:
    assert cli.main(["config", *argv]) == 0
    return capsys.readouterr().out


def plan(capsys, *argv) -> dict:
    return json.loads(config(capsys, *argv, "--format", "json"))


def ktc(p: dict) -> dict:
    return json.loads(p["argv"][p["argv"].index("--kv-transfer-config") + 1])


def test_targets_come_from_entry_points_not_imports():
    targets, broken = deploy.load_targets()
    assert broken == {}
    assert set(targets) >= {"neuron", "cuda"}
    assert type(targets["neuron"]).__module__ == "kvpush_neuron.target"
    assert type(targets["cuda"]).__module__ == "kvpush_cuda.target"


def test_neuron_prefill_plan(capsys):
    p = plan(capsys, "neuron", "--role", "prefill", "--model", "meta-llama/Llama-3.1-8B-Instruct")
    env = p["env"]
    assert env["NEURON_RT_MAP_HBM"] == "1" and env["NEURON_VISIBLE_DEVICES"] == "0-7"
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env["FI_EFA_ENABLE_SHM_TRANSFER"] == "0"  # same host by default
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "2"
    assert p["unset"] == ["NEURON_RT_VISIBLE_CORES"] and p["prepend"] == {"LD_LIBRARY_PATH": "/opt/amazon/efa/lib"}
    assert p["argv"][:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    argv = p["argv"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "8" and argv[argv.index("--port") + 1] == "8100"
    assert argv[argv.index("--block-size") + 1] == "32"
    assert "--no-enable-prefix-caching" not in argv
    k = ktc(p)
    assert k["kv_connector"] == "KVPushNeuronConnector" and k["kv_connector_module_path"] == "kvpush_neuron.connector"
    assert k["kv_role"] == "kv_producer" and "kv_load_failure_policy" not in k
    assert k["kv_connector_extra_config"] == {"host": "127.0.0.1", "backend": "LIBFABRIC", "mode": "push",
                                              "same_host": True, "model_id": "meta-llama/Llama-3.1-8B-Instruct",
                                              "port": 5700, "metrics_port": 9100}
    assert p["url"] == "http://127.0.0.1:8100" and p["devices"] == "0-7"


def test_neuron_decode_same_host_takes_the_other_half(capsys):
    p = plan(capsys, "neuron", "--role", "decode", "--model", "m", "--tp", "16", "--index", "1")
    assert p["env"]["NEURON_VISIBLE_DEVICES"] == "48-63"  # decode half is 32-63
    k = ktc(p)
    assert k["kv_role"] == "kv_consumer" and k["kv_load_failure_policy"] == "recompute"
    assert "port" not in k["kv_connector_extra_config"]  # only producers serve a side channel
    assert "--no-enable-prefix-caching" in p["argv"] and p["url"].endswith(":8201")
    lnc1 = plan(capsys, "neuron", "--role", "decode", "--model", "m", "--lnc", "1")
    assert lnc1["env"]["NEURON_VISIBLE_DEVICES"] == "64-71" and lnc1["env"]["NEURON_LOGICAL_NC_CONFIG"] == "1"


def test_neuron_two_host_needs_an_address_and_keeps_shm(capsys):
    assert cli.main(["config", "neuron", "--role", "prefill", "--model", "m", "--topology", "two-host"]) == 2
    assert "--advertise-host" in capsys.readouterr().err
    p = plan(capsys, "neuron", "--role", "decode", "--model", "m", "--topology", "two-host",
             "--advertise-host", "10.0.0.2")
    assert p["env"]["NEURON_VISIBLE_DEVICES"] == "0-7" and "FI_EFA_ENABLE_SHM_TRANSFER" not in p["env"]
    assert ktc(p)["kv_connector_extra_config"]["same_host"] is False
    assert ktc(p)["kv_connector_extra_config"]["host"] == "10.0.0.2" and p["url"] == "http://10.0.0.2:8200"


def test_xpyd_instances_get_disjoint_devices_and_ports(capsys):
    seen_cores, seen_ports = set(), set()
    for role in ("prefill", "decode"):
        for i in range(4):
            p = plan(capsys, "neuron", "--role", role, "--model", "m", "--index", str(i))
            cores = set(parse_range(p["env"]["NEURON_VISIBLE_DEVICES"]))
            extra = ktc(p)["kv_connector_extra_config"]
            ports = {int(p["url"].rsplit(":", 1)[1])} | {extra["metrics_port"] + r for r in range(8)}
            if role == "prefill":
                ports |= {extra["port"] + r for r in range(8)}
                assert max(cores) < 32
            else:
                assert min(cores) >= 32
            assert not cores & seen_cores and not ports & seen_ports
            seen_cores |= cores
            seen_ports |= ports
    assert seen_cores == set(range(64))
    assert cli.main(["config", "neuron", "--role", "prefill", "--model", "m", "--index", "4"]) == 2
    assert "share of this host is [0, 32)" in capsys.readouterr().err


def test_explicit_devices_and_extra_config(capsys):
    p = plan(capsys, "neuron", "--role", "prefill", "--model", "m", "--tp", "4", "--devices", "12-15",
             "--extra-config", '{"lease_s": 60, "backend_params": {"num_threads": 2}}', "--vllm-arg=--max-num-seqs=8",
             "--served-model-name", "llama", "--metrics-port", "0", "--event-dir", "/tmp/ev")
    assert p["env"]["NEURON_VISIBLE_DEVICES"] == "12-15" and p["env"]["KVPUSH_EVENT_DIR"] == "/tmp/ev"
    extra = ktc(p)["kv_connector_extra_config"]
    assert extra["lease_s"] == 60 and extra["backend_params"] == {"num_threads": 2} and "metrics_port" not in extra
    assert extra["model_id"] == "llama" and "--max-num-seqs=8" in p["argv"]
    assert cli.main(["config", "neuron", "--role", "prefill", "--model", "m", "--devices", "0-3"]) == 2  # tp 8
    assert "one logical core per TP rank" in capsys.readouterr().err


def test_cuda_plans(capsys):
    p = plan(capsys, "cuda", "--role", "prefill", "--model", "m")
    assert p["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and p["env"]["FI_PROVIDER"] == "efa"
    assert p["env"]["FI_EFA_USE_DEVICE_RDMA"] == "1" and p["env"]["FI_EFA_ENABLE_SHM_TRANSFER"] == "0"
    k = ktc(p)
    assert (k["kv_connector"], k["kv_connector_module_path"]) == ("KVPushCudaConnector", "kvpush_cuda.connector")
    assert k["kv_connector_extra_config"]["backend"] == "LIBFABRIC"
    d = plan(capsys, "cuda", "--role", "decode", "--model", "m")
    assert d["env"]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and "NEURON_RT_MAP_HBM" not in d["env"]
    ucx = plan(capsys, "cuda", "--role", "decode", "--model", "m", "--backend", "UCX", "--topology", "two-host",
               "--advertise-host", "10.1.0.2", "--tp", "8")
    # over UCX the cross-layer KV cache is asked for: the model runner that grants it (vLLM 0.26)
    assert ucx["env"] == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert ucx["prepend"] == {} and "VLLM_USE_V2_MODEL_RUNNER" not in p["env"]  # LIBFABRIC: per-layer caches
    assert ktc(ucx)["kv_connector_extra_config"]["backend"] == "UCX"


def test_router_plan(capsys):
    out = config(capsys, "neuron", "--role", "router", "--prefill-url", "http://10.0.0.1:8100",
                 "--prefill-url", "http://10.0.0.1:8101", "--decode-url", "http://10.0.0.2:8200")
    assert "kvpush router \\\n  --mode push" in out
    assert out.count("--prefill http://10.0.0.1:810") == 2 and "--decode http://10.0.0.2:8200" in out
    assert cli.main(["config", "cuda", "--role", "router", "--decode-url", "http://x:1"]) == 2


def test_shell_rendering_runs_in_bash_with_the_plan_environment(capsys, tmp_path):
    """The shell output, run by bash with `vllm` stubbed, exports exactly the plan's environment and
    passes the exact argv (JSON quoting survives)."""
    out = config(capsys, "neuron", "--role", "decode", "--model", "m", "--vllm-bin", str(tmp_path / "vllm"),
                 "--extra-config", '{"secret": "it\'s $HOME"}')
    p = plan(capsys, "neuron", "--role", "decode", "--model", "m", "--vllm-bin", str(tmp_path / "vllm"),
             "--extra-config", '{"secret": "it\'s $HOME"}')
    stub = tmp_path / "vllm"
    stub.write_text("#!/usr/bin/env python3\nimport json, os, sys\n"
                    "print(json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ)}))\n")
    stub.chmod(0o755)
    script = tmp_path / "decode.sh"
    script.write_text(out)
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "NEURON_RT_VISIBLE_CORES": "0-3", "LD_LIBRARY_PATH": "/x"})
    got = json.loads(run.stdout)
    assert got["argv"] == p["argv"][1:]
    assert ktc(p)["kv_connector_extra_config"]["secret"] == "it's $HOME"
    for k, v in p["env"].items():
        assert got["env"][k] == v
    assert "NEURON_RT_VISIBLE_CORES" not in got["env"]
    assert got["env"]["LD_LIBRARY_PATH"] == "/opt/amazon/efa/lib:/x"
    assert LaunchPlan.from_dict(p).environment({"NEURON_RT_VISIBLE_CORES": "1", "LD_LIBRARY_PATH": "/x"}) == {
        **p["env"], "LD_LIBRARY_PATH": "/opt/amazon/efa/lib:/x"}


def test_device_helpers():
    assert format_range([0, 1, 2, 3]) == "0-3" and format_range([5, 0, 2, 3]) == "0,2-3,5"
    assert parse_range("0,2-3,5") == [0, 2, 3, 5]
    assert device_slice("prefill", 1, 4, 8, "two-host") == [4, 5, 6, 7]
    assert device_slice("decode", 0, 4, 8, "same-host") == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="needs devices"):
        device_slice("decode", 1, 4, 8, "same-host")


def test_installed_kvpush_script_has_the_subcommands():
    import shutil
    import sys
    from pathlib import Path

    exe = Path(sys.executable).parent / "kvpush"
    if not exe.exists():
        exe = shutil.which("kvpush")
    assert exe, "kvpush console script not installed (pip install -e .)"
    out = subprocess.run([str(exe), "config", "cuda", "--role", "prefill", "--model", "m"], capture_output=True,
                         text=True, check=True).stdout
    assert "export CUDA_VISIBLE_DEVICES=0,1,2,3" in out and "KVPushCudaConnector" in out
