"""Host checks (`kvpush doctor`) every target shares: Python, modules and their versions, NIXL and its plugins,
libfabric, shared libraries.  A target's `doctor(env, plan)` returns a list of these `Check`s; the CLI renders them
(text or JSON) and exits non-zero when one that is not a warning fails.  Each problem names what is wrong and the fix,
so that a failed check is the whole instruction."""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from kvpush_common.transport.nixl import NIXL_INSTALL


@dataclass(frozen=True)
class Check:
    """One doctor check.  `problems` each name what is wrong and the fix; `warn` checks never fail."""

    name: str
    ok: bool
    detail: str = ""
    problems: tuple[str, ...] = ()
    warn: bool = False

    @property
    def status(self) -> str:
        return "ok" if self.ok else ("warn" if self.warn else "FAIL")


def from_problems(name: str, problems: Iterable[str], ok_detail: str, *, warn: bool = False) -> Check:
    problems = tuple(problems)
    if not problems:
        return Check(name, True, ok_detail)
    return Check(name, False, f"{len(problems)} problem{'s' * (len(problems) > 1)}", problems, warn)


def failed(checks: Iterable[Check]) -> list[Check]:
    return [c for c in checks if not c.ok and not c.warn]


def render_checks(target: str, checks: Sequence[Check]) -> str:
    bad = failed(checks)
    lines = [f"kvpush doctor --target {target}: {len(checks)} checks, {len(bad)} failed"]
    for c in checks:
        lines.append(f"[{c.status:>4}] {c.name}: {c.detail}")
        lines += [f"         - {p}" for p in c.problems]
    lines.append("READY" if not bad else f"NOT READY: fix the {len(bad)} failed check(s) above")
    return "\n".join(lines) + "\n"


def checks_json(target: str, checks: Sequence[Check]) -> str:
    return json.dumps({"target": target, "ok": not failed(checks),
                       "checks": [{**asdict(c), "problems": list(c.problems), "status": c.status} for c in checks]},
                      indent=2) + "\n"


def check_python(minimum: tuple[int, int], why: str) -> Check:
    v = sys.version_info[:2]
    if v >= minimum:
        return Check("python", True, f"{sys.version.split()[0]} ({sys.executable})")
    return Check("python", False, f"{v[0]}.{v[1]}", (f"Python {v[0]}.{v[1]} is too old: {why} needs "
                                                     f"Python >= {minimum[0]}.{minimum[1]}",))


def dist_version(*names: str) -> tuple[str, str] | None:
    """(distribution, version) of the first installed distribution among `names`."""
    for n in names:
        try:
            return n, importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_module(name: str, module: str, dists: Sequence[str], fix: str, *, warn: bool = False) -> Check:
    """`module` importable (found without importing it) and the distribution that provides it."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return Check(name, False, "not installed", (f"Python module {module!r} not found: {fix}",), warn)
    dv = dist_version(*dists)
    return Check(name, True, f"{dv[0]} {dv[1]}" if dv else f"{module} (version unknown)")


# Run with the server's environment: imports NIXL as the server would (the `nixl` meta package picks nixl_cu13 or
# nixl_cu12 by torch's CUDA build), then test-loads each backend's plugin of THAT package (NIXL_PLUGIN_DIR first),
# after NIXL's own libraries, as the agent loads its plugins.  Prints one JSON line.
_PLUGIN_PROBE = r"""
import ctypes, importlib.metadata, json, os, sys
from pathlib import Path
out = {"package": "", "version": "", "error": "", "plugins": {}}
dirs = [Path(os.environ["NIXL_PLUGIN_DIR"])] if os.environ.get("NIXL_PLUGIN_DIR") else []
try:
    import nixl._api as api
    pkg = api.__name__.split(".")[0]
    site = Path(api.__file__).resolve().parent.parent
    out["package"], out["version"] = pkg, importlib.metadata.version(pkg.replace("_", "-"))
    dirs += [site / f"{pkg}.libs" / "nixl", site / f".{pkg}.mesonpy.libs" / "plugins"]
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
for backend in sys.argv[1:]:
    path = next((d / f"libplugin_{backend}.so" for d in dirs if (d / f"libplugin_{backend}.so").is_file()), None)
    err = ""
    if path is not None:
        try:
            ctypes.CDLL(str(path))
        except OSError as e:
            err = str(e)
    out["plugins"][backend] = {"path": str(path) if path else "", "error": err,
                               "searched": ", ".join(map(str, dirs))}
print(json.dumps(out))
"""


def probe_nixl(env: Mapping[str, str], backends: Sequence[str]) -> dict:
    """Which NIXL the server's environment imports, and each backend's plugin of it test-loaded (a subprocess:
    NIXL dlopens a plugin the same way and reports only "unsupported backend" when that fails)."""
    try:
        out = subprocess.run([sys.executable, "-c", _PLUGIN_PROBE, *backends], capture_output=True, text=True,
                             timeout=120, env=dict(env))
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"could not run the NIXL probe: {e}", "plugins": {}}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": f"the NIXL probe failed (rc={out.returncode}): {out.stderr.strip()[-300:]}", "plugins": {}}
    return json.loads(lines[-1])


def check_nixl(env: Mapping[str, str], backends: Sequence[str], *, install_fix: str = "") -> list[Check]:
    """The NIXL this environment imports (whichever release: kvpush calls the same API in every release it
    tests), and each backend's plugin of that NIXL present and loadable.  `install_fix`: how this target gets
    NIXL (default: kvpush's own pin)."""
    from kvpush_common.transport.nixl import NIXL_TESTED

    install_fix = install_fix or f"{NIXL_INSTALL} (scripts/setup-venv.sh does)"
    mod = check_module("nixl", "nixl", ("nixl", "nixl-cu13", "nixl-cu12"), install_fix)
    if not mod.ok:
        return [mod]
    found = probe_nixl(env, backends)
    if not found.get("package"):
        return [Check("nixl", False, "does not import", (f"import nixl failed: {found.get('error')}: {install_fix}",))]
    version = found["version"]
    checks = [Check("nixl", True, f"{found['package']} {version}")]
    if version not in NIXL_TESTED:
        checks.append(Check("nixl-version", False, version, (
            f"NIXL {version} is not a release kvpush tests ({', '.join(NIXL_TESTED)}): kvpush calls the same Python "
            "API in each, so it likely works, but it is unverified",), warn=True))
    for backend in backends:
        name = f"nixl-plugin-{backend}"
        plugin = found["plugins"].get(backend) or {}
        if not plugin.get("path"):
            where = plugin.get("searched") or "no NIXL plugin directory found"
            checks.append(Check(name, False, "missing", (
                f"libplugin_{backend}.so not found ({where}): install the nixl-cu13 wheel or set NIXL_PLUGIN_DIR to "
                "the folder holding the NIXL plugins",)))
            continue
        err = plugin["error"]
        if not err:
            checks.append(Check(name, True, plugin["path"]))
            continue
        fix = plugin_load_fix(err) if backend == "LIBFABRIC" else "install the libraries it names"
        checks.append(Check(name, False, f"{plugin['path']} does not load",
                            (f"NIXL {version} would refuse backend {backend!r} (\"unsupported backend\"): {err}; "
                             f"fix: {fix}",)))
    return checks


def check_fabric(env: Mapping[str, str], hmem_for: str, probe=None) -> Check:
    """The libfabric NIXL's LIBFABRIC plugin will load (with `env`): its providers, and `efa` with FI_HMEM so
    that `hmem_for` memory ("Neuron HBM", "GPU memory") registers.  `probe`: fabric_info.probe_subprocess."""
    from kvpush_common.transport import fabric_info

    info = (probe or fabric_info.probe_subprocess)(dict(env))
    if info is None:
        return Check("libfabric", False, "not found", (f"libfabric.so.1 not found: {_ANY_FABRIC}",))
    if isinstance(info, str):
        return Check("libfabric", False, "probe failed", (info,))
    listed = ", ".join(f"{p}{' (FI_HMEM)' if h else ''}" for p, h in sorted(info.providers.items())) or "none"
    detail = f"libfabric {info.version[0]}.{info.version[1]}; providers: {listed}"
    problems = []
    if "efa" not in info.providers:
        chosen = env.get("FI_PROVIDER")
        problems.append(("no efa provider" + (f" (FI_PROVIDER={chosen} limits the list)" if chosen not in (None, "", "efa")
                                              else "") +
                         ": NIXL LIBFABRIC needs EFA (an EFA instance type, its interfaces attached, the EFA installer's "
                         "libfabric in /opt/amazon/efa/lib first on LD_LIBRARY_PATH; check with fi_info -p efa)"))
    elif not info.providers["efa"]:
        problems.append(f"the efa provider offers no FI_HMEM: {hmem_for} cannot register (Neuron: libnrt.so.1 from "
                        "aws-neuronx-runtime-lib on LD_LIBRARY_PATH; GPU: the NVIDIA driver with dma-buf or "
                        "nvidia-peermem; and FI_HMEM, if set, must name that interface)")
    if info.error:
        problems.append(info.error)
    return Check("libfabric", not problems, detail, tuple(problems))


# What NIXL's LIBFABRIC plugin links, and how each is provided (measured: docs/design.md section 10; the FABRIC_1.x
# symbol version is per NIXL release: 1.3.2 FABRIC_1.7, 1.5.1 FABRIC_1.10, see transport/efa.py).
_ANY_FABRIC = ("a libfabric exporting the FABRIC_1.x symbols the installed NIXL's plugin links (nixl 1.3.2: FABRIC_1.7, "
               "libfabric >= 1.20; nixl 1.5.1: FABRIC_1.10, libfabric >= 2.7) must come first on LD_LIBRARY_PATH (the "
               "EFA installer's, in /opt/amazon/efa/lib)")
LIBFABRIC_PLUGIN_NEEDS = (
    ("libfabric.so.1: cannot open", _ANY_FABRIC),
    ("libcuda.so.1", "the nixl-cu13 plugin links libcuda.so.1: on GPU hosts install the NVIDIA driver; on hosts without "
                     "one (Trainium) use a NIXL built without CUDA, or build the four-function stand-in kvpush keeps "
                     "(common/testing/native/libcuda_standin.c: cc -shared -fPIC -o libcuda.so.1 ...) onto "
                     "LD_LIBRARY_PATH"),
    ("libcudart.so.13", "pip install nvidia-cuda-runtime==13.0.96 and add its nvidia/cu13/lib to LD_LIBRARY_PATH"),
    ("libcudart.so.12", "pip install nvidia-cuda-runtime-cu12 and add its nvidia/cuda_runtime/lib to LD_LIBRARY_PATH"),
    ("libhwloc.so.15", "apt-get install libhwloc15"),
)


def plugin_load_fix(error: str) -> str:
    """The fix for a LIBFABRIC plugin load error: a missing FABRIC_1.x symbol version names the libfabric release
    that has it; otherwise the first library the loader names that we know."""
    from kvpush_common.transport.efa import FABRIC_SYMBOL_SINCE

    symbol = next((s for s in FABRIC_SYMBOL_SINCE if f"`{s}'" in error), None)
    if symbol:
        v = FABRIC_SYMBOL_SINCE[symbol]
        return (f"a libfabric exporting {symbol} (libfabric >= {v[0]}.{v[1]}: the EFA installer's, in "
                "/opt/amazon/efa/lib) must come first on LD_LIBRARY_PATH, or use the NIXL your platform pins")
    for needle, fix in LIBFABRIC_PLUGIN_NEEDS:
        if needle in error:
            return fix
    return "install the libraries it names"


def check_library(name: str, soname: str, fix: str, *, symbols: Sequence[str] = (), warn: bool = False) -> Check:
    """A shared library the dynamic loader finds, optionally with the symbols we rely on."""
    try:
        lib = ctypes.CDLL(soname)
    except OSError as e:
        hint = ctypes.util.find_library(soname.split(".so")[0].removeprefix("lib"))
        return Check(name, False, "not loadable", (f"{soname}: {e}{f' (found {hint})' if hint else ''}: {fix}",), warn)
    missing = [s for s in symbols if not hasattr(lib, s)]
    if missing:
        return Check(name, False, f"{soname} loads", (f"{soname} lacks {', '.join(missing)}: {fix}",), warn)
    return Check(name, True, f"{soname} loads" + (f" ({', '.join(symbols)} present)" if symbols else ""))


