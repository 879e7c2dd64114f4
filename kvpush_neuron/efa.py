"""EFA preflight for Neuron HBM over NIXL LIBFABRIC (trn2, trn3), and the NIXL backend choice.

NIXL moves Neuron HBM only through its LIBFABRIC plugin (FI_HMEM_NEURON, NIXL >= 0.10) and registers a
core's HBM on the EFA attached to that core's chip (libnrt's nrt_get_attached_efa_bdf); the plugin's worker
pins each rank to that chip's EFA through a fixed PCI-address table, which `plugin_rails` reads the same way
for the connector's preflight and for `kvpush doctor`.  Trainium2 and Trainium3 chips both hold 8 physical
NeuronCores (NEURON_LOGICAL_NC_CONFIG=2, the default, makes 4 logical ones), and every trn host has one
200 Gb/s EFA per chip: trn2.48xlarge 16 chips and 16 EFAs (3.2 Tb/s), a Trn3 Gen1 UltraServer server 16
chips (12.8 Tb/s per 64 chips), a Trn3 Gen2 server 4 chips (28.8 Tb/s per 144 chips); trn2.3xlarge has no
EFA.  So a rank's rail is its chip's, and a host launched with fewer EFA interfaces than chips leaves some
ranks without one.

The environment rules are the vLLM Neuron plugin's own (its DI tutorial exports only
FI_EFA_ENABLE_SHM_TRANSFER=0 for P and D on one host; FI_PROVIDER and FI_EFA_USE_DEVICE_RDMA may stay
unset: libfabric then picks efa and uses the device's RDMA where it has it).  A misconfigured host fails
late or gives wrong output (shm transport on one host), so each rule is checked at start-up and names
its fix.  Sources: docs/neuron.md.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from kvpush_common.transport.efa import (SYSFS_RDMA, EfaPreflightError, efa_devices, libfabric_problem,
                                         libfabric_version, nixl_fabric_symbol, plugin_fabric_symbol)
from kvpush_common.transport.nixl import TransportConfig

from .runtime import parse_core_list

log = logging.getLogger(__name__)

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


# The vLLM Neuron plugin's EFA PCI address (BDF) of each host Neuron device, per instance family: its worker sets each
# rank's FI_EFA_IFACE from it, raising at start-up when the rank's EFA is absent (unless NEURON_SKIP_EFA_AFFINITY skips it, `plugin_pins_efa`):
# jinhuang12/vllm-neuron vllm_neuron/utils/hardware_config.py @ 0bae3e9c (docs/neuron.md, fact 30).  EFA interface
# names vary between boots and drivers, and sysfs order is not the chips' order, so a rank's rail is read only here.
PLUGIN_EFA_BDF = {
    "trn2": ("0000:c9:00.0", "0000:b4:00.0", "0000:b3:00.0", "0000:ca:00.0", "0000:6c:00.0", "0000:57:00.0",
             "0000:56:00.0", "0000:6d:00.0", "0000:98:00.0", "0000:83:00.0", "0000:82:00.0", "0000:99:00.0",
             "0000:f5:00.0", "0000:e0:00.0", "0000:df:00.0", "0000:f6:00.0"),
    "trn3pd": ("0000:be:00.0", "0000:a9:00.0", "0000:a8:00.0", "0000:bf:00.0", "0000:61:00.0", "0000:4c:00.0",
               "0000:4b:00.0", "0000:62:00.0", "0000:8d:00.0", "0000:78:00.0", "0000:77:00.0", "0000:8e:00.0",
               "0000:ea:00.0", "0000:d5:00.0", "0000:d4:00.0", "0000:eb:00.0"),
    "trn3pds": ("0000:a9:00.0", "0000:a8:00.0", "0000:bf:00.0", "0000:be:00.0", "0000:d5:00.0", "0000:d4:00.0",
                "0000:eb:00.0", "0000:ea:00.0", "0000:4c:00.0", "0000:4b:00.0", "0000:62:00.0", "0000:61:00.0",
                "0000:78:00.0", "0000:77:00.0", "0000:8e:00.0", "0000:8d:00.0"),
}
SKIP_AFFINITY_FIX = "or set NEURON_SKIP_EFA_AFFINITY=1 (the plugin's worker then pins no EFA)"
SKIP_AFFINITY = "NEURON_SKIP_EFA_AFFINITY"


def plugin_pins_efa(env: Mapping[str, str]) -> bool:
    """Whether the plugin's worker pins each rank to its chip's EFA (and raises where that EFA is absent): only
    where NEURON_SKIP_EFA_AFFINITY is unset or exactly "0" (`os.environ.get("NEURON_SKIP_EFA_AFFINITY", "0") ==
    "0"` in NeuronWorker._init_neuron_distributed_environment_and_runtime, jinhuang12/vllm-neuron
    vllm_neuron/vllm/worker/neuron_worker.py @ 03bd80a2), so "1", "true" or an empty value all skip it."""
    return env.get(SKIP_AFFINITY, "0") == "0"


def _device_minor(path: Path) -> int:
    return os.minor(os.stat(path).st_rdev)


@dataclass(frozen=True)
class TrnHost:
    """Where the plugin's EFA affinity reads the host (the real paths; tests give a faked host)."""

    product: Path = Path("/sys/devices/virtual/dmi/id/product_name")
    dev: Path = Path("/dev")
    pci: Path = Path("/sys/bus/pci/devices")
    minor: Callable[[Path], int] = _device_minor

    def product_name(self) -> str | None:
        return self.product.read_text().strip() if self.product.is_file() else None


def plugin_instance_family(env: Mapping[str, str], product_name: str | None) -> str | None:
    """The plugin's `get_instance_family`: VLLM_NEURON_EFA_INSTANCE_FAMILY, else the DMI product name's prefix
    (any trn3* is trn3pds, any trn2* trn2)."""
    if env.get("VLLM_NEURON_EFA_INSTANCE_FAMILY"):
        return env["VLLM_NEURON_EFA_INSTANCE_FAMILY"]
    if not product_name:
        return None
    family = product_name.split(".")[0]
    return "trn3pds" if family.startswith("trn3") else "trn2" if family.startswith("trn2") else family


@dataclass
class PluginRails:
    """Each visible core's EFA as the plugin's worker resolves it.  `checked` is False where the plugin pins no EFA
    (`plugin_pins_efa`) or the host is no trn host (`note` says which); `problems` are the start-up errors the
    plugin's worker would raise instead, each with its fix."""

    family: str | None
    rails: list[tuple[int, str]] = field(default_factory=list)  # (core, EFA interface)
    problems: list[str] = field(default_factory=list)
    checked: bool = True
    note: str = ""

    def summary(self) -> str:
        """`family: cores:EFA 0-3:rdmap0 4:rdmap1`, runs of cores on one EFA joined."""
        if not self.checked:
            return self.note
        runs: list[list] = []
        for core, iface in self.rails:
            if runs and runs[-1][2] == iface and runs[-1][1] == core - 1:
                runs[-1][1] = core
            else:
                runs.append([core, core, iface])
        if not runs:
            return f"{self.family}: NEURON_VISIBLE_DEVICES unset (the plugin takes cores 0..TP-1)"
        return f"{self.family}: cores:EFA " + " ".join(f"{a}{'-' + str(b) if b != a else ''}:{e}" for a, b, e in runs)


def plugin_rails(env: Mapping[str, str], host: TrnHost = TrnHost()) -> PluginRails:
    """The plugin's `get_efa_interface` for every core of NEURON_VISIBLE_DEVICES: logical core -> Neuron device
    `core * NEURON_LOGICAL_NC_CONFIG // 8` -> the host device (/dev/neuron<n>'s minor) -> its BDF in the plugin's
    table -> the first interface under /sys/bus/pci/devices/<bdf>/infiniband.  The one source of a rank's rail for
    both the connector's preflight and `kvpush doctor`."""
    if not plugin_pins_efa(env):
        return PluginRails(None, checked=False, note=(
            f"{SKIP_AFFINITY}={env[SKIP_AFFINITY]!r}: the plugin's worker pins no EFA and checks none (it does "
            "where the variable is unset or 0), nor does kvpush: NIXL registers each chip's HBM on the EFA libnrt "
            "attaches to it"))
    product_name = host.product_name()
    family = plugin_instance_family(env, product_name)
    if family not in PLUGIN_EFA_BDF:
        if not (product_name or "").startswith("trn") and not env.get("VLLM_NEURON_EFA_INSTANCE_FAMILY"):
            return PluginRails(family, checked=False, note=(
                f"not a trn host (DMI product name {product_name!r}): the plugin's worker maps ranks to EFAs on "
                f"{', '.join(PLUGIN_EFA_BDF)} only; not checked"))
        return PluginRails(family, problems=[
            f"instance family {family!r}: the plugin's worker supports {', '.join(PLUGIN_EFA_BDF)} and raises "
            f"otherwise; set VLLM_NEURON_EFA_INSTANCE_FAMILY to the host's family {SKIP_AFFINITY_FIX}"])
    table = PLUGIN_EFA_BDF[family]
    lnc = int(env.get("NEURON_LOGICAL_NC_CONFIG") or 2)
    out = PluginRails(family)
    for core in parse_core_list(env.get("NEURON_VISIBLE_DEVICES", "")):
        node = host.dev / f"neuron{core * lnc // PHYSICAL_CORES_PER_CHIP}"
        if not node.exists():
            out.problems.append(f"core {core}: {node} is missing (the plugin's worker raises): run on the host's "
                                "Neuron devices with the Neuron driver loaded")
            continue
        host_nd = host.minor(node)
        if host_nd >= len(table):
            out.problems.append(f"core {core}: Neuron device {host_nd} is beyond the plugin's {family} table "
                                f"({len(table)} devices) {SKIP_AFFINITY_FIX}")
            continue
        ib = host.pci / table[host_nd] / "infiniband"
        ifaces = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
        if not ifaces:
            out.problems.append(f"core {core}: no EFA at {table[host_nd]} (Neuron device {host_nd}), where the "
                                f"plugin looks for it: launch the instance with all its EFA interfaces "
                                f"{SKIP_AFFINITY_FIX}")
            continue
        out.rails.append((core, ifaces[0]))
    return out


def loaded_fabric_symbol(load: Callable[[str], object] | None = None, maps: Path = Path("/proc/self/maps")) -> str | None:
    """The newest FABRIC_1.x version node the libfabric the dynamic loader finds defines (read from the loaded
    file's own version names), or None.  What NIXL's LIBFABRIC plugin needs is that node, and a build between
    releases defines it under the older version number (libfabric main after 2.6, "2.7.0a1", reports 2.6 and
    defines FABRIC_1.10), so the number alone would refuse a library NIXL loads."""
    import ctypes

    try:
        (load or ctypes.CDLL)("libfabric.so.1")
    except OSError:
        return None
    for line in maps.read_text().splitlines():
        path = line.split()[-1] if line.split() else ""
        if "/libfabric.so" in path:
            return plugin_fabric_symbol(Path(path))
    return None


def _defines(defined: str | None, symbol: str | None) -> bool:
    number = lambda s: int(s.rsplit(".", 1)[1])  # noqa: E731
    return bool(defined and symbol) and number(defined) >= number(symbol)


def fabric_env_problems(env: Mapping[str, str], fabric_version: tuple[int, int] | None | str = "probe",
                        fabric_symbol: str | None = "probe") -> list[str]:
    """The provider, device-RDMA and libfabric rules as the plugin states them: unset is fine, a value
    that turns EFA or its RDMA off is not.  A probed libfabric too old by its number passes where the loaded
    file defines the version node NIXL needs (`loaded_fabric_symbol`)."""
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
    symbol = nixl_fabric_symbol() if fabric_symbol == "probe" else fabric_symbol
    if version is None:
        problems.append("libfabric.so.1 not found: install the EFA installer's libfabric (/opt/amazon/efa/lib) "
                        "and put it on LD_LIBRARY_PATH")
    elif (problem := libfabric_problem(version, symbol, NEURON_NIXL_FIX)) and not (
            fabric_version == "probe" and _defines(loaded_fabric_symbol(), symbol)):
        problems.append(problem)
    return problems


def neuron_efa_preflight(env: Mapping[str, str], *, sysfs: Path = SYSFS_RDMA, same_host: bool = True,
                         fabric_version: tuple[int, int] | None | str = "probe", fabric_symbol: str | None = "probe",
                         host: TrnHost = TrnHost(), rails: bool = True) -> list[str]:
    """Everything wrong with this host for Neuron HBM over LIBFABRIC/EFA, each with its fix (empty: ready).
    `same_host`: a peer (P or D) may run on this host, which needs the shm transport off.  Cores are the server's
    NEURON_VISIBLE_DEVICES (the plugin's worker sets it to 0..TP-1 when the user did not); each one's rail is the
    plugin's (`plugin_rails`; `rails=False` leaves that to a caller that reports it on its own, as the doctor does)."""
    problems = []
    if not efa_devices(sysfs):
        problems.append(f"no EFA device under {sysfs}: Neuron HBM moves only over EFA (trn2.3xlarge has none and "
                        "cannot register FI_HMEM_NEURON); use trn2.48xlarge or a Trn3 server launched with all its "
                        "EFA interfaces (one per Trainium chip)")
    elif rails:
        problems += plugin_rails(env, host).problems
    if same_host and env.get("FI_EFA_ENABLE_SHM_TRANSFER") != "0":
        problems.append("FI_EFA_ENABLE_SHM_TRANSFER is not 0: set it to 0 when prefill and decode share a host "
                        "(the shm transport is taken otherwise and gives wrong output)")
    problems += fabric_env_problems(env, fabric_version, fabric_symbol)
    return problems


def neuron_transport(extra: Mapping, env: Mapping[str, str], *, sysfs: Path = SYSFS_RDMA, same_host: bool = True,
                     fabric_version: tuple[int, int] | None | str = "probe", fabric_symbol: str | None = "probe",
                     host: TrnHost = TrnHost()) -> TransportConfig:
    """LIBFABRIC after a clean preflight (EfaPreflightError lists every problem otherwise); any other
    backend is refused, since NIXL's Neuron HBM support lives in its LIBFABRIC plugin."""
    backend = str(extra.get("backend") or "LIBFABRIC").upper()
    if backend != "LIBFABRIC":
        raise EfaPreflightError(f"NIXL backend {backend!r} cannot register Neuron HBM: use LIBFABRIC (EFA)")
    problems = neuron_efa_preflight(env, sysfs=sysfs, same_host=same_host, fabric_version=fabric_version,
                                    fabric_symbol=fabric_symbol, host=host)
    if problems:
        raise EfaPreflightError("Neuron LIBFABRIC/EFA preflight failed:\n  - " + "\n  - ".join(problems))
    rails = plugin_rails(env, host)
    (log.info if rails.checked else log.warning)("kvpush: Neuron EFA rails: %s", rails.summary())
    params = {k: str(v) for k, v in dict(extra.get("backend_params") or {}).items()}
    return TransportConfig(backend="LIBFABRIC", backend_params=params)
