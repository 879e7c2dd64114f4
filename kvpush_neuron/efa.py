"""EFA preflight for Neuron HBM over NIXL LIBFABRIC (trn2, trn3), and the NIXL backend choice.

NIXL moves Neuron HBM only through its LIBFABRIC plugin (FI_HMEM_NEURON, NIXL >= 0.10) and registers a
core's HBM on the EFA attached to that core's chip (libnrt's nrt_get_attached_efa_bdf).  Trainium2 and
Trainium3 chips both hold 8 physical NeuronCores (NEURON_LOGICAL_NC_CONFIG=2, the default, makes 4
logical ones), and every trn host has one 200 Gb/s EFA per chip: trn2.48xlarge 16 chips and 16 EFAs
(3.2 Tb/s), a Trn3 Gen1 UltraServer server 16 chips (12.8 Tb/s per 64 chips), a Trn3 Gen2 server 4
chips (28.8 Tb/s per 144 chips); trn2.3xlarge has no EFA.  So a rank's rail is its chip's, and a host
launched with fewer EFA interfaces than chips leaves some ranks without one.

The environment rules are the vLLM Neuron plugin's own (its DI tutorial exports only
FI_EFA_ENABLE_SHM_TRANSFER=0 for P and D on one host; FI_PROVIDER and FI_EFA_USE_DEVICE_RDMA may stay
unset: libfabric then picks efa and uses the device's RDMA where it has it).  A misconfigured host fails
late or gives wrong output (shm transport on one host), so each rule is checked at start-up and names
its fix.  Sources: docs/neuron.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from kvpush_common.transport.efa import (SYSFS_RDMA, EfaPreflightError, efa_devices, libfabric_problem,
                                         libfabric_version, nixl_fabric_symbol)
from kvpush_common.transport.nixl import TransportConfig

from .runtime import parse_core_list

PHYSICAL_CORES_PER_CHIP = 8  # Trainium2 (NeuronCore-v3) and Trainium3 (NeuronCore-v4)
# The fix for a libfabric too old for the installed NIXL: on a Neuron host the NIXL is the plugin's own pin
# (nixl==1.3.2, FABRIC_1.7: libfabric >= 1.20, which the SDK's EFA installer 1.47 has); only a NIXL installed
# over it (1.5.1: FABRIC_1.10, EFA installer >= 1.51.0) needs a newer one.
NEURON_NIXL_FIX = ("keep the NIXL the vLLM Neuron plugin pins (reinstall the SDK's plugin: its nixl==1.3.2 needs "
                   "FABRIC_1.7, which the SDK's EFA installer has) or install EFA installer >= 1.51.0 "
                   "(libfabric 2.7) and put /opt/amazon/efa/lib first on LD_LIBRARY_PATH")


def cores_per_chip(env: Mapping[str, str]) -> int:
    """Logical cores per Trainium2/3 chip: 8 physical cores / NEURON_LOGICAL_NC_CONFIG (default 2)."""
    lnc = int(env.get("NEURON_LOGICAL_NC_CONFIG") or 2)
    return PHYSICAL_CORES_PER_CHIP // lnc


def rank_rails(cores: list[int], devices: list[str], per_chip: int) -> list[str | None]:
    """The EFA rail of each rank's core (rank r runs on cores[r]): the chip's EFA, None if absent.
    Chip i is taken to own the i-th EFA device in sysfs order; NIXL itself asks libnrt
    (nrt_get_attached_efa_bdf), so this is for the count check and for logs."""
    return [devices[c // per_chip] if c // per_chip < len(devices) else None for c in cores]


def fabric_env_problems(env: Mapping[str, str], fabric_version: tuple[int, int] | None | str = "probe",
                        fabric_symbol: str | None = "probe") -> list[str]:
    """The provider, device-RDMA and libfabric rules as the plugin states them: unset is fine, a value
    that turns EFA or its RDMA off is not."""
    problems = []
    provider = env.get("FI_PROVIDER")
    if provider not in (None, "", "efa"):
        problems.append(f"FI_PROVIDER={provider}: set FI_PROVIDER=efa (or unset it) for EFA")
    rdma = str(env.get("FI_EFA_USE_DEVICE_RDMA", "")).strip().lower()
    if rdma in ("0", "false", "no", "off"):
        problems.append(f"FI_EFA_USE_DEVICE_RDMA={env['FI_EFA_USE_DEVICE_RDMA']} turns the NIC's device RDMA off: "
                        "unset it or set it to 1 (the plugin's EPD tutorial sets 1; reads of HBM never complete "
                        "without it)")
    version = libfabric_version() if fabric_version == "probe" else fabric_version
    if version is None:
        problems.append("libfabric.so.1 not found: install the EFA installer's libfabric (/opt/amazon/efa/lib) "
                        "and put it on LD_LIBRARY_PATH")
    elif problem := libfabric_problem(version, nixl_fabric_symbol() if fabric_symbol == "probe" else fabric_symbol,
                                      NEURON_NIXL_FIX):
        problems.append(problem)
    return problems


def neuron_efa_preflight(env: Mapping[str, str], *, sysfs: Path = SYSFS_RDMA, same_host: bool = True,
                         fabric_version: tuple[int, int] | None | str = "probe",
                         chips: int | None = None, fabric_symbol: str | None = "probe") -> list[str]:
    """Everything wrong with this host for Neuron HBM over LIBFABRIC/EFA, each with its fix (empty: ready).
    `same_host`: a peer (P or D) may run on this host, which needs the shm transport off.  `chips`: the
    Trainium chips of this host (/dev/neuron*), when known.  Cores are the server's NEURON_VISIBLE_DEVICES
    (the plugin's worker sets it to 0..TP-1 when the user did not); unset, the rails are not mapped."""
    problems = []
    cores = parse_core_list(env.get("NEURON_VISIBLE_DEVICES", ""))
    devices = efa_devices(sysfs)
    if not devices:
        problems.append(f"no EFA device under {sysfs}: Neuron HBM moves only over EFA (trn2.3xlarge has none and "
                        "cannot register FI_HMEM_NEURON); use trn2.48xlarge or a Trn3 server launched with all its "
                        "EFA interfaces (one per Trainium chip)")
    else:
        per_chip = cores_per_chip(env)
        missing = [c for c, rail in zip(cores, rank_rails(cores, devices, per_chip)) if rail is None]
        want = f"{chips} EFA interfaces, one per chip" if chips else "one EFA interface per Trainium chip"
        if missing:
            problems.append(f"cores {missing} sit on chips without an EFA rail ({len(devices)} EFA devices, "
                            f"{per_chip} logical cores per chip): launch the instance with all its EFA interfaces "
                            f"({want}; trn2.48xlarge and a Trn3 Gen1 server have 16)")
    if same_host and env.get("FI_EFA_ENABLE_SHM_TRANSFER") != "0":
        problems.append("FI_EFA_ENABLE_SHM_TRANSFER is not 0: set it to 0 when prefill and decode share a host "
                        "(the shm transport is taken otherwise and gives wrong output)")
    problems += fabric_env_problems(env, fabric_version, fabric_symbol)
    return problems


def neuron_transport(extra: Mapping, env: Mapping[str, str], *, sysfs: Path = SYSFS_RDMA, same_host: bool = True,
                     fabric_version: tuple[int, int] | None | str = "probe",
                     fabric_symbol: str | None = "probe") -> TransportConfig:
    """LIBFABRIC after a clean preflight (EfaPreflightError lists every problem otherwise); any other
    backend is refused, since NIXL's Neuron HBM support lives in its LIBFABRIC plugin."""
    backend = str(extra.get("backend") or "LIBFABRIC").upper()
    if backend != "LIBFABRIC":
        raise EfaPreflightError(f"NIXL backend {backend!r} cannot register Neuron HBM: use LIBFABRIC (EFA)")
    problems = neuron_efa_preflight(env, sysfs=sysfs, same_host=same_host, fabric_version=fabric_version,
                                    fabric_symbol=fabric_symbol)
    if problems:
        raise EfaPreflightError("Neuron LIBFABRIC/EFA preflight failed:\n  - " + "\n  - ".join(problems))
    params = {k: str(v) for k, v in dict(extra.get("backend_params") or {}).items()}
    return TransportConfig(backend="LIBFABRIC", backend_params=params)
