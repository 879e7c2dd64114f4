"""`kvpush doctor --target neuron|cuda`: each check, its fix, the exit status and --json; on this
machine (no Neuron, no EFA, CPU torch) and on faked hosts (fake /dev, sysfs and libfabric version)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpush_common.testing import libfabric

from kvpush_common.ops import cli, deploy, doctor
from kvpush_cuda.target import cuda_checks
from kvpush_neuron.testing.fake_host import fake_trn_host
from kvpush_neuron.target import neuron_checks

HERE_HAS_NEURON = any(Path("/dev").glob("neuron*"))
HERE_HAS_EFA = bool(os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"))


def by_name(checks):
    return {c.name: c for c in checks}


def fake_dev(tmp_path, prefix, n):
    dev = tmp_path / "dev"
    dev.mkdir(parents=True)
    for i in range(n):
        (dev / f"{prefix}{i}").touch()
    (dev / f"{prefix}ctl").touch()  # not a device node of interest
    return dev


def fake_sysfs(tmp_path, count):
    root = tmp_path / "infiniband"
    drivers = tmp_path / "drivers" / "efa"
    drivers.mkdir(parents=True)
    for i in range(count):
        (root / f"rdmap{i:02d}s0" / "device").mkdir(parents=True)
        os.symlink(drivers, root / f"rdmap{i:02d}s0" / "device" / "driver")
    return root


def plan_json(capsys, target, *argv):
    assert cli.main(["config", target, *argv, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.skipif(HERE_HAS_NEURON or HERE_HAS_EFA, reason="this test expects a host without Neuron and EFA")
def test_neuron_doctor_here_fails_and_says_why(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvpush_common.ops.cli", "doctor", "--target", "neuron"],
                         capture_output=True, text=True, env={**os.environ, "NEURON_RT_VISIBLE_CORES": "0-3"})
    assert out.returncode == 1, out.stderr
    text = out.stdout
    assert text.startswith("kvpush doctor --target neuron:") and text.rstrip().endswith("failed check(s) above")
    assert "[FAIL] neuron-devices" in text and "trn2.48xlarge" in text
    assert "[FAIL] neuron-torch" in text and "nothing gives torch its `neuron` device" in text
    assert "https://pip.repos.neuron.amazonaws.com" in text and "then pip install kvpush" in text
    assert "[FAIL] neuron-runtime" in text and "libnrt.so.1" in text
    assert "NEURON_RT_VISIBLE_CORES=0-3 is set" in text and "worker refuses it" in text
    assert "no EFA device" in text and "FI_EFA_ENABLE_SHM_TRANSFER is not 0" in text
    assert "[  ok] python" in text and "[  ok] nixl:" in text


@pytest.mark.skipif(HERE_HAS_EFA, reason="this test expects a host without EFA/libfabric")
def test_json_output_and_plans(capsys, tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(plan_json(capsys, "neuron", "--role", "prefill", "--model", "m")))
    rc = cli.main(["doctor", "--target", "neuron", "--plan", str(p), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and report["target"] == "neuron" and report["ok"] is False
    checks = {c["name"]: c for c in report["checks"]}
    # the plan's environment is checked: its env rules pass, the host's hardware does not
    assert checks["prefill0: neuron-env"]["status"] == "ok"
    assert "NEURON_VISIBLE_DEVICES=0-7" in checks["prefill0: neuron-env"]["detail"]
    efa = " ".join(checks["prefill0: efa"]["problems"])
    assert "no EFA device" in efa and "FI_EFA_USE_DEVICE_RDMA" not in efa and "SHM" not in efa
    assert all(set(c) >= {"name", "ok", "status", "detail", "problems"} for c in report["checks"])
    with pytest.raises(SystemExit):
        cli.main(["doctor", "--target", "cuda", "--plan", str(p)])  # a neuron plan for the cuda target
    assert "plan is for target 'neuron'" in capsys.readouterr().err


@pytest.fixture
def no_plugin_load(monkeypatch):
    """The NIXL plugin test-load (a subprocess) has its own test."""
    monkeypatch.setattr(doctor, "check_nixl", lambda env, backends, **kw: [
        doctor.Check(f"nixl-plugin-{b}", True, "stub") for b in backends])


def test_neuron_checks_on_a_faked_trn2_host(capsys, tmp_path, no_plugin_load):
    plan = plan_json(capsys, "neuron", "--role", "decode", "--model", "m")
    env = deploy.LaunchPlan.from_dict(plan).environment({})
    host, sysfs = fake_trn_host(tmp_path)  # trn2.48xlarge: 16 devices, each chip's EFA where the plugin's table says
    checks = by_name(neuron_checks(env, plan, host=host, sysfs=sysfs, fabric_version=(2, 7)))
    assert checks["neuron-devices"].ok and "16 Neuron devices" in checks["neuron-devices"].detail
    assert checks["neuron-env"].ok and checks["efa"].ok, (checks["neuron-env"], checks["efa"])
    assert checks["efa-affinity"].ok and checks["efa-affinity"].detail == "trn2: cores:EFA 32-35:rdmap152s0 36-39:rdmap131s0"
    assert checks["python"].ok == (sys.version_info >= (3, 11))

    # the mistakes a first launch makes, each named with its fix
    bad = {**env, "NEURON_VISIBLE_DEVICES": "", "NEURON_RT_VISIBLE_CORES": "32-39", "FI_EFA_ENABLE_SHM_TRANSFER": "1"}
    checks = by_name(neuron_checks(bad, plan, host=host, sysfs=fake_sysfs(tmp_path / "few", 4), fabric_version=(2, 1)))
    text = "\n".join(checks["neuron-env"].problems)
    assert "NEURON_RT_VISIBLE_CORES=32-39 is set" in text and "worker refuses it" in text
    assert "NEURON_RT_MAP_HBM" not in text  # the plugin's worker sets it itself
    efa = "\n".join(checks["efa"].problems)
    assert "FI_EFA_ENABLE_SHM_TRANSFER is not 0" in efa and "FABRIC_1.10" in efa
    assert not any(p.startswith("NEURON_") for p in checks["efa"].problems)  # reported once, under neuron-env
    two_host = {**plan, "extra": {**plan["extra"], "same_host": False}}
    checks = by_name(neuron_checks({**env, "FI_EFA_ENABLE_SHM_TRANSFER": "1"}, two_host, host=host, sysfs=sysfs,
                                   fabric_version=(2, 7)))
    assert checks["efa"].ok  # the shm rule is for P and D on one host only
    few_chips = by_name(neuron_checks(env, plan, host=fake_trn_host(tmp_path / "small", devices=4)[0], sysfs=sysfs,
                                      fabric_version=(2, 7)))
    assert "beyond the 16 logical cores" in "\n".join(few_chips["neuron-env"].problems)  # decode wants 32-39


def test_libfabric_providers_and_hmem_are_named():
    from kvpush_common.transport.fabric_info import FabricInfo

    def check(info, env=None):
        return doctor.check_fabric(env or {}, "Neuron HBM", probe=lambda env: info)

    good = check(FabricInfo((2, 7), {"efa": True, "shm": True, "tcp;ofi_rxm": False}))
    assert good.ok and good.detail == "libfabric 2.7; providers: efa (FI_HMEM), shm (FI_HMEM), tcp;ofi_rxm"
    no_hmem = check(FabricInfo((2, 7), {"efa": False}))
    assert not no_hmem.ok and "offers no FI_HMEM: Neuron HBM cannot register" in no_hmem.problems[0]
    tcp_only = check(FabricInfo((2, 6), {"tcp": False}), {"FI_PROVIDER": "tcp"})
    assert not tcp_only.ok and "no efa provider (FI_PROVIDER=tcp limits the list)" in tcp_only.problems[0]
    assert "LD_LIBRARY_PATH" in check(None).problems[0] and check("probe crashed").problems == ("probe crashed",)


@pytest.mark.skipif(libfabric.find_libfabric() is None, reason="system library absent: no libfabric with FABRIC_1.10")
def test_libfabric_probe_reads_the_real_library(tmp_path):
    """fi_getinfo through ctypes on the vendored build: its version and the providers a host without EFA has."""
    from kvpush_common.transport.fabric_info import probe_subprocess

    (tmp_path / "libfabric.so.1").symlink_to(libfabric.find_libfabric())
    info = probe_subprocess({**os.environ, "LD_LIBRARY_PATH": str(tmp_path)})
    assert info.version >= (1, 10) and "efa" not in info.providers and "shm" in info.providers, info
    only_shm = probe_subprocess({**os.environ, "LD_LIBRARY_PATH": str(tmp_path), "FI_PROVIDER": "shm"})
    assert set(only_shm.providers) == {"shm"}


def test_cuda_checks_on_a_faked_p5en_host(capsys, tmp_path, no_plugin_load):
    plan = plan_json(capsys, "cuda", "--role", "prefill", "--model", "m")
    env = deploy.LaunchPlan.from_dict(plan).environment({})
    dev, sysfs = fake_dev(tmp_path, "nvidia", 8), fake_sysfs(tmp_path, 16)
    checks = by_name(cuda_checks(env, plan, dev=dev, sysfs=sysfs, fabric_version=(2, 7)))
    assert checks["gpus"].ok and checks["gpus"].detail == "8 NVIDIA GPUs"
    assert checks["cuda-env"].ok and checks["efa"].ok
    assert not checks["torch-cuda"].ok and "CPU build" in checks["torch-cuda"].problems[0]  # this venv: torch+cpu
    wrong = by_name(cuda_checks({**env, "CUDA_VISIBLE_DEVICES": "6,7,8,9"}, plan, dev=dev, sysfs=sysfs,
                                fabric_version=(2, 7)))
    assert "beyond the 8 of this host" in wrong["cuda-env"].problems[0]
    ucx = {**plan, "extra": {**plan["extra"], "backend": "UCX"}}
    checks = by_name(cuda_checks({}, ucx, dev=dev, sysfs=tmp_path / "none", fabric_version=None))
    assert checks["efa"].ok and "skipped" in checks["efa"].detail
    assert "nixl-plugin-UCX" in checks and "nixl-plugin-LIBFABRIC" not in checks


def test_nixl_plugins_are_test_loaded():
    """UCX's plugin loads on this machine; LIBFABRIC's fails without a FABRIC_1.10 libfabric, and says so."""
    checks = by_name(doctor.check_nixl(dict(os.environ), ["UCX", "LIBFABRIC", "NOSUCH"]))
    assert checks["nixl"].ok
    assert checks["nixl-plugin-UCX"].ok, checks["nixl-plugin-UCX"]
    assert not checks["nixl-plugin-NOSUCH"].ok and "NIXL_PLUGIN_DIR" in checks["nixl-plugin-NOSUCH"].problems[0]
    lf = checks["nixl-plugin-LIBFABRIC"]
    if not HERE_HAS_EFA:
        assert not lf.ok and "libfabric" in lf.problems[0] and "FABRIC_1.10" in lf.problems[0]


def test_a_target_that_does_not_import_is_reported(monkeypatch, capsys):
    monkeypatch.setattr(deploy, "load_targets", lambda: ({}, {"neuron": "kvpush_neuron.target:TARGET: "
                                                                        "ImportError: boom"}))
    assert cli.main(["doctor", "--target", "neuron"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] target: cannot load" in out and "boom" in out


def test_rendering_and_exit_status_follow_failures(capsys):
    checks = [doctor.Check("a", True, "fine"), doctor.Check("b", False, "meh", ("x: do y",), warn=True)]
    assert doctor.failed(checks) == []
    text = doctor.render_checks("neuron", checks)
    assert "[warn] b: meh" in text and "- x: do y" in text and text.rstrip().endswith("READY")
    report = json.loads(doctor.checks_json("neuron", checks + [doctor.Check("c", False, "bad", ("z",))]))
    assert report["ok"] is False and [c["status"] for c in report["checks"]] == ["ok", "warn", "FAIL"]


def test_each_library_the_libfabric_plugin_links_gets_its_own_fix():
    """kvpush doctor names the fix for whichever library NIXL's LIBFABRIC plugin cannot find (measured in
    the libfabric test tier): libfabric with FABRIC_1.10, libcuda (none on Trainium), libcudart, hwloc."""
    fix = doctor.plugin_load_fix
    assert "FABRIC_1.10" in fix("libfabric.so.1: cannot open shared object file")
    assert "FABRIC_1.10" in fix("version `FABRIC_1.10' not found (required by libplugin_LIBFABRIC.so)")
    # the Neuron plugin's nixl 1.3.2 links FABRIC_1.7: the fix names the libfabric release that has it
    assert "libfabric >= 1.20" in fix("libfabric.so.1: version `FABRIC_1.7' not found (required by x.so)")
    assert "libfabric >= 2.7" in fix("libfabric.so.1: version `FABRIC_1.10' not found (required by x.so)")
    assert "libcuda_standin.c" in fix("libcuda.so.1: cannot open shared object file")
    assert "nvidia-cuda-runtime" in fix("libcudart.so.13: cannot open shared object file")
    assert fix("libhwloc.so.15: cannot open shared object file") == "apt-get install libhwloc15"
    assert fix("libweird.so: nope") == "install the libraries it names"
