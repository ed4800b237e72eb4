"""`agent-runs enqueue` and `agent-runs attempts`: create a run, read a run's history."""

from __future__ import annotations

import argparse
import json
import uuid
from datetime import UTC, datetime
from typing import Any

from agent_runs.cli.common import OTEL_HELP, UsageError, open_connection, otel_from_env
from agent_runs.durations import parse_duration, parse_timestamp
from agent_runs.explain import explain_run
from agent_runs.report import history_json, render_history
from agent_runs.repository import AgentRunRepository


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("enqueue", parents=[common], help="create a run; prints its id")
    p.add_argument("--thread", required=True, help="conversation thread id")
    p.add_argument("--agent-slug", required=True, help="which agent runs it")
    p.add_argument("--uid", required=True, help="user id")
    p.add_argument("--payload", default=None, help="input payload, a JSON object")
    p.add_argument("--request-id", default=None, help="idempotency key (default: a new uuid)")
    p.add_argument("--run-type", default="chat", choices=("chat", "resume", "subagent"))
    p.add_argument("--created-by-run-id", default=None, help="parent run of a sub-agent run")
    p.add_argument("--priority", type=int, default=0, help="0 (claimed first) to 9; default 0")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--available-at", default=None, metavar="TS", help="claimable from TS")
    when.add_argument("--delay", default=None, metavar="D", help="claimable after D (90s, 15m)")
    p.add_argument(
        "--concurrency-key",
        default=None,
        metavar="K",
        help="the key whose limit this run counts against (agent-runs limit set K N)",
    )
    p.add_argument("--otel", action="store_true", help=OTEL_HELP + "; TRACEPARENT: the parent")
    p.set_defaults(func=cmd_enqueue)

    p = sub.add_parser("attempts", parents=[common], help="a run's attempt history, explained")
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_attempts)


def parse_payload(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        payload = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise UsageError(f"--payload is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise UsageError("--payload must be a JSON object")
    return payload


def _available_at(args: argparse.Namespace) -> datetime | None:
    if args.available_at is not None:
        return parse_timestamp("--available-at", args.available_at)
    if args.delay is not None:
        return datetime.now(UTC) + parse_duration("--delay", args.delay)
    return None


def cmd_enqueue(args: argparse.Namespace) -> int:
    payload = parse_payload(args.payload)
    available_at = _available_at(args)
    otel = otel_from_env(args, "agent-runs-enqueue", parent_from_env=True)
    try:
        with open_connection(args) as conn:
            repo = AgentRunRepository(conn, telemetry=None if otel is None else otel.telemetry)
            run = repo.create_run(
                thread_id=args.thread,
                agent_slug=args.agent_slug,
                uid=args.uid,
                request_id=args.request_id or str(uuid.uuid4()),
                input_payload=payload,
                run_type=args.run_type,
                created_by_run_id=args.created_by_run_id,
                priority=args.priority,
                available_at=available_at,
                concurrency_key=args.concurrency_key,
            )
    finally:
        if otel is not None:
            otel.shutdown()  # exports the span before the process ends
    print(run.id)
    return 0


def cmd_attempts(args: argparse.Namespace) -> int:
    with open_connection(args) as conn:
        repo = AgentRunRepository(conn)
        run = repo.get_run(args.run_id)
        if run is None:
            raise UsageError(f"no run with id {args.run_id!r}")
        attempts = repo.list_run_attempts(run.id)
        requeues = repo.list_run_requeues(run.id)
        policy = repo.get_policy(run.agent_slug)
        key = run.concurrency_key
        key_limit = None if key is None or run.is_terminal else repo.get_limit(key)
    explanation = explain_run(run, attempts, requeues, policy, key_limit=key_limit)
    if args.json:
        document = history_json(run, attempts, explanation, requeues)
        print(json.dumps(document, indent=2, ensure_ascii=False))
    else:
        print(render_history(run, attempts, explanation))
    return 0
