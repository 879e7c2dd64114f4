"""Launch plans (`kvpush config`): the device-agnostic parts (the host checks are in `doctor.py`).

A device backend declares a *target* under the `kvpush.targets` entry-point group (pyproject.toml),
an object with:

    name: str                                      # "neuron", "cuda"
    help: str
    add_arguments(parser)                          # its `kvpush config <name>` options
    server_plan(args) -> LaunchPlan                # one `vllm serve` with its environment
    doctor(env, plan: dict | None) -> list[Check]  # checks of this host (and of a plan's environment)

The core finds targets only through entry points: it never imports a backend.  Here live the
pieces they share: the launch plan and its shell/JSON rendering, device splits, the common
`kvpush config` options, the router plan, the secret check of a plan, and target discovery.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shlex
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

from kvpush_common.device.ranges import parse_range  # noqa: F401 (the targets use deploy.parse_range)
from kvpush_common.ops.doctor import Check

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
