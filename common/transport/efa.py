"""Host checks every EFA user shares (GPU or Trainium): EFA devices, libfabric version, provider env.

Device backends add their own rules (rails per accelerator, device-specific env) on top.  No device
library is imported here.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import re
from pathlib import Path
from typing import Callable, Mapping

SYSFS_RDMA = Path("/sys/class/infiniband")
# The first libfabric release exporting each symbol version (ofiwg/libfabric `libfabric.map.in` at the tags
# v1.19.0/v1.20.0, v2.0.0, v2.5.0/v2.6.0 and main after 2.6; docs/neuron.md).  NIXL's LIBFABRIC plugin links
# the newest one its build saw: nixl 1.3.2 FABRIC_1.7, nixl 1.5.1 FABRIC_1.10 (`readelf -V` of the wheels).
FABRIC_SYMBOL_SINCE = {"FABRIC_1.7": (1, 20), "FABRIC_1.8": (2, 0), "FABRIC_1.9": (2, 6), "FABRIC_1.10": (2, 7)}
NIXL_LIBFABRIC_NEEDS = FABRIC_SYMBOL_SINCE["FABRIC_1.10"]  # what NIXL 1.5.1 (kvpush's own pin) needs
_FABRIC_SYMBOL = re.compile(rb"FABRIC_1\.(\d+)\x00")


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


def plugin_fabric_symbol(plugin: Path) -> str | None:
    """The newest FABRIC_1.x symbol version a LIBFABRIC plugin file links (its .dynstr names each), or None."""
    try:
        found = [int(m) for m in _FABRIC_SYMBOL.findall(plugin.read_bytes())]
    except OSError:
        return None
    return f"FABRIC_1.{max(found)}" if found else None


def nixl_fabric_symbol(find_spec: Callable = importlib.machinery.PathFinder.find_spec) -> str | None:
    """What the installed NIXL's LIBFABRIC plugin needs from libfabric (FABRIC_1.7 for nixl 1.3.2, FABRIC_1.10
    for 1.5.1), read from the plugin file of each installed nixl-cu* package without importing NIXL; None
    when no LIBFABRIC plugin is installed.  The NIXL a host has decides, not the one kvpush would install:
    the vLLM Neuron plugin pins its own (nixl==1.3.2), and replacing it would break the plugin's NixlConnector.
    Searched on sys.path (PathFinder), as a fresh import would find it, not through modules already imported."""
    found = []
    for package in ("nixl_cu13", "nixl_cu12"):
        try:
            spec = find_spec(package)
        except (ImportError, ValueError):
            spec = None
        for where in (spec.submodule_search_locations or []) if spec else []:
            site = Path(where).parent
            for plugin in (site / f"{package}.libs" / "nixl" / "libplugin_LIBFABRIC.so",
                           site / f".{package}.mesonpy.libs" / "plugins" / "libplugin_LIBFABRIC.so"):
                if plugin.is_file() and (symbol := plugin_fabric_symbol(plugin)):
                    found.append(symbol)
                    break
    return max(found, key=lambda s: int(s.rsplit(".", 1)[1])) if found else None


def libfabric_problem(version: tuple[int, int], symbol: str | None, fix: str = "") -> str | None:
    """The problem (with its fix) when libfabric `version` lacks `symbol`, the installed NIXL plugin's need."""
    need = FABRIC_SYMBOL_SINCE.get(symbol or "")
    if need is None or version >= need:
        return None
    return (f"libfabric {version[0]}.{version[1]} lacks the {symbol} symbols the installed NIXL's LIBFABRIC plugin "
            f"links (NIXL would refuse the backend): use libfabric >= {need[0]}.{need[1]}"
            + (f"; {fix}" if fix else " (the EFA installer's, in /opt/amazon/efa/lib, first on LD_LIBRARY_PATH)"))


def common_efa_problems(env: Mapping[str, str], *, sysfs: Path = SYSFS_RDMA, accelerators: int = 1,
                        rails_per_accelerator: int = 1, fabric_version: tuple[int, int] | None | str = "probe",
                        what: str = "accelerators", fabric_symbol: str | None = "probe") -> list[str]:
    """Rules every NIXL LIBFABRIC-over-EFA host must meet, each with its fix (empty: none broken)."""
    problems = []
    devices = efa_devices(sysfs)
    if not devices:
        problems.append(f"no EFA device under {sysfs}: LIBFABRIC/EFA needs an EFA-enabled instance launched with "
                        "its EFA interfaces (p5en, trn2), or set kv_connector_extra_config backend=UCX")
    elif len(devices) < accelerators * rails_per_accelerator:
        problems.append(f"{len(devices)} EFA rails for {accelerators} {what} (want {rails_per_accelerator} each): "
                        "launch the instance with all its EFA interfaces, or KV shares far rails")
    return problems + env_and_library_problems(env, fabric_version, fabric_symbol)


def env_and_library_problems(env: Mapping[str, str], fabric_version: tuple[int, int] | None | str = "probe",
                             fabric_symbol: str | None = "probe") -> list[str]:
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
    elif problem := libfabric_problem(version, nixl_fabric_symbol() if fabric_symbol == "probe" else fabric_symbol):
        problems.append(problem)
    return problems
