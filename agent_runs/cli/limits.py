"""`agent-runs limit set KEY N`, `limit delete KEY`, `limit list [--json]`: concurrency limits
per key (at most N runs of KEY counted at once; 0 pauses it)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from agent_runs.cli.common import open_connection
from agent_runs.display import aligned, escape
from agent_runs.models import KeyLimit
from agent_runs.repository import AgentRunRepository

LIMIT_COLUMNS = ("key", "running", "limit", "waiting")


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("limit", help="concurrency limits per key: set, delete, list")
    actions = p.add_subparsers(dest="limit_command", required=True, metavar="ACTION")

    q = actions.add_parser(
        "set", parents=[common], help="at most N runs of KEY running at once (0 pauses it)"
    )
    q.add_argument("key", metavar="KEY", help="a concurrency key, e.g. user:u-7")
    q.add_argument("max_running", metavar="N", type=int, help="the limit, 0 or more")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(func=cmd_set)

    q = actions.add_parser("delete", parents=[common], help="KEY's runs are unlimited again")
    q.add_argument("key", metavar="KEY")
    q.set_defaults(func=cmd_delete)

    q = actions.add_parser("list", parents=[common], help="every limit, its running and waiting")
    q.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    q.set_defaults(func=cmd_list)


def limit_json(limit: KeyLimit) -> dict[str, Any]:
    return limit._asdict()


def cmd_set(args: argparse.Namespace) -> int:
    with open_connection(args) as conn:
        limit = AgentRunRepository(conn).set_limit(args.key, args.max_running)
    if args.json:
        print(json.dumps(limit_json(limit), indent=2, ensure_ascii=False))
    else:
        print(
            f"{escape(limit.concurrency_key)}: at most {limit.max_running} running "
            f"({limit.running} now, {limit.waiting} waiting)"
        )
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    with open_connection(args) as conn:
        deleted = AgentRunRepository(conn).delete_limit(args.key)
    shown = escape(args.key)
    print(f"{shown}: limit deleted" if deleted else f"{shown}: had no limit")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    with open_connection(args) as conn:
        limits = AgentRunRepository(conn).list_limits()
    if args.json:
        print(json.dumps([limit_json(x) for x in limits], indent=2, ensure_ascii=False))
        return 0
    rows = [
        (escape(x.concurrency_key), str(x.running), str(x.max_running), str(x.waiting))
        for x in limits
    ]
    print("\n".join(aligned([LIMIT_COLUMNS, *rows])) if rows else "no limits")
    return 0
