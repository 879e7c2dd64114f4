"""`kvpush doctor --target neuron` on a correct host of each Neuron SDK release kvpush supports, and on the
wrong stacks a first install meets, each named with its fix.  The Python stack is faked with distribution
metadata (and empty packages where the check looks for one) ahead of the real site-packages; the host's
runtime library and libfabric providers are faked (each has its own test in test_doctor.py).  The NIXL and
libfabric versions are each release's own: the plugin's pinned NIXL (the real nixl 1.3.2 wheel, installed by
scripts/setup-venv.sh) and the libfabric line of the SDK's EFA installer, never kvpush's newer NIXL."""

from pathlib import Path

import pytest

from kvpush_common.ops import doctor
from kvpush_common.testing import libfabric
from kvpush_common.transport import fabric_info
from kvpush_common.transport.efa import nixl_fabric_symbol, plugin_fabric_symbol
from kvpush_neuron import target
from kvpush_neuron.efa import neuron_efa_preflight
from kvpush_neuron.testing.fake_host import fake_trn_host
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
# What a stock host of each release has below Python (docs/neuron.md, facts table): the plugin's nixl==1.3.2
# (vllm-neuron 0.24's requirements/core.txt; 0.29's is in no stored source, so the same pin is assumed) and
# the SDK manifest's efa-installer 1.47 (2026-01-29), whose libfabric is of the 2.4 line (FABRIC_1.8).
SDK_NIXL, SDK_LIBFABRIC = libfabric.SDK_NIXL, (2, 4)

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
    monkeypatch.setattr(doctor, "check_nixl", lambda env, backends, **kw: [
        doctor.Check(f"nixl-plugin-{b}", True, "stub") for b in backends])  # loaded for real in its own test below
    host, sysfs = fake_trn_host(tmp_path / "host")  # each chip's EFA at the plugin's PCI address
    return lambda env: {c.name: c for c in neuron_checks(env, None, host=host, sysfs=sysfs, fabric_version=SDK_LIBFABRIC,
                                                         fabric_symbol=sdk_plugin_symbol())}


def sdk_plugin_symbol() -> str:
    """What the real nixl 1.3.2 wheel's LIBFABRIC plugin links (FABRIC_1.7), read from the installed wheel."""
    missing = libfabric.sdk_nixl_problem()
    assert missing is None, f"run scripts/setup-venv.sh: missing {missing}"
    return plugin_fabric_symbol(libfabric.SDK_NIXL_DIR / "nixl_cu13.libs" / "nixl" / "libplugin_LIBFABRIC.so")


@pytest.mark.parametrize("release", SDK_STACKS)
def test_a_correct_host_of_each_sdk_release_passes(monkeypatch, tmp_path, trn_host, release):
    monkeypatch.syspath_prepend(str(fake_stack(tmp_path / "site", SDK_STACKS[release])))
    checks = trn_host({**TUTORIAL_ENV, "NEURON_VISIBLE_DEVICES": "32-63"})  # the tutorial's decode, DP4 x TP8
    bad = [c for c in checks.values() if not c.ok and c.name != "python"]  # python: this machine's
    assert bad == [], bad
    assert checks["efa-affinity"].detail.startswith("trn2: cores:EFA 32-35:rdmap152s0 ")  # the plugin's table
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


def test_the_sdks_nixl_needs_an_older_libfabric_than_kvpushs():
    """The preflight asks the libfabric of the NIXL the host has: the SDK's nixl 1.3.2 runs on the SDK's EFA
    installer (libfabric 2.4); kvpush's 1.5.1 would not (FABRIC_1.10: libfabric >= 2.7, EFA installer >= 1.51.0),
    and a libfabric older than 1.20 is too old even for 1.3.2.  Symbols read from the real wheels."""
    sdk = sdk_plugin_symbol()
    ours = nixl_fabric_symbol()  # the venv's NIXL: kvpush's own pin
    assert (sdk, ours) == ("FABRIC_1.7", "FABRIC_1.10")
    env = {**TUTORIAL_ENV, "NEURON_VISIBLE_DEVICES": "0-3"}
    problems = neuron_efa_preflight(env, sysfs=Path("/nonexistent"), fabric_version=SDK_LIBFABRIC, fabric_symbol=sdk)
    assert len(problems) == 1 and "no EFA device" in problems[0], problems  # none on this machine
    newer = "\n".join(neuron_efa_preflight(env, sysfs=Path("/nonexistent"), fabric_version=SDK_LIBFABRIC,
                                           fabric_symbol=ours))
    assert "libfabric 2.4 lacks the FABRIC_1.10 symbols" in newer and "libfabric >= 2.7" in newer
    assert "nixl==1.3.2" in newer and "EFA installer >= 1.51.0" in newer
    old = "\n".join(neuron_efa_preflight(env, sysfs=Path("/nonexistent"), fabric_version=(1, 17), fabric_symbol=sdk))
    assert "libfabric 1.17 lacks the FABRIC_1.7 symbols" in old and "libfabric >= 1.20" in old


SDK_FABRIC = libfabric.find_libfabric("FABRIC_1.7")


@pytest.mark.skipif(SDK_FABRIC is None, reason="system library absent: no libfabric exporting FABRIC_1.7")
def test_the_sdks_own_nixl_loads_and_passes_the_preflight(tmp_path):
    """The real nixl 1.3.2 (the plugin's pin) imported as the server imports it, its LIBFABRIC plugin test-loaded
    over a libfabric exporting FABRIC_1.7 (the first of KVPUSH_LIBFABRIC_DIR, the vendored build, the system's),
    and the preflight on that libfabric's own version: no check fails, and nothing asks for kvpush's NIXL."""
    assert libfabric.sdk_nixl_problem() is None, f"run scripts/setup-venv.sh: missing {libfabric.sdk_nixl_problem()}"
    env = libfabric.environment(tmp_path / "lib", libfabric=SDK_FABRIC, nixl_dir=libfabric.SDK_NIXL_DIR)
    checks = {c.name: c for c in doctor.check_nixl(env, ["LIBFABRIC"], install_fix=target.NIXL_FIX)}
    assert checks["nixl"].ok and checks["nixl"].detail.endswith(f" {SDK_NIXL}"), checks["nixl"]
    assert "nixl-version" not in checks  # a release kvpush tests
    plugin = checks["nixl-plugin-LIBFABRIC"]
    assert plugin.ok and str(libfabric.SDK_NIXL_DIR) in plugin.detail, plugin
    info = fabric_info.probe_subprocess(env)
    assert info is not None and not isinstance(info, str), info
    problems = neuron_efa_preflight({**TUTORIAL_ENV, "NEURON_VISIBLE_DEVICES": "0-3"}, sysfs=Path("/nonexistent"),
                                    fabric_version=info.version, fabric_symbol=sdk_plugin_symbol())
    assert len(problems) == 1 and "no EFA device" in problems[0], problems  # none on this machine
