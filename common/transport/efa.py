"""Host checks every EFA user shares (GPU or Trainium): EFA devices, libfabric version, provider env.

Device backends add their own rules (rails per accelerator, device-specific env) on top.  No device
library is imported here.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Callable, Mapping

SYSFS_RDMA = Path("/sys/class/infiniband")
NIXL_LIBFABRIC_NEEDS = (2, 7)  # NIXL 1.5.1's plugin links FABRIC_1.10 symbols: libfabric main (2.7.0a1) and later


class EfaPreflightError(RuntimeError):
    pass


def efa_devices(sysfs: Path = SYSFS_RDMA) -> list[str]:
    """RDMA devices driven by the efa driver (p5en: rdmap*s0, two per GPU; trn2: one per Neuron device)."""
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


def common_efa_problems(env: Mapping[str, str], *, sysfs: Path = SYSFS_RDMA, accelerators: int = 1,
                        rails_per_accelerator: int = 1, fabric_version: tuple[int, int] | None | str = "probe",
                        what: str = "accelerators") -> list[str]:
    """Rules every NIXL LIBFABRIC-over-EFA host must meet, each with its fix (empty: none broken)."""
    problems = []
    devices = efa_devices(sysfs)
    if not devices:
        problems.append(f"no EFA device under {sysfs}: LIBFABRIC/EFA needs an EFA-enabled instance launched with "
                        "its EFA interfaces (p5en, trn2), or set kv_connector_extra_config backend=UCX")
    elif len(devices) < accelerators * rails_per_accelerator:
        problems.append(f"{len(devices)} EFA rails for {accelerators} {what} (want {rails_per_accelerator} each): "
                        "launch the instance with all its EFA interfaces, or KV shares far rails")
    return problems + env_and_library_problems(env, fabric_version)


def env_and_library_problems(env: Mapping[str, str], fabric_version: tuple[int, int] | None | str = "probe") -> list[str]:
    """The provider, device-RDMA and libfabric-version rules, each with its fix."""
    problems = []
    provider = env.get("FI_PROVIDER")
    if provider not in (None, "", "efa"):
        problems.append(f"FI_PROVIDER={provider}: set FI_PROVIDER=efa (or unset it) for EFA")
    if env.get("FI_EFA_USE_DEVICE_RDMA") != "1":
        problems.append("FI_EFA_USE_DEVICE_RDMA is not 1: set it so the NIC reads and writes device memory directly "
                        "(otherwise transfers bounce through host memory or fail to register)")
    version = libfabric_version() if fabric_version == "probe" else fabric_version
    if version is None:
        problems.append("libfabric.so.1 not found: install the EFA installer's libfabric (/opt/amazon/efa/lib) "
                        "and put it on LD_LIBRARY_PATH")
    elif version < NIXL_LIBFABRIC_NEEDS:
        problems.append(f"libfabric {version[0]}.{version[1]} lacks the FABRIC_1.10 symbols NIXL 1.5.1's LIBFABRIC "
                        f"plugin links against: use libfabric >= {NIXL_LIBFABRIC_NEEDS[0]}.{NIXL_LIBFABRIC_NEEDS[1]}")
    return problems
