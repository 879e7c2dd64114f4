import os
import shutil
from pathlib import Path

import pytest
from hypothesis import settings

# CI runs each property test on a fixed sequence of examples (no flaky red builds); locally they
# explore new random examples every run.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")



def _has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _has_neuron() -> bool:
    return any(Path("/dev").glob("neuron*")) or bool(os.environ.get("KVPUSH_FORCE_NEURON"))


# A test's kind comes from its folder: everything under tests/nixl is marked `nixl`, tests/vllm `vllm`,
# tests/chaos `chaos` (a chaos test that also runs real NIXL or vLLM carries that mark itself, as do the
# hardware tests in tests/hw).  tests/unit and tests/deploy get no kind mark.
HERE = Path(__file__).resolve().parent
FOLDER_MARKS = {HERE / "nixl": "nixl", HERE / "vllm": "vllm", HERE / "chaos": "chaos", HERE / "libfabric": "libfabric"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(config, items):
    gpu = _has_gpu()
    neuron = _has_neuron()
    for item in items:
        folders = Path(item.path).resolve().parents
        for folder, mark in FOLDER_MARKS.items():
            if folder in folders:
                item.add_marker(getattr(pytest.mark, mark))
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="hardware absent: no NVIDIA GPU on this machine"))
        if "neuron" in item.keywords and not neuron:
            item.add_marker(pytest.mark.skip(reason="hardware absent: no Trainium/Neuron device on this machine"))
