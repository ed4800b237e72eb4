"""`agent-runs requeue` and `agent-runs policy show|set|delete`: the recovery policy."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from agent_runs.cli.common import UsageError, open_connection
from agent_runs.display import escape
from agent_runs.durations import parse_duration
from agent_runs.errors import InvalidArgument
from agent_runs.policies import RunPolicy
from agent_runs.repository import AgentRunRepository
from agent_runs.repository.recovery_transitions import KEEP


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("requeue", parents=[common], help="run a failed/cancelled run again")
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--reason", default=None, help="why (kept with the requeue)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_requeue)

    p = sub.add_parser("policy", parents=[common], help="recovery policies per agent slug")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", parents=[common], help="one slug's effective policy, or all")
    show.add_argument("slug", nargs="?", default=None, metavar="SLUG")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=cmd_policy_show)
    put = actions.add_parser("set", parents=[common], help="set fields of a slug's policy")
    put.add_argument("slug", metavar="SLUG", help="agent slug, or '*' for the default")
    put.add_argument("--max-attempts", type=int, default=None, metavar="N")
    put.add_argument("--max-lost-leases", type=int, default=None, metavar="N")
    put.add_argument("--backoff", default=None, metavar="D", help="first delay (90s, 15m, 2h)")
    put.add_argument("--backoff-max", default=None, metavar="D", help="longest delay")
    put.add_argument("--jitter", type=float, default=None, metavar="X", help="0-1")
    put.add_argument("--deadline", default=None, metavar="D|none", help="after creation")
    put.add_argument("--json", action="store_true", help="print JSON")
    put.set_defaults(func=cmd_policy_set)
    drop = actions.add_parser("delete", parents=[common], help="remove a slug's policy")
    drop.add_argument("slug", metavar="SLUG")
    drop.set_defaults(func=cmd_policy_delete)


def cmd_requeue(args: argparse.Namespace) -> int:
    with open_connection(args) as conn:
        run, changed = AgentRunRepository(conn).requeue_run(args.run_id, reason=args.reason)
    assert run is not None
    if args.json:
        print(json.dumps({"run_id": run.id, "status": run.status, "requeued": changed}))
    elif changed:
        print(f"requeued {escape(run.id)}: pending")
    else:
        print(f"not requeued: run {escape(run.id)} is {run.status} (not ended yet)")
    return 0 if changed else 1


def _seconds(name: str, text: str | None) -> Any:
    return KEEP if text is None else parse_duration(name, text).total_seconds()


def cmd_policy_set(args: argparse.Namespace) -> int:
    deadline: Any = KEEP
    if args.deadline is not None:
        none = args.deadline.strip().lower() == "none"
        deadline = None if none else parse_duration("--deadline", args.deadline).total_seconds()
    given = {
        "max_attempts": KEEP if args.max_attempts is None else args.max_attempts,
        "max_lost_leases": KEEP if args.max_lost_leases is None else args.max_lost_leases,
        "backoff_seconds": _seconds("--backoff", args.backoff),
        "backoff_max_seconds": _seconds("--backoff-max", args.backoff_max),
        "backoff_jitter": KEEP if args.jitter is None else args.jitter,
        "deadline_seconds": deadline,
    }
    try:
        with open_connection(args) as conn:
            policy = AgentRunRepository(conn).set_policy(args.slug, **given)
    except InvalidArgument as exc:
        raise UsageError(str(exc)) from None
    _print([policy], args.json)
    return 0


def cmd_policy_show(args: argparse.Namespace) -> int:
    with open_connection(args) as conn:
        repo = AgentRunRepository(conn)
        if args.slug is None:
            policies = repo.list_policies() or [repo.get_policy("*")]
        else:
            policies = [repo.get_policy(args.slug)]
    _print(policies, args.json)
    return 0


def cmd_policy_delete(args: argparse.Namespace) -> int:
    with open_connection(args) as conn:
        deleted = AgentRunRepository(conn).delete_policy(args.slug)
    print(f"deleted the policy of {escape(args.slug)}" if deleted else "no such policy")
    return 0 if deleted else 1


def _print(policies: list[RunPolicy], as_json: bool) -> None:
    if as_json:
        out = [dataclasses.asdict(p) for p in policies]
        for item in out:
            item["updated_at"] = item["updated_at"] and item["updated_at"].isoformat()
        print(json.dumps(out if len(out) != 1 else out[0], indent=2, ensure_ascii=False))
        return
    for p in policies:
        deadline = "none" if p.deadline_seconds is None else f"{p.deadline_seconds:g}s"
        print(
            f"{escape(p.agent_slug)} (from {escape(p.source)}): max_attempts {p.max_attempts}, "
            f"max_lost_leases {p.max_lost_leases}, backoff {p.backoff_seconds:g}s "
            f"(max {p.backoff_max_seconds:g}s, jitter {p.backoff_jitter:g}), deadline {deadline}"
        )
