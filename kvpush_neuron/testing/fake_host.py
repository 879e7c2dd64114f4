"""A faked trn host on disk, for tests and the simulated plugin: the DMI product name, /dev/neuron* and the PCI and
RDMA sysfs trees the vLLM Neuron plugin's EFA affinity and kvpush's preflight read (`efa.TrnHost`,
`efa.plugin_rails`).  `fake_trn_host` makes one under a directory; `trn_host_at` reads it back in another process
(the simulated plugin's vLLM servers: `SIM_HOST_ENV`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..efa import PLUGIN_EFA_BDF, TrnHost, plugin_instance_family

SIM_HOST_ENV = "KVPUSH_SIM_TRN_HOST"  # the faked host's directory, for the simulated plugin's preflight


def fake_trn_host(root: Path, product: str = "trn2.48xlarge", devices: int = 16, efas: tuple[str, ...] | None = None,
                  minors: dict[int, int] | None = None) -> tuple[TrnHost, Path]:
    """(host, RDMA sysfs) of a host whose /dev/neuron<i> has minor minors[i] (default i) and whose EFAs sit at the
    given PCI addresses (default: every address of the product's family in the plugin's table, in table order, so
    the i-th EFA in sysfs order is not device i's).  The RDMA sysfs lists the same EFAs under
    /sys/class/infiniband with the efa driver."""
    (root / "dmi").mkdir(parents=True)
    (root / "dmi" / "product_name").write_text(product + "\n")
    dev = root / "dev"
    dev.mkdir()
    for i in range(devices):
        (dev / f"neuron{i}").touch()
    drivers = root / "drivers" / "efa"
    drivers.mkdir(parents=True)
    rdma = root / "infiniband"
    rdma.mkdir()
    family = plugin_instance_family({}, product)
    bdfs = efas if efas is not None else PLUGIN_EFA_BDF.get(family, ())
    for n, bdf in enumerate(bdfs):
        name = f"rdmap{int(bdf.split(':')[1], 16):03d}s0"  # interface names follow the bus, as on EC2
        (root / "pci" / bdf / "infiniband" / name).mkdir(parents=True)
        (rdma / name / "device").mkdir(parents=True)
        os.symlink(drivers, rdma / name / "device" / "driver")
    (root / "minors.json").write_text(json.dumps({str(k): v for k, v in (minors or {}).items()}))
    return trn_host_at(root)


def trn_host_at(root: Path) -> tuple[TrnHost, Path]:
    """(host, RDMA sysfs) of the faked host `fake_trn_host` made under root (a file node has no device number:
    /dev/neuron<i>'s minor is kept in minors.json)."""
    if not (root / "dmi" / "product_name").is_file():
        raise FileNotFoundError(f"{root} holds no faked trn host: make one with kvpush_neuron.testing.fake_host.fake_trn_host")
    minors = {int(k): int(v) for k, v in json.loads((root / "minors.json").read_text()).items()}
    host = TrnHost(product=root / "dmi" / "product_name", dev=root / "dev", pci=root / "pci",
                   minor=lambda p: minors.get(int(Path(p).name[6:]), int(Path(p).name[6:])))
    return host, root / "infiniband"
