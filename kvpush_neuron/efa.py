"""EFA preflight for Neuron HBM over NIXL LIBFABRIC (trn2), and the NIXL backend choice.

NIXL moves Neuron HBM only through its LIBFABRIC plugin (FI_HMEM_NEURON, NIXL >= 0.10).  On trn2.48xlarge
each Trainium2 chip has one 200 Gb/s EFA, shared by its logical cores; NIXL registers a core's HBM on
that chip's EFA only.  A misconfigured host fails late or gives wrong output (shm transport on one
host), so every rule is checked at start-up and each problem names its fix.

`efa_devices` and `libfabric_version` are the same as kvpush_cuda.efa's (the backends may not share
code except through kvpush_common).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from kvpush_common.transport.efa import SYSFS_RDMA, EfaPreflightError, efa_devices, env_and_library_problems
from kvpush_common.transport.nixl import TransportConfig

from .runtime import core_visibility_problem, parse_core_list

TRN2_PHYSICAL_CORES_PER_CHIP = 8
TRN2_EFA_PER_INSTANCE = 16  # trn2.48xlarge: 16 chips, one EFA each


def cores_per_chip(env: Mapping[str, str]) -> int:
    """Logical cores per Trainium2 chip: 8 physical cores / NEURON_LOGICAL_NC_CONFIG (default 2)."""
    lnc = int(env.get("NEURON_LOGICAL_NC_CONFIG") or 2)
    return TRN2_PHYSICAL_CORES_PER_CHIP // lnc


def rank_rails(cores: list[int], devices: list[str], per_chip: int) -> list[str | None]:
    """The EFA rail of each rank's core (rank r runs on cores[r]): the chip's EFA, None if absent.
    Chip i is taken to own the i-th EFA device in sysfs order; NIXL itself asks libnrt
    (nrt_get_attached_efa_bdf), so this is for the count check and for logs."""
    return [devices[c // per_chip] if c // per_chip < len(devices) else None for c in cores]


def neuron_efa_preflight(env: Mapping[str, str], *, sysfs: Path = SYSFS_RDMA, same_host: bool = True,
                         fabric_version: tuple[int, int] | None | str = "probe") -> list[str]:
    """Everything wrong with this host for Neuron HBM over LIBFABRIC/EFA, each with its fix (empty: ready).
    `same_host`: a peer (P or D) may run on this host, which needs the shm transport off."""
    problems = []
    cores = parse_core_list(env.get("NEURON_VISIBLE_DEVICES", ""))
    if core_visibility_problem(env):
        problems.append(core_visibility_problem(env))
    elif not cores:
        problems.append("NEURON_VISIBLE_DEVICES is not set: set it to this server's logical cores (e.g. 0-3 for "
                        "TP4) so each rank's chip and EFA rail are known")
    devices = efa_devices(sysfs)
    if not devices:
        problems.append(f"no EFA device under {sysfs}: Neuron HBM moves only over EFA (trn2.3xlarge has none and "
                        "cannot register FI_HMEM_NEURON); use trn2.48xlarge launched with all 16 EFA interfaces")
    else:
        per_chip = cores_per_chip(env)
        missing = [c for c, rail in zip(cores, rank_rails(cores, devices, per_chip)) if rail is None]
        if missing:
            problems.append(f"cores {missing} sit on chips without an EFA rail ({len(devices)} EFA devices, "
                            f"{per_chip} logical cores per chip): launch trn2.48xlarge with all "
                            f"{TRN2_EFA_PER_INSTANCE} EFA interfaces, one per Neuron device")
    if same_host and env.get("FI_EFA_ENABLE_SHM_TRANSFER") != "0":
        problems.append("FI_EFA_ENABLE_SHM_TRANSFER is not 0: set it to 0 when prefill and decode share a host "
                        "(the shm transport is taken otherwise and gives wrong output)")
    problems += env_and_library_problems(env, fabric_version)
    return problems


def neuron_transport(extra: Mapping, env: Mapping[str, str], *, sysfs: Path = SYSFS_RDMA, same_host: bool = True,
                     fabric_version: tuple[int, int] | None | str = "probe") -> TransportConfig:
    """LIBFABRIC after a clean preflight (EfaPreflightError lists every problem otherwise); any other
    backend is refused, since NIXL's Neuron HBM support lives in its LIBFABRIC plugin."""
    backend = str(extra.get("backend") or "LIBFABRIC").upper()
    if backend != "LIBFABRIC":
        raise EfaPreflightError(f"NIXL backend {backend!r} cannot register Neuron HBM: use LIBFABRIC (EFA)")
    problems = neuron_efa_preflight(env, sysfs=sysfs, same_host=same_host, fabric_version=fabric_version)
    if problems:
        raise EfaPreflightError("Neuron LIBFABRIC/EFA preflight failed:\n  - " + "\n  - ".join(problems))
    params = {k: str(v) for k, v in dict(extra.get("backend_params") or {}).items()}
    return TransportConfig(backend="LIBFABRIC", backend_params=params)
