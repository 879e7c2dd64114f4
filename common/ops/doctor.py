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


def nixl_plugin_dirs(env: Mapping[str, str]) -> list[Path]:
    """Where NIXL looks for backend plugins: NIXL_PLUGIN_DIR, then the plugin folders of the nixl wheels."""
    dirs = [Path(env["NIXL_PLUGIN_DIR"])] if env.get("NIXL_PLUGIN_DIR") else []
    for entry in sys.path:
        base = Path(entry or ".")
        if not base.is_dir():
            continue
        dirs += sorted(base.glob("nixl*.libs/nixl")) + sorted(base.glob(".nixl*.mesonpy.libs/plugins"))
    return [d for d in dict.fromkeys(dirs) if d.is_dir()]


def _dlopen_error(path: Path, env: Mapping[str, str]) -> str:
    """'' if the NIXL plugin loads (all its libraries and symbols resolve) in a subprocess with `env`, else the
    error: NIXL dlopens it the same way and reports only "unsupported backend" when that fails."""
    # NIXL's own libraries first (the plugin links against them), as the agent loads its plugins
    code = ("import ctypes,sys\ntry: import nixl._api\nexcept Exception: pass\n"
            "try: ctypes.CDLL(sys.argv[1])\nexcept OSError as e: print(e)")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                             env=dict(env))
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"could not test-load: {e}"
    return (out.stdout.strip() or (out.stderr.strip()[-300:] if out.returncode else ""))


def check_nixl(env: Mapping[str, str], backends: Sequence[str]) -> list[Check]:
    """NIXL importable, and each backend's plugin present and loadable with this environment."""
    mod = check_module("nixl", "nixl", ("nixl", "nixl-cu13", "nixl-cu12"),
                       f"{NIXL_INSTALL} (scripts/setup-venv.sh does)")
    checks = [mod]
    dirs = nixl_plugin_dirs(env)
    for backend in backends:
        name = f"nixl-plugin-{backend}"
        path = next((d / f"libplugin_{backend}.so" for d in dirs if (d / f"libplugin_{backend}.so").exists()), None)
        if path is None:
            where = ", ".join(map(str, dirs)) or "no NIXL plugin directory found"
            checks.append(Check(name, False, "missing", (
                f"libplugin_{backend}.so not found ({where}): install the nixl-cu13 wheel or set NIXL_PLUGIN_DIR to "
                "the folder holding the NIXL plugins",)))
            continue
        err = _dlopen_error(path, env)
        if not err:
            checks.append(Check(name, True, str(path)))
            continue
        fix = plugin_load_fix(err) if backend == "LIBFABRIC" else "install the libraries it names"
        checks.append(Check(name, False, f"{path} does not load",
                            (f"NIXL would refuse backend {backend!r} (\"unsupported backend\"): {err}; fix: {fix}",)))
    return checks


def check_fabric(env: Mapping[str, str], hmem_for: str, probe=None) -> Check:
    """The libfabric NIXL's LIBFABRIC plugin will load (with `env`): its providers, and `efa` with FI_HMEM so
    that `hmem_for` memory ("Neuron HBM", "GPU memory") registers.  `probe`: fabric_info.probe_subprocess."""
    from kvpush_common.transport import fabric_info

    info = (probe or fabric_info.probe_subprocess)(dict(env))
    if info is None:
        return Check("libfabric", False, "not found", (f"libfabric.so.1 not found: {LIBFABRIC_PLUGIN_NEEDS[1][1]}",))
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


# What NIXL 1.5.1's LIBFABRIC plugin links, and how each is provided (measured: docs/design.md section 10).
LIBFABRIC_PLUGIN_NEEDS = (
    ("FABRIC_1.10", "a libfabric exporting FABRIC_1.10 (libfabric >= 2.7: the EFA installer's, in /opt/amazon/efa/lib) "
                    "must come first on LD_LIBRARY_PATH"),
    ("libfabric.so.1", "a libfabric exporting FABRIC_1.10 (libfabric >= 2.7: the EFA installer's, in "
                       "/opt/amazon/efa/lib) must come first on LD_LIBRARY_PATH"),
    ("libcuda.so.1", "the nixl-cu13 plugin links libcuda.so.1: on GPU hosts install the NVIDIA driver; on hosts without "
                     "one (Trainium) use a NIXL built without CUDA, or build the four-function stand-in kvpush keeps "
                     "(common/testing/native/libcuda_standin.c: cc -shared -fPIC -o libcuda.so.1 ...) onto "
                     "LD_LIBRARY_PATH"),
    ("libcudart.so.13", "pip install nvidia-cuda-runtime==13.0.96 and add its nvidia/cu13/lib to LD_LIBRARY_PATH"),
    ("libhwloc.so.15", "apt-get install libhwloc15"),
)


def plugin_load_fix(error: str) -> str:
    """The fix for a LIBFABRIC plugin load error: the first library the loader names that we know."""
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


