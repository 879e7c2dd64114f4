"""Choosing the NIXL backend for GPUs, and checking an EFA host before LIBFABRIC is started.

LIBFABRIC over EFA is the production path on AWS (p5en); UCX serves NVLink and single hosts.  A
misconfigured EFA host does not fail loudly: NIXL falls back to slower paths or refuses memory
late.  So each rule is checked at start-up and a failure names its fix.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Callable, Mapping

from kvpush_common.transport import TransportConfig

SYSFS_RDMA = Path("/sys/class/infiniband")
NIXL_LIBFABRIC_NEEDS = (2, 7)  # NIXL 1.5.1's plugin links FABRIC_1.10 symbols: libfabric main (2.7.0a1) and later


class EfaPreflightError(RuntimeError):
    pass


def efa_devices(sysfs: Path = SYSFS_RDMA) -> list[str]:
    """RDMA devices driven by the efa driver (on p5en: rdmap*s0, two per GPU)."""
    if not sysfs.is_dir():
        return []
    out = []
    for dev in sorted(sysfs.iterdir()):
        driver = dev / "device" / "driver"
        name = os.path.basename(os.path.realpath(driver)) if driver.exists() else ""
        if name == "efa" or dev.name.startswith("efa"):
            out.append(dev.name)
    return out


def libfabric_version(load: Callable[[str], object] = ctypes.CDLL) -> tuple[int, int] | None:
    """(major, minor) of the libfabric the dynamic loader finds, or None."""
    try:
        lib = load("libfabric.so.1")
    except OSError:
        return None
    lib.fi_version.restype = ctypes.c_uint32
    v = int(lib.fi_version())
    return v >> 16, v & 0xFFFF


def efa_preflight(env: Mapping[str, str], *, sysfs: Path = SYSFS_RDMA, gpus: int = 1,
                  fabric_version: tuple[int, int] | None | str = "probe") -> list[str]:
    """Everything wrong with this host for NIXL LIBFABRIC over EFA, each with its fix (empty: ready)."""
    problems = []
    devices = efa_devices(sysfs)
    if not devices:
        problems.append(f"no EFA device under {sysfs}: LIBFABRIC/EFA needs an EFA-enabled instance launched with "
                        "its EFA interfaces (p5en, trn2), or set kv_connector_extra_config backend=UCX")
    elif len(devices) < gpus:
        problems.append(f"{len(devices)} EFA rails for {gpus} GPUs: launch the instance with all its EFA interfaces "
                        "(p5en.48xlarge has 16, two per GPU) or each GPU's KV shares a far rail")
    provider = env.get("FI_PROVIDER")
    if provider not in (None, "", "efa"):
        problems.append(f"FI_PROVIDER={provider}: set FI_PROVIDER=efa (or unset it) for EFA")
    if env.get("FI_EFA_USE_DEVICE_RDMA") != "1":
        problems.append("FI_EFA_USE_DEVICE_RDMA is not 1: set it so the NIC reads and writes GPU memory directly "
                        "(otherwise transfers bounce through host memory or fail to register)")
    version = libfabric_version() if fabric_version == "probe" else fabric_version
    if version is None:
        problems.append("libfabric.so.1 not found: install the EFA installer's libfabric (/opt/amazon/efa/lib) "
                        "and put it on LD_LIBRARY_PATH")
    elif version < NIXL_LIBFABRIC_NEEDS:
        problems.append(f"libfabric {version[0]}.{version[1]} lacks the FABRIC_1.10 symbols NIXL 1.5.1's LIBFABRIC "
                        f"plugin links against: use libfabric >= {NIXL_LIBFABRIC_NEEDS[0]}.{NIXL_LIBFABRIC_NEEDS[1]}")
    return problems


def choose_transport(extra: Mapping, env: Mapping[str, str], *, sysfs: Path = SYSFS_RDMA, gpus: int = 1,
                     fabric_version: tuple[int, int] | None | str = "probe") -> TransportConfig:
    """`backend` from kv_connector_extra_config, else LIBFABRIC when EFA devices exist, else UCX;
    LIBFABRIC only after a clean preflight (EfaPreflightError lists every problem otherwise)."""
    backend = str(extra.get("backend") or ("LIBFABRIC" if efa_devices(sysfs) else "UCX")).upper()
    if backend not in ("UCX", "LIBFABRIC"):
        raise EfaPreflightError(f"unknown NIXL backend {backend!r}: use UCX or LIBFABRIC")
    if backend == "LIBFABRIC":
        problems = efa_preflight(env, sysfs=sysfs, gpus=gpus, fabric_version=fabric_version)
        if problems:
            raise EfaPreflightError("LIBFABRIC/EFA preflight failed:\n  - " + "\n  - ".join(problems))
    params = {k: str(v) for k, v in dict(extra.get("backend_params") or {}).items()}
    return TransportConfig(backend=backend, backend_params=params)
