"""Launch plans (`kvpush config`) and host checks (`kvpush doctor`): the device-agnostic parts.

A device backend declares a *target* under the `kvpush.targets` entry-point group (pyproject.toml),
an object with:

    name: str                                      # "neuron", "cuda"
    help: str
    add_arguments(parser)                          # its `kvpush config <name>` options
    server_plan(args) -> LaunchPlan                # one `vllm serve` with its environment
    doctor(env, plan: dict | None) -> list[Check]  # checks of this host (and of a plan's environment)

The core finds targets only through entry points: it never imports a backend.  Here live the
pieces they share: the launch plan and its shell/JSON rendering, device splits, the common
`kvpush config` options, the router plan, and the checks every target runs (Python, NIXL and its
plugins, modules).
"""

from __future__ import annotations

import argparse
import ctypes.util
import importlib.metadata
import importlib.util
import json
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from kvpush_common.device.ranges import parse_range  # noqa: F401 (the targets use deploy.parse_range)
from kvpush_common.transport.nixl import NIXL_INSTALL

ENTRY_POINT_GROUP = "kvpush.targets"
ROLES = ("prefill", "decode")
TOPOLOGIES = ("same-host", "two-host")
NEURON_INDEX = "https://pip.repos.neuron.amazonaws.com"


# ---- launch plans -------------------------------------------------------------------------------

@dataclass
class LaunchPlan:
    """One process to start: its environment and argv (nothing here runs it)."""

    target: str
    role: str  # prefill, decode, router
    name: str  # e.g. prefill0
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    prepend: dict[str, str] = field(default_factory=dict)  # path-like variables: value goes in front
    unset: list[str] = field(default_factory=list)  # variables that must not reach the process
    url: str = ""  # http base URL where it serves (for the router and the health wait)
    devices: str = ""  # its device slice, as written in the visibility variable
    extra: dict = field(default_factory=dict)  # kv_connector_extra_config, for `doctor --plan`
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["command"] = shlex.join(self.argv)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "LaunchPlan":
        keys = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in keys})

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """`base` as the process would see it after this plan's unset/export/prepend lines."""
        env = {k: v for k, v in base.items() if k not in self.unset}
        env.update(self.env)
        for k, v in self.prepend.items():
            env[k] = f"{v}:{env[k]}" if env.get(k) else v
        return env


def render_shell(plan: LaunchPlan) -> str:
    """A bash snippet: comments, `unset`/`export` lines, then the command (one option per line)."""
    lines = [f"# kvpush {plan.target} {plan.name}: {plan.url or '(no URL)'}"
             + (f", devices {plan.devices}" if plan.devices else "")]
    lines += [f"# {n}" for n in plan.notes]
    lines += [f"unset {k}" for k in plan.unset]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in plan.env.items()]
    lines += [f"export {k}={shlex.quote(v)}${{{k}:+:${k}}}" for k, v in plan.prepend.items()]
    argv = plan.argv
    head = 3 if len(argv) > 2 and argv[1] == "serve" else 2  # "vllm serve MODEL" / "kvpush router"
    lines.append(" \\\n  ".join([shlex.join(argv[:head])] + _group(argv[head:])))
    return "\n".join(lines) + "\n"


def _group(argv: Sequence[str]) -> list[str]:
    parts, i = [], 0
    while i < len(argv):
        if argv[i].startswith("-") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            parts.append(f"{shlex.quote(argv[i])} {shlex.quote(argv[i + 1])}")
            i += 2
        else:
            parts.append(shlex.quote(argv[i]))
            i += 1
    return parts


def render_json(plan: LaunchPlan) -> str:
    return json.dumps(plan.to_dict(), indent=2) + "\n"


# ---- device splits ------------------------------------------------------------------------------

def device_slice(role: str, index: int, count: int, total: int, topology: str) -> list[int]:
    """Device ids of instance `index` of `role`, `count` devices each, on a host with `total`.

    same-host: prefill instances fill the first half of the host, decode instances the second half
    (P and D never share a device).  two-host: each role has its host to itself and starts at 0."""
    if count < 1 or index < 0:
        raise ValueError("need at least one device and a non-negative instance index")
    if topology == "same-host":
        half = total // 2
        start, end = (0, half) if role == "prefill" else (half, total)
    else:
        start, end = 0, total
    first = start + index * count
    if first + count > end:
        raise ValueError(f"{role} {index} needs devices [{first}, {first + count}) but its share of this host is "
                         f"[{start}, {end}) ({topology}, {total} devices): lower --tp or the instance count, or "
                         "pass --devices")
    return list(range(first, first + count))


def format_range(ids: Sequence[int]) -> str:
    """[0,1,2,3] -> "0-3"; [0,2,3] -> "0,2-3" (the NEURON_VISIBLE_DEVICES syntax)."""
    out, ids = [], sorted(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


# ---- `kvpush config` options and the server plan shared by every target -------------------------

def add_common_arguments(p: argparse.ArgumentParser, *, tp: int, total: int, device_word: str) -> None:
    p.add_argument("--role", choices=ROLES + ("router",), required=True,
                   help="prefill or decode vllm serve, or the kvpush router in front of them")
    p.add_argument("--model", help="model to serve (required for prefill/decode)")
    p.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    p.add_argument("--tp", type=int, default=tp, help=f"tensor-parallel size = {device_word} per server "
                                                      "(default: %(default)s)")
    p.add_argument("--index", type=int, default=0, help="instance index of this role (xPyD): shifts ports and "
                                                        "devices (default: %(default)s)")
    p.add_argument("--topology", choices=TOPOLOGIES, default="same-host",
                   help="same-host: P and D split one host's devices; two-host: each role has a host")
    p.add_argument("--total-devices", type=int, default=total,
                   help=f"{device_word} on the host (default: %(default)s)")
    p.add_argument("--devices", default=None, help=f"explicit {device_word} list (e.g. 0-7), instead of the split")
    p.add_argument("--host", default="0.0.0.0", help="HTTP bind address (default: %(default)s)")
    p.add_argument("--advertise-host", default=None,
                   help="address of this host that peers and the router reach (side channel; default: 127.0.0.1 "
                        "for same-host, required for two-host)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: 8100+index prefill, 8200+index decode, "
                                                          "8000 router)")
    p.add_argument("--kv-port", type=int, default=None,
                   help="prefill side channel base port; rank r serves on it + r (default: 5700 + index*tp)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="kvpush Prometheus base port, rank r on it + r (default: 9100/9600 + index*tp; 0: off)")
    p.add_argument("--max-model-len", type=int, default=17408, help="(default: %(default)s: 16k prompt + output)")
    p.add_argument("--prefix-caching", choices=("on", "off", "default"), default="default",
                   help="vLLM prefix caching (default: off on decode, vLLM's default on prefill)")
    p.add_argument("--extra-config", default="{}", metavar="JSON",
                   help="merged into kv_connector_extra_config (timeouts, secret, backend_params, ...)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for vllm serve; repeat (e.g. --vllm-arg=--max-num-seqs=32)")
    p.add_argument("--vllm-bin", default="vllm", help="vllm executable (default: %(default)s)")
    p.add_argument("--kvpush-bin", default="kvpush", help="router: kvpush executable (default: %(default)s)")
    p.add_argument("--event-dir", default=None, help="KVPUSH_EVENT_DIR: per-request event logs (JSON lines)")
    p.add_argument("--prefill-url", action="append", default=[], metavar="URL", help="router: a prefill server")
    p.add_argument("--decode-url", action="append", default=[], metavar="URL", help="router: a decode server")
    p.add_argument("--router-mode", default="push", help="router: --mode (default: %(default)s)")
    p.add_argument("--format", choices=("shell", "json"), default="shell")


def advertise_host(args) -> str:
    if args.advertise_host:
        return args.advertise_host
    if args.topology == "two-host":
        raise ValueError("--topology two-host needs --advertise-host (this host's address on the EFA subnet)")
    return "127.0.0.1"


def server_devices(args) -> list[int]:
    if args.devices:
        return parse_range(args.devices)
    return device_slice(args.role, args.index, args.tp, args.total_devices, args.topology)


def server_plan(args, *, target: str, connector: str, module: str, env: dict[str, str], devices: str,
                backend: str, extra: Mapping | None = None, prepend: dict[str, str] | None = None,
                unset: Sequence[str] = (), notes: Sequence[str] = ()) -> LaunchPlan:
    """A `vllm serve` plan with kvpush's kv-transfer-config for `args.role`."""
    if not args.model:
        raise ValueError("--model is required for prefill and decode")
    prefill = args.role == "prefill"
    port = args.port if args.port is not None else (8100 if prefill else 8200) + args.index
    host = advertise_host(args)
    served = args.served_model_name or args.model
    cfg = {"host": host, "backend": backend, "mode": "push", "same_host": args.topology == "same-host",
           "model_id": served}
    if prefill:
        cfg["port"] = args.kv_port if args.kv_port is not None else 5700 + args.index * args.tp
    metrics = args.metrics_port if args.metrics_port is not None else (9100 if prefill else 9600) + args.index * args.tp
    if metrics:
        cfg["metrics_port"] = metrics
    cfg.update(extra or {})
    cfg.update(json.loads(args.extra_config))
    ktc = {"kv_connector": connector, "kv_connector_module_path": module,
           "kv_role": "kv_producer" if prefill else "kv_consumer", "kv_connector_extra_config": cfg}
    if not prefill:
        ktc["kv_load_failure_policy"] = "recompute"
    argv = [args.vllm_bin, "serve", args.model, "--host", args.host, "--port", str(port),
            "--tensor-parallel-size", str(args.tp), "--max-model-len", str(args.max_model_len)]
    if args.served_model_name:
        argv += ["--served-model-name", args.served_model_name]
    caching = args.prefix_caching if args.prefix_caching != "default" else ("off" if not prefill else "default")
    if caching != "default":
        argv.append("--enable-prefix-caching" if caching == "on" else "--no-enable-prefix-caching")
    argv += list(args.vllm_arg)
    argv += ["--kv-transfer-config", json.dumps(ktc, separators=(",", ":"))]
    env = dict(env)
    if args.event_dir:
        env["KVPUSH_EVENT_DIR"] = args.event_dir
    if unsigned_across_hosts(cfg):
        notes = [*notes, SECRET_NOTE]
    return LaunchPlan(target=target, role=args.role, name=f"{args.role}{args.index}", argv=argv, env=env,
                      prepend=dict(prepend or {}), unset=list(unset), url=f"http://{host}:{port}", devices=devices,
                      extra=cfg, notes=list(notes))


SECRET_NOTE = ("other hosts reach this side channel: kvpush refuses to start without a secret; export KVPUSH_SECRET, the "
               "same on every prefill and decode host (e.g. once: openssl rand -hex 32), or pass --extra-config "
               "'{\"secret\": ...}' (or allow_unauthenticated: true on a trusted network)")


def unsigned_across_hosts(extra: Mapping) -> bool:
    """The plan's side channel is reachable from other hosts and its config itself names no secret (the server may
    still get one from KVPUSH_SECRET) nor allows running without one."""
    host = str(extra.get("host", "127.0.0.1"))
    loopback = host == "localhost" or host.startswith("127.") or host in ("::1", "[::1]")
    return not (loopback or extra.get("secret") or extra.get("allow_unauthenticated"))


def check_secret(env: Mapping[str, str], plan: dict | None) -> Check:
    """A plan whose side channel other hosts reach needs a secret: in the plan or KVPUSH_SECRET in this environment
    (the connector refuses to start otherwise)."""
    extra = dict((plan or {}).get("extra") or {})
    if plan is None or not unsigned_across_hosts(extra) or env.get("KVPUSH_SECRET"):
        return Check("secret", True, "loopback side channel, or a secret is set" if plan else "no plan given")
    return Check("secret", False, f"side channel {extra.get('host')} without a secret", (SECRET_NOTE,))


def router_plan(args, target: str) -> LaunchPlan:
    if not args.prefill_url or not args.decode_url:
        raise ValueError("--role router needs --prefill-url and --decode-url (repeat for xPyD)")
    port = args.port if args.port is not None else 8000
    argv = [args.kvpush_bin, "router", "--mode", args.router_mode, "--host", args.host, "--port", str(port)]
    for u in args.prefill_url:
        argv += ["--prefill", u]
    for u in args.decode_url:
        argv += ["--decode", u]
    host = args.advertise_host or "127.0.0.1"
    return LaunchPlan(target=target, role="router", name="router", argv=argv, url=f"http://{host}:{port}")


def plan_from_args(target, args) -> LaunchPlan:
    return router_plan(args, target.name) if args.role == "router" else target.server_plan(args)


# ---- `kvpush doctor` ----------------------------------------------------------------------------

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


# ---- target discovery ---------------------------------------------------------------------------

def load_targets() -> tuple[dict[str, object], dict[str, str]]:
    """({name: target}, {name: why it could not be loaded}) from the `kvpush.targets` entry points."""
    targets, broken = {}, {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            targets[ep.name] = ep.load()
        except Exception as e:  # a broken backend must not take `kvpush router` down with it
            broken[ep.name] = f"{ep.value}: {type(e).__name__}: {e}"
    return targets, broken
