"""What `pip install kvpush` ships: the connector, the router and the device backends, never the test harness
(process launchers and fault injection that patch endpoint internals; the simulated Neuron plugin and faked trn
host) -- while a checkout's editable install, as
scripts/setup-venv.sh makes it, still imports the harness from the tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> list[str]:
    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"  # a copy: setuptools reuses a checkout's build/ folder, stale files and all
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("common", "kvpush_cuda", "kvpush_neuron"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src),
                    "-w", str(out)], check=True, cwd=out)
    (wheel,) = out.glob("kvpush-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def test_the_wheel_ships_the_connector_and_no_test_harness(wheel_names):
    for shipped in ("kvpush_common/vllm/connector.py", "kvpush_common/router/__init__.py",
                    "kvpush_cuda/__init__.py", "kvpush_neuron/connector.py"):
        assert shipped in wheel_names, shipped
    harness = [n for n in wheel_names if n.startswith(("kvpush_common/testing/", "kvpush_neuron/testing/"))]
    assert not harness, harness


def test_the_checkout_still_imports_the_harness():
    import kvpush_common.testing.vllm_cluster as cluster
    import kvpush_neuron.testing.simulated_plugin as simulated

    assert Path(cluster.__file__).resolve().is_relative_to(ROOT / "common" / "testing")
    assert Path(simulated.__file__).resolve().is_relative_to(ROOT / "kvpush_neuron" / "testing")
