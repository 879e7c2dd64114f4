"""What the libfabric the loader finds offers: its version, its providers, and whether each offers FI_HMEM
(device memory) -- what `fi_info -l` / `fi_info -c FI_HMEM` print, read through libfabric's own fi_getinfo
so that no EFA installer tool is needed.

NIXL's LIBFABRIC plugin takes the `efa` provider on p5en and trn2, and device memory needs FI_HMEM there:
efa offers it only when an HMEM interface initialised (CUDA: the driver; Neuron: libnrt).  Probed in a
subprocess by the doctor, since a broken provider can take its host process down.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from dataclasses import dataclass, field

FI_HMEM = 1 << 47
FI_VERSION_1_10 = (1 << 16) | 10
FI_ENODATA = 61  # fi_getinfo: no provider matches


class _FabricAttr(ctypes.Structure):
    _fields_ = [("fabric", ctypes.c_void_p), ("name", ctypes.c_char_p), ("prov_name", ctypes.c_char_p),
                ("prov_version", ctypes.c_uint32), ("api_version", ctypes.c_uint32)]


class _Info(ctypes.Structure):
    pass


_Info._fields_ = [("next", ctypes.POINTER(_Info)), ("caps", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                  ("addr_format", ctypes.c_uint32), ("src_addrlen", ctypes.c_size_t),
                  ("dest_addrlen", ctypes.c_size_t), ("src_addr", ctypes.c_void_p), ("dest_addr", ctypes.c_void_p),
                  ("handle", ctypes.c_void_p), ("tx_attr", ctypes.c_void_p), ("rx_attr", ctypes.c_void_p),
                  ("ep_attr", ctypes.c_void_p), ("domain_attr", ctypes.c_void_p),
                  ("fabric_attr", ctypes.POINTER(_FabricAttr)), ("nic", ctypes.c_void_p)]


@dataclass
class FabricInfo:
    version: tuple[int, int]
    providers: dict[str, bool] = field(default_factory=dict)  # provider -> some endpoint offers FI_HMEM
    error: str = ""


def probe(library: str = "libfabric.so.1") -> FabricInfo | None:
    """This process's view (loads libfabric here); None when the loader finds none."""
    try:
        lib = ctypes.CDLL(library)
    except OSError:
        return None
    lib.fi_version.restype = ctypes.c_uint32
    v = int(lib.fi_version())
    info = FabricInfo((v >> 16, v & 0xFFFF))
    lib.fi_getinfo.argtypes = [ctypes.c_uint32, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint64, ctypes.c_void_p,
                               ctypes.POINTER(ctypes.POINTER(_Info))]
    lib.fi_freeinfo.argtypes = [ctypes.POINTER(_Info)]
    head = ctypes.POINTER(_Info)()
    rc = lib.fi_getinfo(FI_VERSION_1_10, None, None, 0, None, ctypes.byref(head))
    if rc == 0:
        node = head
        while node:
            attr = node.contents.fabric_attr
            name = attr.contents.prov_name.decode() if attr and attr.contents.prov_name else "?"
            info.providers[name] = info.providers.get(name, False) or bool(node.contents.caps & FI_HMEM)
            node = node.contents.next
        lib.fi_freeinfo(head)
    elif -rc != FI_ENODATA:
        info.error = f"fi_getinfo returned {rc}"
    return info


def probe_subprocess(env: dict | None = None, timeout: float = 60.0) -> FabricInfo | str | None:
    """probe() in a child process with `env` (a plan's LD_LIBRARY_PATH and FI_* settings): the FabricInfo,
    None when no libfabric is found, or the child's failure as text."""
    code = ("import dataclasses, json; from kvpush_common.transport.fabric_info import probe; i = probe(); "
            "print(json.dumps(dataclasses.asdict(i) if i else None))")
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"probing libfabric's providers took over {timeout:.0f} s"
    if out.returncode != 0:
        return f"probing libfabric's providers failed (rc={out.returncode}): {out.stderr.strip()[-400:]}"
    data = json.loads(out.stdout.strip().splitlines()[-1])
    if data is None:
        return None
    return FabricInfo(tuple(data["version"]), data["providers"], data["error"])
