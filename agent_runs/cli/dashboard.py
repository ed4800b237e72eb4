"""`agent-runs dashboard`: serve the web dashboard (needs the `dashboard` extra).

The token comes from AGENT_RUNS_DASHBOARD_TOKEN, never from argv (argv is visible to every
user of the machine). A non-loopback --host without a token is refused before anything starts.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys
from types import FrameType
from typing import Any, Final

from agent_runs import validation as check
from agent_runs.cli.common import UsageError, connect_options, resolve_dsn
from agent_runs.display import escape
from agent_runs.durations import parse_duration
from agent_runs.errors import InvalidArgument

TOKEN_ENV: Final = "AGENT_RUNS_DASHBOARD_TOKEN"
DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 8765


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "dashboard",
        parents=[common],
        help="serve the web dashboard (pip install 'agent_runs[dashboard]')",
        description=f"Serve the web dashboard. With {TOKEN_ENV} set, every request needs that "
        "token (Bearer header or the /login form's cookie).",
    )
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    p.add_argument(
        "--allow-cancel", action="store_true", help="offer cancel and cancel-tree on run pages"
    )
    p.add_argument(
        "--statement-timeout",
        default="5s",
        metavar="D",
        help="cancel a page's queries after D, e.g. 5s (default 5s)",
    )
    p.add_argument("--pool-size", type=int, default=4, metavar="N", help="connections (4)")
    p.add_argument(
        "--root-path", default="", help="the path prefix a reverse proxy serves it under"
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests whose Host header is NAME (any port) or NAME:PORT, e.g. the "
        "name a reverse proxy forwards; repeatable. Without it only the bound address and "
        "localhost, 127.0.0.1 and [::1] with --port are answered (others get a 400)",
    )
    p.set_defaults(func=cmd_dashboard)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def cmd_dashboard(args: argparse.Namespace) -> int:
    token = os.environ.get(TOKEN_ENV) or None
    if not is_loopback(args.host) and token is None:
        raise UsageError(
            f"refusing to serve on non-loopback host {args.host!r} without a token: set {TOKEN_ENV}"
        )
    check.dashboard_token(token, TOKEN_ENV)
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be from 1 to 65535, got {args.port}")
    if not 1 <= args.pool_size <= 100:
        raise UsageError(f"--pool-size must be from 1 to 100, got {args.pool_size}")
    timeout = parse_duration("--statement-timeout", args.statement_timeout).total_seconds()
    if timeout > 3600:
        raise UsageError("--statement-timeout must be at most 1h")
    dsn = resolve_dsn(args.dsn)
    try:
        import uvicorn

        from agent_runs.dashboard import create_app
    except ModuleNotFoundError as exc:
        raise UsageError(
            f"the dashboard needs the 'dashboard' extra ({exc.name} is missing): "
            "pip install 'agent_runs[dashboard]'"
        ) from None
    from agent_runs.db import create_pool

    allowed_hosts = _allowed_hosts(args)

    options = connect_options(args)
    with create_pool(dsn, min_size=1, max_size=args.pool_size, **options) as pool:
        app = create_app(
            pool,
            allow_cancel=args.allow_cancel,
            token=token,
            statement_timeout_seconds=timeout,
            allowed_hosts=allowed_hosts,
        )
        from agent_runs.dashboard.startup import startup_lines

        host = f"[{args.host}]" if ":" in args.host else args.host
        lines = startup_lines(
            f"http://{host}:{args.port}{args.root_path}/",
            dsn,
            allow_cancel=args.allow_cancel,
            token=token is not None,
            allowed_hosts=allowed_hosts,
        )
        print("\n".join(lines), file=sys.stderr, flush=True)
        # uvicorn shuts down gracefully on SIGTERM, then raises the signal again: our handler
        # then turns it into a normal exit (0) instead of death by signal.
        previous = signal.signal(signal.SIGTERM, _stopped)
        try:
            uvicorn.run(
                app,
                host=args.host,
                port=args.port,
                root_path=args.root_path,
                log_level="warning",
                proxy_headers=True,
                server_header=False,
            )
        except _Stopped:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
    return 0


def _allowed_hosts(args: argparse.Namespace) -> list[str]:
    """The Host names this server answers to; a bad --allowed-host is a usage error."""
    from agent_runs.dashboard.hosts import parse_entry, served_hosts

    for entry in args.allowed_host:
        try:
            parse_entry(entry)
        except InvalidArgument as exc:
            raise UsageError(f"--allowed-host {escape(entry)[:80]}: {exc}") from None
    extra = list(args.allowed_host)
    if args.host in ("0.0.0.0", "::"):  # every interface: the machine's own names reach it
        extra += [f"{name}:{args.port}" for name in _machine_names()]
    return served_hosts(args.host, args.port, extra)


def _machine_names() -> list[str]:
    from agent_runs.dashboard.hosts import parse_entry

    names: list[str] = []
    for name in dict.fromkeys([socket.gethostname(), socket.getfqdn()]):
        try:
            parse_entry(name)
        except InvalidArgument:
            continue
        names.append(name)
    return names


class _Stopped(Exception):
    """SIGTERM arrived (after uvicorn's graceful shutdown)."""


def _stopped(signum: int, frame: FrameType | None) -> None:
    raise _Stopped
