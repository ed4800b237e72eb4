"""`agent-runs migrate`: apply or roll back the schema migrations (yoyo)."""

from __future__ import annotations

import argparse
from typing import Any

from agent_runs.cli.common import UsageError, resolve_dsn


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("migrate", parents=[common], help="apply the schema migrations")
    p.add_argument("--rollback", action="store_true", help="roll back the last migration")
    p.add_argument(
        "--langgraph",
        action="store_true",
        help="also create or upgrade langgraph-checkpoint-postgres's tables "
        "(agent_runs[langgraph]: its own migrations)",
    )
    p.set_defaults(func=cmd_migrate)


def cmd_migrate(args: argparse.Namespace) -> int:
    # Migrations never use named prepared statements, so --no-prepare changes nothing here.
    from agent_runs.migrate import apply_migrations, rollback_migrations

    dsn = resolve_dsn(args.dsn)
    if args.rollback:
        done = rollback_migrations(dsn, count=1)
        print(f"rolled back: {', '.join(done)}" if done else "nothing to roll back")
    else:
        done = apply_migrations(dsn)
        print(f"applied: {', '.join(done)}" if done else "already up to date")
    if args.langgraph and not args.rollback:
        try:
            from agent_runs.langgraph import setup
        except ImportError as exc:
            raise UsageError(
                "--langgraph needs the langgraph extra: "
                f"pip install 'agent_runs[langgraph]' ({exc})"
            ) from None
        setup(dsn)
        print("langgraph checkpoints: up to date")
    return 0
