"""The end-to-end benchmark's one entry point (scripts/bench/e2e.py): each --device x --workload reaches its own
driver's main, with every other argument passed through in order, and --help with both shows that driver's
options; the command a driver records reruns it through the same entry point."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench import e2e, rerun_command

ROOT = Path(__file__).resolve().parents[2]
CASES = [("cpu", "single", "scripts.bench.cpu.bench_cpu", "--qps"),
         ("cpu", "multiturn", "scripts.bench.cpu.multiturn", "--dtype"),
         ("cuda", "single", "scripts.bench.gpu.vllm_gpu", "--runners"),
         ("cuda", "multiturn", "scripts.bench.gpu.multiturn_gpu", "--first-tokens")]


@pytest.mark.parametrize("device,workload,module,_option", CASES)
def test_each_device_and_workload_runs_its_own_driver_with_the_other_arguments(monkeypatch, device, workload, module,
                                                                              _option):
    calls = []
    for _, _, name, _ in CASES:
        monkeypatch.setattr(importlib.import_module(name), "main",
                            lambda argv, prog, name=name: calls.append((name, argv, prog)) or 7)
    argv = ["--modes", "push,pull", "--device", device, "--out", "/tmp/x y", "--workload", workload, "--workdir", "w",
            "--variant", 'p=push:{"a": 1}']
    assert e2e.main(argv) == 7  # the driver's exit status
    assert calls == [(module, ["--modes", "push,pull", "--out", "/tmp/x y", "--workdir", "w", "--variant",
                               'p=push:{"a": 1}'],
                      f"python3 -m scripts.bench.e2e --device {device} --workload {workload}")]


@pytest.mark.parametrize("device,workload,module,option", CASES)
def test_help_with_device_and_workload_is_the_drivers(capsys, device, workload, module, option):
    with pytest.raises(SystemExit) as done:
        e2e.main(["--device", device, "--workload", workload, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python3 -m scripts.bench.e2e --device {device} --workload {workload}")
    assert option in text  # an option only this driver has
    assert not [o for d, w, _, o in CASES if (d, w) != (device, workload) and o in text], text  # no other driver's


def test_the_entry_point_runs_as_a_module_from_the_repository_root():
    run = subprocess.run([sys.executable, "-m", "scripts.bench.e2e", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and all(f"scripts/bench/{m.split('.', 2)[2].replace('.', '/')}.py" in run.stdout
                                       for _, _, m, _ in CASES), run.stdout
    run = subprocess.run([sys.executable, "-m", "scripts.bench.e2e", "--device", "cpu", "--requests", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--device and --workload are both required" in run.stderr
    run = subprocess.run([sys.executable, "-m", "scripts.bench.e2e", "--device", "tpu", "--workload", "single"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "invalid choice: 'tpu'" in run.stderr


def test_a_run_records_the_command_that_reruns_it():
    spec = importlib.import_module("scripts.bench.gpu.vllm_gpu").__spec__
    assert rerun_command(spec, ["--modes", "push", "--variant", 'p=push:{"a": 1}']) == (
        "python3 -m scripts.bench.gpu.vllm_gpu --modes push --variant 'p=push:{\"a\": 1}'")
    assert rerun_command(spec, [], "python3 -m scripts.bench.e2e --device cuda --workload single") == (
        "python3 -m scripts.bench.e2e --device cuda --workload single")
