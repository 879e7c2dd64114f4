"""NIXL's LIBFABRIC backend on a host without EFA: what it needs, and a private network namespace to run in.

NIXL 1.5.1's LIBFABRIC plugin links a libfabric exporting FABRIC_1.10 (no registry ships one: the vendored
build in ../shared/vendor/libfabric, or KVPUSH_LIBFABRIC_DIR), libcuda.so.1 (on hosts without an NVIDIA
driver: a stand-in built here from native/libcuda_standin.c), libcudart.so.13 and libhwloc.so.15 (Debian
libhwloc15).  libfabric's tcp provider skips loopback interfaces, so the endpoints run inside a private
network namespace with a veth pair: nothing outside it is reachable from it.

A stock Neuron SDK host has the vLLM Neuron plugin's own NIXL (nixl==1.3.2, FABRIC_1.7) and the EFA installer's
libfabric (1.47: the 2.4 line, FABRIC_1.8).  scripts/setup-venv.sh installs that NIXL into SDK_NIXL_DIR (a
--target folder put first on PYTHONPATH); its libfabric is the first of KVPUSH_LIBFABRIC_DIR, the vendored build
and the system's that exports FABRIC_1.7 (Debian bookworm's 1.17 stops at FABRIC_1.6).
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENDORED = ROOT.parent / "shared" / "vendor" / "libfabric" / "lib"
CUDART_DIRS = ("/usr/local/cuda-13.0/lib", "/usr/local/cuda/lib64", "/usr/local/cuda-13.0/lib64")
SYMBOL_VERSION = "FABRIC_1.10"  # what kvpush's own NIXL (1.5.1) links
IFACE = "vA"
SDK_NIXL = "1.3.2"  # the vLLM Neuron plugin's pin (requirements/core.txt), on every SDK release it is known for
SDK_NIXL_DIR = ROOT / f".venv-nixl-{SDK_NIXL}"
SDK_NIXL_INSTALL = (f"pip install --no-deps --target {SDK_NIXL_DIR.name} nixl=={SDK_NIXL} nixl-cu13=={SDK_NIXL} "
                    "(scripts/setup-venv.sh does)")

# lo up, a veth pair (the tcp provider needs a non-loopback interface), IPv6 off; then the command.
NETNS_SETUP = ("ip link set lo up && ip link add vA type veth peer name vB && ip addr add 127.0.0.2/32 dev vA "
               "&& ip link set vA up && ip link set vB up && sysctl -qw net.ipv6.conf.all.disable_ipv6=1 "
               '&& exec "$@"')


def _exports(path: Path, symbol: str) -> bool:
    try:
        return symbol.encode() + b"\x00" in path.read_bytes()
    except OSError:
        return False


def find_libfabric(symbol: str = SYMBOL_VERSION) -> Path | None:
    """The libfabric shared object to use: KVPUSH_LIBFABRIC_DIR, else the vendored build beside the
    checkout, else the system's, the first that exports `symbol`.  The vendored copy stores its symlinks
    as small text files, so the real file is found by name."""
    dirs = [Path(os.environ["KVPUSH_LIBFABRIC_DIR"])] if os.environ.get("KVPUSH_LIBFABRIC_DIR") else []
    dirs.append(VENDORED)
    for d in dirs:
        for p in sorted(d.glob("libfabric.so.1*"), key=lambda p: -p.stat().st_size) if d.is_dir() else ():
            if _exports(p, symbol):
                return p
    system = ctypes.util.find_library("fabric")
    if system:
        for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/opt/amazon/efa/lib"):
            p = Path(d) / system
            if p.exists() and _exports(p.resolve(), symbol):
                return p.resolve()
    return None


def sdk_nixl_problem() -> str | None:
    """What is missing of the Neuron SDK's NIXL (installed by this project's setup), or None."""
    if not (SDK_NIXL_DIR / "nixl_cu13.libs" / "nixl" / "libplugin_LIBFABRIC.so").is_file():
        return f"NIXL {SDK_NIXL} (the vLLM Neuron plugin's pin) at {SDK_NIXL_DIR}: {SDK_NIXL_INSTALL}"
    return None


def find_cudart() -> Path | None:
    for d in CUDART_DIRS:
        if (Path(d) / "libcudart.so.13").exists():
            return Path(d)
    try:  # the nvidia-cuda-runtime wheel
        import nvidia.cu13  # type: ignore # noqa: F401

        lib = Path(list(nvidia.cu13.__path__)[0]) / "lib"
        return lib if (lib / "libcudart.so.13").exists() else None
    except ImportError:
        return None


def absent_library() -> str | None:
    """Why this host cannot run the tier for a reason no registry fixes (libfabric with FABRIC_1.10), or None."""
    if find_libfabric() is None:
        return ("no libfabric exporting FABRIC_1.10 (NIXL 1.5.1's LIBFABRIC plugin needs it and no registry "
                f"ships one): not at KVPUSH_LIBFABRIC_DIR, not vendored at {VENDORED}, not the system's")
    return None


def setup_problems() -> list[str]:
    """What is missing that this project's setup installs (so a run must fail, naming it, not skip)."""
    out = []
    if ctypes.util.find_library("hwloc") is None:
        out.append("libhwloc.so.15: apt-get install libhwloc15")
    if find_cudart() is None:
        out.append("libcudart.so.13: pip install nvidia-cuda-runtime==13.*")
    if not Path("/usr/lib/x86_64-linux-gnu/libcuda.so.1").exists() and shutil.which("cc") is None:
        out.append("a C compiler for the stand-in libcuda.so.1: apt-get install gcc")
    for tool in ("unshare", "ip", "sysctl"):
        if shutil.which(tool) is None:
            out.append(f"{tool}: apt-get install util-linux iproute2 procps")
    if os.geteuid() != 0:
        out.append("root, for `unshare -n` (a private network namespace)")
    return out


def library_dir(work: Path, libfabric: Path | None = None) -> Path:
    """A directory for LD_LIBRARY_PATH: libfabric.so.1 (a real link to `libfabric`, default the found
    FABRIC_1.10 build) and, without an NVIDIA driver, the stand-in libcuda.so.1."""
    work.mkdir(parents=True, exist_ok=True)
    link = work / "libfabric.so.1"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(libfabric or find_libfabric())
    if not Path("/usr/lib/x86_64-linux-gnu/libcuda.so.1").exists():
        src = Path(__file__).parent / "native" / "libcuda_standin.c"
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(work / "libcuda.so.1"), str(src)], check=True)
    return work


def environment(work: Path, base: dict | None = None, *, libfabric: Path | None = None,
                nixl_dir: Path | None = None) -> dict:
    """Environment of a process that uses NIXL LIBFABRIC over the namespace's veth (with `nixl_dir`: the NIXL
    installed there, first on PYTHONPATH, instead of the venv's)."""
    env = dict(os.environ if base is None else base)
    libs = [str(library_dir(work, libfabric)), str(find_cudart())]
    env["LD_LIBRARY_PATH"] = ":".join(libs + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p])
    if nixl_dir is not None:
        env["PYTHONPATH"] = ":".join([str(nixl_dir)] + [p for p in env.get("PYTHONPATH", "").split(":") if p])
    env.update(FI_PROVIDER="tcp", FI_TCP_IFACE=IFACE)
    return env


def in_private_netns(argv: list[str]) -> list[str]:
    """`argv` run inside a new network namespace with lo and a veth pair (root)."""
    return ["unshare", "-n", "sh", "-c", NETNS_SETUP, "sh", *argv]
