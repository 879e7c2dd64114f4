"""`kvpush doctor --target neuron` on a correct host of each Neuron SDK release kvpush supports, and on the
wrong stacks a first install meets, each named with its fix.  The Python stack is faked with distribution
metadata (and empty packages where the check looks for one) ahead of the real site-packages; the host's
runtime library, libfabric and NIXL plugin load are faked as well (each has its own test in test_doctor.py)."""

from pathlib import Path

import pytest

from kvpush_common.ops import doctor
from kvpush_neuron import target
from kvpush_neuron.target import neuron_checks, plugin_vllm_check

# The Python stack of each Neuron SDK release, as its release content and component notes name it
# (docs/neuron.md); a build number no stored source names is written `x` (any build of that line).
SDK_STACKS = {
    # SDK 2.32 (08/17/2026): vllm-neuron 0.24.0.1.1.0 pins vLLM 0.24.0 and needs libtorch-neuronx-lite (its
    # requirements/core.txt); the trn2 manifest ships libtorch_neuronx_lite 2.11.0.1.0.1284 and no torch-neuronx
    "2.32": {"torch": "2.11.0", "libtorch-neuronx-lite": "2.11.0.1.0.1284", "vllm-neuron": "0.24.0.1.1.0+e8242a9",
             "vllm": "0.24.0"},
    # SDK 2.33 (10/19/2026): vllm-neuron 0.29.0.1.2.0 (vLLM 0.29.0, torch 2.13); libtorch-neuronx-lite still ships
    "2.33": {"torch": "2.13.0", "libtorch-neuronx-lite": "2.13.0.1.0.x", "vllm-neuron": "0.29.0.1.2.0",
             "vllm": "0.29.0"},
    # SDK >= 2.33 ships TorchNeuron, torch-neuronx 2.13.3.0 / 2.14.3.0 (the native `neuron` device); the plugin is
    # moving to it (2.34 is libtorch-neuronx-lite's last release): that stack, without libtorch-neuronx-lite
    "torchneuron": {"torch": "2.13.0", "torch-neuronx": "2.13.3.0", "vllm-neuron": "0.29.0.1.2.0", "vllm": "0.29.0"},
}
MODULES = {"libtorch-neuronx-lite": "libtorch_neuronx_lite", "torch-neuronx": "torch_neuronx",
           "vllm-neuron": "vllm_neuron"}

# What the plugin's DI tutorial exports (tutorial-di-1p1d-xpyd.md) for the decode of its 1P1D: its worker sets
# NEURON_RT_MAP_HBM=1 and one NEURON_RT_VISIBLE_CORES per rank itself; nothing else of EFA is set.
TUTORIAL_ENV = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "0.0.0.0", "FI_EFA_ENABLE_SHM_TRANSFER": "0",
                "NEURON_VISIBLE_DEVICES": "32-63", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5659"}


def fake_stack(root: Path, dists: dict[str, str]) -> Path:
    root.mkdir(parents=True)
    for name, version in dists.items():
        info = root / f"{name.replace('-', '_')}-{version.split('+')[0]}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        if name in MODULES:
            (root / MODULES[name]).mkdir()
            (root / MODULES[name] / "__init__.py").write_text("")
    return root


@pytest.fixture
def trn_host(monkeypatch, tmp_path):
    """trn2.48xlarge: 16 Neuron devices, 16 EFAs, libnrt loads, libfabric offers efa with FI_HMEM."""
    real = doctor.check_library
    monkeypatch.setattr(doctor, "check_library", lambda name, soname, fix, **kw: doctor.Check(name, True, soname)
                        if soname == "libnrt.so.1" else real(name, soname, fix, **kw))
    monkeypatch.setattr(doctor, "check_fabric", lambda env, hmem_for, probe=None: doctor.Check("libfabric", True, "efa"))
    monkeypatch.setattr(doctor, "check_nixl", lambda env, backends: [doctor.Check(f"nixl-plugin-{b}", True, "stub")
                                                                     for b in backends])
    dev = tmp_path / "dev"
    dev.mkdir()
    for i in range(16):
        (dev / f"neuron{i}").touch()
    sysfs = tmp_path / "infiniband"
    drivers = tmp_path / "drivers" / "efa"
    drivers.mkdir(parents=True)
    for i in range(16):
        (sysfs / f"rdmap{i:02d}s0" / "device").mkdir(parents=True)
        (sysfs / f"rdmap{i:02d}s0" / "device" / "driver").symlink_to(drivers)
    return lambda env: {c.name: c for c in neuron_checks(env, None, dev=dev, sysfs=sysfs, fabric_version=(2, 7))}


@pytest.mark.parametrize("release", SDK_STACKS)
def test_a_correct_host_of_each_sdk_release_passes(monkeypatch, tmp_path, trn_host, release):
    monkeypatch.syspath_prepend(str(fake_stack(tmp_path / "site", SDK_STACKS[release])))
    checks = trn_host(TUTORIAL_ENV)
    bad = [c for c in checks.values() if not c.ok and c.name != "python"]  # python: this machine's
    assert bad == [], bad
    assert "`neuron` device" in checks["neuron-torch"].detail
    if release in ("2.32", "2.33"):
        assert f"Neuron SDK {release}" in checks["vllm-neuron-pairing"].detail


WRONG = {
    "xla": ({"torch": "2.9.0", "torch-neuronx": "2.9.0.2.15.32035", "vllm-neuron": "0.24.0.1.1.0", "vllm": "0.24.0"},
            "neuron-torch", "is PyTorch/XLA"),
    "placeholder": ({"torch": "2.11.0", "torch-neuronx": "1.0", "vllm-neuron": "0.24.0.1.1.0", "vllm": "0.24.0"},
                    "neuron-torch", "PyPI's empty placeholder"),
    "torch-skew": ({"torch": "2.13.0", "libtorch-neuronx-lite": "2.11.0.1.0.1284", "vllm-neuron": "0.24.0.1.1.0",
                    "vllm": "0.24.0"}, "neuron-torch", "install libtorch-neuronx-lite==2.13.*"),
    "vllm-skew": ({"torch": "2.11.0", "libtorch-neuronx-lite": "2.11.0.1.0.1284", "vllm-neuron": "0.24.0.1.1.0",
                   "vllm": "0.32.0"}, "vllm-neuron-pairing", "built for vLLM 0.24.0 but vllm 0.32.0"),
    "nxdi-plugin": ({"torch": "2.11.0", "libtorch-neuronx-lite": "2.11.0.1.0.1284", "vllm-neuron": "0.5.0",
                     "vllm": "0.16.0"}, "vllm-neuron-pairing", "predates the rewritten plugin"),
}


@pytest.mark.parametrize("case", WRONG)
def test_a_wrong_stack_is_named_with_its_fix(monkeypatch, tmp_path, trn_host, case):
    dists, check, needle = WRONG[case]
    monkeypatch.syspath_prepend(str(fake_stack(tmp_path / "site", dists)))
    c = trn_host(TUTORIAL_ENV)[check]
    assert not c.ok and not c.warn and needle in "\n".join(c.problems), c


def test_the_plugin_and_its_vllm_are_checked_as_a_pair():
    good = plugin_vllm_check(("vllm-neuron", "0.29.0.1.2.0+a1b2c3"), ("vllm", "0.29.0"))
    assert good.ok and "Neuron SDK 2.33" in good.detail
    assert plugin_vllm_check(("vllm-neuron", "0.24.0.1.1.0"), ("vllm", "0.24.0")).ok
    skew = plugin_vllm_check(("vllm-neuron", "0.29.0.1.2.0"), ("vllm", "0.32.0"))
    assert not skew.ok and not skew.warn and "built for vLLM 0.29.0 but vllm 0.32.0" in skew.problems[0]
    sdk231 = plugin_vllm_check(("vllm-neuron", "0.21.0.1.0.0"), ("vllm", "0.21.0"))
    assert not sdk231.ok and not sdk231.warn and "Neuron SDK >= 2.32" in sdk231.problems[0]
    later = plugin_vllm_check(("vllm-neuron", "0.33.0.1.3.0"), ("vllm", "0.33.0"))  # a plugin pinning a later vLLM
    assert not later.ok and later.warn and "not one kvpush tests" in later.problems[0]
    ancient = plugin_vllm_check(("vllm-neuron", "0.1.0"), ("vllm", "0.24.0"))
    assert not ancient.ok and not ancient.warn and "predates" in ancient.problems[0]
    assert plugin_vllm_check(None, ("vllm", "0.29.0")).warn


def test_a_missing_libcuda_gets_the_plugins_stub_fix():
    """NIXL's LIBFABRIC plugin links libcuda.so.1; the plugin's setup guide installs a stub, which is enough."""
    err = ("NIXL would refuse backend 'LIBFABRIC' (\"unsupported backend\"): libcuda.so.1: cannot open shared "
           "object file; fix: " + doctor.plugin_load_fix("libcuda.so.1: cannot open"))
    c = target._stub_fix(doctor.Check("nixl-plugin-LIBFABRIC", False, "x does not load", (err,)))
    assert "cuda-cudart-dev-12-6" in c.problems[0] and "libcuda_standin.c" not in c.problems[0]
    ok = doctor.Check("nixl-plugin-LIBFABRIC", True, "loads")
    assert target._stub_fix(ok) is ok
