"""`agent-runs demo`: workers on a scripted mix of runs, on an embedded PostgreSQL by default."""

from __future__ import annotations

import argparse
import os
from typing import Any

from agent_runs.cli.common import UsageError, check_dsn, positive_float, positive_int


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "demo", parents=[common], help="run workers on a scripted mix (embedded PostgreSQL)"
    )
    p.add_argument(
        "--lease-seconds", type=positive_float, default=2.0, metavar="S", help="default 2"
    )
    p.add_argument(
        "--workers", type=positive_int, default=3, metavar="N", help="worker processes (3)"
    )
    p.add_argument(
        "--timeout", type=positive_float, default=60.0, metavar="S", help="give up after S (60)"
    )
    p.add_argument("--show-worker-logs", action="store_true", help="pass the workers' logs through")
    p.add_argument(
        "--langgraph",
        action="store_true",
        help="a LangGraph agent's worker crashes mid-graph and another resumes it "
        "(agent_runs[langgraph])",
    )
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from agent_runs.devtools.worker_demo import run_demo

    dsn = args.dsn or os.environ.get("DATABASE_URL") or None
    if dsn is not None:
        check_dsn(dsn)
    if args.langgraph:
        try:
            from agent_runs.devtools.langgraph_demo import run_langgraph_demo
        except ImportError as exc:
            raise UsageError(
                f"--langgraph needs the langgraph extra: pip install 'agent_runs[langgraph]' "
                f"({exc})"
            ) from None
        return run_langgraph_demo(dsn, lease_seconds=args.lease_seconds, timeout=args.timeout)
    return run_demo(
        dsn,
        lease_seconds=args.lease_seconds,
        workers=args.workers,
        timeout=args.timeout,
        show_worker_logs=args.show_worker_logs,
    )
