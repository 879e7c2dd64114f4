import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import settings

# CI runs each property test on a fixed sequence of examples (no flaky red builds); locally they
# explore new random examples every run.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def _has_gpu() -> bool:
    """An NVIDIA GPU is on this host when the driver lists one.  Whether torch was built with CUDA is not
    asked here: a missing or CPU-only torch is something pip fixes, so the GPU tests then fail, not skip."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def _has_neuron() -> bool:
    """A Trainium/Neuron device is on this host when its driver made /dev/neuron* nodes."""
    return any(Path("/dev").glob("neuron*"))


# A test's kind comes from its folder: everything under tests/nixl is marked `nixl`, tests/vllm `vllm`,
# tests/chaos `chaos` (a chaos test that also runs real NIXL or vLLM carries that mark itself, as do the
# hardware tests in tests/hw).  tests/unit and tests/deploy get no kind mark.
HERE = Path(__file__).resolve().parent
FOLDER_MARKS = {HERE / "nixl": "nixl", HERE / "vllm": "vllm", HERE / "chaos": "chaos", HERE / "libfabric": "libfabric"}

# `slow` (what `scripts/test.sh` leaves to `--all`; about 15 min remain on 2 cores): the libfabric tier; every
# `vllm` test outside QUICK_VLLM (each module starts its own vLLM servers, ~30-60 s a start here: the long
# end-to-end, drop-in, xPyD, benchmark, restart and chaos-vLLM runs); and the conformance scenarios' second run
# on the simulated Neuron backend (`backend_kind` neuron-sim: the same scenarios as `host`; mixed Neuron <-> host
# pairs, tests/nixl/test_neuron_layouts.py and the hwcheck pair stay).  A new vLLM module is `slow` unless
# listed here.
SLOW_FOLDERS = (HERE / "libfabric",)
QUICK_VLLM = {HERE / "vllm" / name for name in ("test_vllm_compat.py", "test_entry_classes.py",  # in-process
                                                "test_vllm_pull.py")}  # one P + D pair and the router (~1 min)
SLOW_BACKEND_KINDS = {"neuron-sim"}


def _slow(item, path: Path, folders) -> bool:
    if any(folder in folders for folder in SLOW_FOLDERS):
        return True
    if item.get_closest_marker("vllm") is not None and path not in QUICK_VLLM:
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("backend_kind") in SLOW_BACKEND_KINDS


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(config, items):
    gpu = _has_gpu()
    neuron = _has_neuron()
    for item in items:
        path = Path(item.path).resolve()
        folders = path.parents
        for folder, mark in FOLDER_MARKS.items():
            if folder in folders:
                item.add_marker(getattr(pytest.mark, mark))
        if _slow(item, path, folders):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") is not None and not gpu:
            item.add_marker(pytest.mark.skip(reason="hardware absent: no NVIDIA GPU on this machine"))
        if item.get_closest_marker("neuron") is not None and not neuron:
            item.add_marker(pytest.mark.skip(reason="hardware absent: no Trainium/Neuron device on this machine"))
