"""Choosing the NIXL backend for GPUs, and checking an EFA host before LIBFABRIC is started.

LIBFABRIC over EFA is the production path on AWS (p5en); UCX serves NVLink and single hosts.  A
misconfigured EFA host does not fail loudly: NIXL falls back to slower paths or refuses memory
late.  So each rule is checked at start-up and a failure names its fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from kvpush_common.transport.efa import SYSFS_RDMA, EfaPreflightError, common_efa_problems, efa_devices
from kvpush_common.transport.nixl import TransportConfig

__all__ = ["EfaPreflightError", "backend_name", "choose_transport", "efa_devices", "efa_preflight"]


def efa_preflight(env: Mapping[str, str], *, sysfs: Path = SYSFS_RDMA, gpus: int = 1,
                  fabric_version: tuple[int, int] | None | str = "probe") -> list[str]:
    """Everything wrong with this host for NIXL LIBFABRIC over EFA from GPUs (p5en: 2 rails per GPU
    would be ideal; one per GPU is the minimum checked), each with its fix."""
    return common_efa_problems(env, sysfs=sysfs, accelerators=gpus, rails_per_accelerator=1,
                               fabric_version=fabric_version, what="GPUs")


def backend_name(extra: Mapping, sysfs: Path = SYSFS_RDMA) -> str:
    """`backend` from kv_connector_extra_config, else LIBFABRIC when EFA devices exist, else UCX."""
    backend = str(extra.get("backend") or ("LIBFABRIC" if efa_devices(sysfs) else "UCX")).upper()
    if backend not in ("UCX", "LIBFABRIC"):
        raise EfaPreflightError(f"unknown NIXL backend {backend!r}: use UCX or LIBFABRIC")
    return backend


def choose_transport(extra: Mapping, env: Mapping[str, str], *, sysfs: Path = SYSFS_RDMA, gpus: int = 1,
                     fabric_version: tuple[int, int] | None | str = "probe") -> TransportConfig:
    """`backend_name`; LIBFABRIC only after a clean preflight (EfaPreflightError lists every problem otherwise)."""
    backend = backend_name(extra, sysfs)
    if backend == "LIBFABRIC":
        problems = efa_preflight(env, sysfs=sysfs, gpus=gpus, fabric_version=fabric_version)
        if problems:
            raise EfaPreflightError("LIBFABRIC/EFA preflight failed:\n  - " + "\n  - ".join(problems))
    params = {k: str(v) for k, v in dict(extra.get("backend_params") or {}).items()}
    return TransportConfig(backend=backend, backend_params=params)
