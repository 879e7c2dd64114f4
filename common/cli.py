"""The `kvpush` command: one subcommand per part of kvpush that runs as its own process."""

from __future__ import annotations

import argparse
import logging
import sys

from . import router


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpush", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_router(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.run(args, parser)


def _add_router(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="OpenAI-compatible router in front of prefill and decode vLLM instances",
                       description=router.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--mode", choices=router.MODES, default="push")
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
    p.add_argument("--no-warm-up", action="store_true",
                   help="push: skip the start-up request that makes each decode instance handshake with each prefill")
    p.set_defaults(run=_run_router)


def _run_router(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from aiohttp import web

    try:
        config = router.RouterConfig(
            mode=args.mode, prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode),
            retries=args.retries, request_timeout_s=args.request_timeout, prefill_timeout_s=args.prefill_timeout,
            startup_timeout_s=args.startup_timeout, health_interval_s=args.health_interval,
            warm_up=not args.no_warm_up)
    except ValueError as e:
        parser.error(str(e))
    log = logging.getLogger("kvpush.router")
    try:
        # handler_cancellation: a client that hangs up cancels its handler, which closes both legs
        web.run_app(router.build_app(config), host=args.host, port=args.port, handler_cancellation=True,
                    access_log=None,
                    print=lambda _: log.info("router (mode %s) on http://%s:%d", args.mode, args.host, args.port))
    except router.StartupError as e:
        log.error("router start-up failed: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
