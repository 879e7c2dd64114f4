"""The `kvpush` command: one subcommand per part of kvpush that runs as its own process."""

from __future__ import annotations

import argparse
import logging
import sys

from kvpush_common.router import app as router
from kvpush_common.router.config import MODES, RouterConfig, StartupError
from kvpush_common.router.policy import POLICIES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpush", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_router(sub)
    _add_config_and_doctor(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.run(args, parser)


def _add_router(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="OpenAI-compatible router in front of prefill and decode vLLM instances",
                       description=router.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--mode", choices=MODES, default="push")
    p.add_argument("--prefill", action="append", default=[], metavar="URL", help="prefill instance; repeat for several")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="decode instance; repeat for several (single mode uses the first)")
    p.add_argument("--retries", type=int, default=2, help="retries after a prefill failure (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=300.0, metavar="S",
                   help="every request ends by then (default: %(default)s)")
    p.add_argument("--prefill-timeout", type=float, default=None, metavar="S",
                   help="per prefill attempt, so a hung prefill is retried (default: only the request timeout)")
    p.add_argument("--startup-timeout", type=float, default=600.0, metavar="S",
                   help="how long to wait for prefill instances to come up (default: %(default)s)")
    p.add_argument("--health-interval", type=float, default=5.0, metavar="S",
                   help="how often upstream /health is polled (default: %(default)s)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument("--policy", choices=POLICIES, default="kv-aware",
                   help="how prefill and decode instances are chosen: kv-aware (the least to compute given what "
                        "each probably caches, against its load) or round-robin (default: %(default)s)")
    p.add_argument("--skip-prefill-max-tokens", type=int, default=0, metavar="N",
                   help="push/pull: send a request to the decode instance alone when it probably caches all of the "
                        "prompt but at most N tokens (estimated: token ids exactly, text as bytes/4), e.g. 256 for "
                        "multi-turn chat; 0: never (default: %(default)s)")
    p.add_argument("--no-warm-up", action="store_true",
                   help="push: skip the start-up request that makes each decode instance handshake with each prefill")
    p.set_defaults(run=_run_router)


def _run_router(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from aiohttp import web

    try:
        config = RouterConfig(
            mode=args.mode, prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode),
            retries=args.retries, request_timeout_s=args.request_timeout, prefill_timeout_s=args.prefill_timeout,
            startup_timeout_s=args.startup_timeout, health_interval_s=args.health_interval,
            warm_up=not args.no_warm_up, policy=args.policy,
            skip_prefill_max_tokens=args.skip_prefill_max_tokens)
    except ValueError as e:
        parser.error(str(e))
    log = logging.getLogger("kvpush.router")
    try:
        # handler_cancellation: a client that hangs up cancels its handler, which closes both legs
        web.run_app(router.build_app(config), host=args.host, port=args.port, handler_cancellation=True,
                    access_log=None,
                    print=lambda _: log.info("router (mode %s) on http://%s:%d", args.mode, args.host, args.port))
    except StartupError as e:
        log.error("router start-up failed: %s", e)
        return 1
    return 0


# ---- kvpush config / kvpush doctor: device targets found through entry points ----------------------

def _add_config_and_doctor(sub: argparse._SubParsersAction) -> None:
    from kvpush_common.ops import deploy

    targets, broken = deploy.load_targets()
    p = sub.add_parser("config", help="print the environment and vllm serve (or router) command of one server",
                       description="Launch plan of one server for a device target: `export` lines and the command "
                                   "(--format shell), or JSON.  Targets come from the kvpush.targets entry points.")
    p.set_defaults(run=_run_config, log_level="WARNING", broken_targets=broken)
    tsub = p.add_subparsers(dest="target", required=True, metavar="TARGET")
    for name, target in sorted(targets.items()):
        tp = tsub.add_parser(name, help=target.help, description=target.help)
        target.add_arguments(tp)
        tp.set_defaults(target_obj=target)
    d = sub.add_parser("doctor", help="check this host before launching a target's servers; non-zero exit on failure",
                       description="Checks this host (and a generated launch environment) for a device target and "
                                   "explains each failure with its fix.  Exit status 1 when any check fails.")
    d.add_argument("--target", required=True, choices=sorted(set(targets) | set(broken)))
    d.add_argument("--plan", action="append", default=[], metavar="FILE",
                   help="a `kvpush config ... --format json` output: check the environment it launches with "
                        "(repeat for several servers; default: this shell's environment)")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.set_defaults(run=_run_doctor, log_level="WARNING", targets=targets, broken_targets=broken)


def _run_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvpush_common.ops import deploy

    try:
        plan = deploy.plan_from_args(args.target_obj, args)
    except ValueError as e:
        print(f"kvpush config {args.target}: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(deploy.render_shell(plan) if args.format == "shell" else deploy.render_json(plan))
    return 0


def _run_doctor(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import json
    import os

    from kvpush_common.ops import deploy, doctor

    if args.target in args.broken_targets:
        checks = [doctor.Check("target", False, "cannot load", (
            f"the {args.target} target does not import ({args.broken_targets[args.target]}): reinstall kvpush "
            "(pip install -e .) and its backend's dependencies",))]
        plans: list = [None]
    else:
        plans = []
        for path in args.plan:
            with open(path) as f:
                plans.append(json.load(f))
            if plans[-1].get("target") != args.target:
                parser.error(f"{path}: plan is for target {plans[-1].get('target')!r}, not {args.target!r}")
        checks = []
        for plan in plans or [None]:
            env = deploy.LaunchPlan.from_dict(plan).environment(os.environ) if plan else dict(os.environ)
            found = args.targets[args.target].doctor(env, plan)
            if plan is not None:
                found = [doctor.Check(f"{plan.get('name')}: {c.name}", c.ok, c.detail, c.problems, c.warn)
                         for c in found]
            checks += found
    sys.stdout.write(doctor.checks_json(args.target, checks) if args.json
                     else doctor.render_checks(args.target, checks))
    return 1 if doctor.failed(checks) else 0


if __name__ == "__main__":
    sys.exit(main())
