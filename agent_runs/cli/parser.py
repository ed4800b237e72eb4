"""The `agent-runs` argument parser, assembled from each command module's `register`."""

from __future__ import annotations

import argparse

from agent_runs.cli import (
    client,
    dashboard,
    demo,
    limits,
    migrate,
    operator,
    recovery,
    wait,
    worker,
)
from agent_runs.cli.common import PROG, Parser

# Command modules in help order; each has `register(sub, common)`.
COMMAND_MODULES = (migrate, client, wait, worker, operator, recovery, limits, demo, dashboard)


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common.add_argument(
        "--dsn", help="PostgreSQL URL or libpq DSN (default: $DATABASE_URL)", default=None
    )
    common.add_argument(
        "--no-prepare",
        action="store_true",
        help="no named prepared statements (PgBouncer in transaction mode; "
        "also AGENT_RUNS_NO_PREPARE=1)",
    )
    parser = Parser(
        prog=PROG,
        description="Durable agent runs on PostgreSQL. Every command takes --dsn "
        "(default: $DATABASE_URL).",
        epilog="exit codes: 0 ok, 2 bad usage or input, 1 failure",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub, common)
    return parser
