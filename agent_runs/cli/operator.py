"""Operator commands: `runs`, `cancel`, `stats`, `prune` (each with --json or a readable table).

Four commands with a parser, a JSON form and a table each: longer than the other command
modules, one section per command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from agent_runs.cli.common import UsageError, open_connection, positive_int
from agent_runs.display import aligned, escape
from agent_runs.durations import format_duration, parse_duration, parse_since
from agent_runs.models import AgentRun, RunStatus
from agent_runs.operator_values import RunFilters
from agent_runs.repository import AgentRunRepository
from agent_runs.repository.operator_queries import RunStats, RunSummary, runs_cursor

RUNS_COLUMNS: Final = (
    "id",
    "status",
    "agent",
    "thread",
    "attempts",
    "last owner",
    "created",
    "age",
    "error type",
)
DEFAULT_STATS_SINCE: Final = "24h"
# Prune reports progress on stderr at most this often while it works.
PROGRESS_SECONDS: Final = 2.0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("runs", parents=[common], help="list runs, newest first")
    p.add_argument(
        "--status",
        action="append",
        choices=[s.value for s in RunStatus],
        help="only runs in this status (repeatable)",
    )
    p.add_argument("--agent-slug", default=None, help="only runs of this agent")
    p.add_argument("--thread", default=None, help="only runs of this conversation thread")
    p.add_argument("--uid", default=None, help="only runs of this user")
    p.add_argument("--key", default=None, metavar="K", help="only runs of this concurrency key")
    p.add_argument(
        "--worker",
        default=None,
        metavar="NAME",
        help="only runs with an attempt by this worker identity (owner token before its last ':')",
    )
    p.add_argument(
        "--since", default=None, metavar="D|TS", help="created since: 2h, 7d or ISO 8601"
    )
    p.add_argument(
        "--stuck",
        action="store_true",
        help=(
            "expired leases not yet reconciled, and pending runs claimable for longer than "
            "--stuck-after"
        ),
    )
    p.add_argument("--stuck-after", default="15m", metavar="D", help="default 15m")
    p.add_argument(
        "--scheduled",
        action="store_true",
        help="pending runs not yet available (soonest first; with --agent-slug, --limit)",
    )
    p.add_argument("--limit", type=int, default=50, help="runs per page, 1-1000 (default 50)")
    p.add_argument("--before", default=None, metavar="CURSOR", help="the page after this cursor")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("cancel", parents=[common], help="request cancel of a run (or its tree)")
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--tree", action="store_true", help="also every run it created, recursively")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("stats", parents=[common], help="failure patterns, durations, the queue")
    p.add_argument(
        "--since", default=DEFAULT_STATS_SINCE, metavar="D|TS", help="window (default 24h)"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("prune", parents=[common], help="delete old finished runs and attempts")
    p.add_argument("--older-than", required=True, metavar="D", help="finished more than D ago")
    p.add_argument("--batch", type=positive_int, default=1000, help="runs per transaction")
    p.add_argument("--dry-run", action="store_true", help="count what would go, delete nothing")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_prune)


# -- runs ------------------------------------------------------------------------------------


def run_json(summary: RunSummary) -> dict[str, Any]:
    """The run's columns (as `attempts --json` prints them) plus its attempt_count."""
    out = {k: _json_value(v) for k, v in dataclasses.asdict(summary.run).items()}
    out["attempt_count"] = summary.attempt_count
    return out


def cmd_scheduled(args: argparse.Namespace) -> int:
    with open_connection(args) as conn:
        runs = AgentRunRepository(conn).list_scheduled_runs(
            agent_slug=args.agent_slug, limit=args.limit
        )
    if args.json:
        out = [{k: _json_value(v) for k, v in dataclasses.asdict(r).items()} for r in runs]
        print(json.dumps(out, indent=2, ensure_ascii=False))
        return 0
    rows = [
        (r.id, r.agent_slug, r.thread_id, str(r.priority), _ts(r.available_at or r.created_at))
        for r in runs
    ]
    columns = ("run", "agent", "thread", "priority", "available_at")
    print("\n".join(table(columns, rows) if rows else ["(no scheduled runs)"]))
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    if args.scheduled:
        return cmd_scheduled(args)
    since = None if args.since is None else parse_since("--since", args.since)
    filters: RunFilters = {
        "statuses": args.status,
        "agent_slug": args.agent_slug,
        "thread_id": args.thread,
        "uid": args.uid,
        "concurrency_key": args.key,
        "worker": args.worker,
        "since": since,
        "stuck": args.stuck,
        "stuck_after": parse_duration("--stuck-after", args.stuck_after),
        "limit": args.limit,
        "before": args.before,
    }
    if args.json:  # whole runs; the table below reads only the columns it shows
        with open_connection(args) as conn:
            summaries = AgentRunRepository(conn).list_run_summaries(**filters)
        cursor = runs_cursor(summaries[-1].run) if len(summaries) == args.limit else None
        print(json.dumps([run_json(s) for s in summaries], indent=2, ensure_ascii=False))
        if cursor:
            print(f"next page: --before {cursor}", file=sys.stderr)
        return 0
    with open_connection(args) as conn:
        listings = AgentRunRepository(conn).list_run_listings(**filters)
    cursor = runs_cursor(listings[-1]) if len(listings) == args.limit else None
    now = datetime.now(UTC)
    rows = [
        (
            s.id,
            s.status.value,
            s.agent_slug,
            s.thread_id,
            str(s.attempt_count),
            s.last_worker_id or "-",
            _ts(s.created_at),
            format_duration(now - s.created_at),
            s.error_type or "-",
        )
        for s in listings
    ]
    lines = table(RUNS_COLUMNS, rows) if rows else ["(no runs)"]
    lines.append(f"next page: --before {cursor}" if cursor else "(end of list)")
    print("\n".join(lines))
    return 0


# -- cancel ----------------------------------------------------------------------------------


def cmd_cancel(args: argparse.Namespace) -> int:
    with open_connection(args) as conn:
        repo = AgentRunRepository(conn)
        if args.tree:
            changed = repo.request_cancel_tree(args.run_id)
        else:
            changed = _cancel_one(repo, args.run_id)
    counts = Counter(run.status.value for run in changed)
    if args.json:
        payload = {
            "changed": dict(sorted(counts.items())),
            "runs": [{"id": run.id, "status": run.status.value} for run in changed],
        }
        print(json.dumps(payload, indent=2, ensure_ascii=False))
        return 0
    if not changed:
        print("nothing changed (already cancelled, cancel requested or finished)")
    else:
        print(", ".join(f"{status}: {n}" for status, n in sorted(counts.items())))
    return 0


def _cancel_one(repo: AgentRunRepository, run_id: str) -> list[AgentRun]:
    before = repo.get_run(run_id)
    if before is None:
        raise UsageError(f"no run with id {escape(run_id)!r}")
    after = repo.request_cancel(run_id)
    if after is None or after.status == before.status:
        return []
    return [after]


# -- stats -----------------------------------------------------------------------------------


def stats_json(stats: RunStats) -> dict[str, Any]:
    durations = stats.durations
    age = stats.queue.oldest_pending_age
    return {
        "window_start": _json_value(stats.window_start),
        "now": _json_value(stats.now),
        "runs_by_status": dict(stats.runs_by_status),
        "attempts_by_outcome": dict(stats.attempts_by_outcome),
        "top_error_types": [
            {"error_type": k, "count": n} for k, n in stats.top_error_types.items()
        ],
        "workers": [dataclasses.asdict(w) for w in stats.workers],
        "attempt_duration_seconds": None
        if durations is None
        else {"p50": durations.p50, "p95": durations.p95, "max": durations.max},
        "queue": {
            "pending": stats.queue.pending,
            "oldest_pending_age_seconds": None if age is None else age.total_seconds(),
            "running": stats.queue.running,
            "expired_unreconciled": stats.queue.expired_unreconciled,
        },
    }


def render_stats(stats: RunStats) -> list[str]:
    start = "the beginning" if stats.window_start is None else _ts(stats.window_start)
    lines = [f"window: {start} .. {_ts(stats.now)}", ""]
    lines.append("runs by final status: " + _pairs(stats.runs_by_status.items()))
    lines.append("attempts by outcome:  " + _pairs(stats.attempts_by_outcome.items()))
    d = stats.durations
    if d is None:
        lines.append("attempt duration:     -")
    else:
        lines.append(f"attempt duration:     p50 {d.p50:.3f}s  p95 {d.p95:.3f}s  max {d.max:.3f}s")
    lines.append("")
    lines.append("top error types:")
    if stats.top_error_types:
        lines.extend(table(("error type", "attempts"), stats.top_error_types.items()))
    else:
        lines.append("  (none)")
    lines.append("")
    lines.append("per worker identity (most lease losses and failures first):")
    if stats.workers:
        lines.extend(
            table(
                ("worker", "attempts", "completed", "failed", "lease lost", "retried"),
                [
                    (w.worker, w.attempts, w.completions, w.failures, w.lease_losses, w.retries)
                    for w in stats.workers
                ],
            )
        )
    else:
        lines.append("  (none)")
    q = stats.queue
    age = "-" if q.oldest_pending_age is None else format_duration(q.oldest_pending_age)
    lines.append("")
    lines.append(
        f"now: pending {q.pending} (oldest {age})  running {q.running}  "
        f"expired, not reconciled {q.expired_unreconciled}"
    )
    return lines


def cmd_stats(args: argparse.Namespace) -> int:
    since = parse_since("--since", args.since)
    with open_connection(args) as conn:
        stats = AgentRunRepository(conn).run_stats(since=since)
    if args.json:
        print(json.dumps(stats_json(stats), indent=2, ensure_ascii=False))
    else:
        print("\n".join(render_stats(stats)))
    return 0


# -- prune -----------------------------------------------------------------------------------


def cmd_prune(args: argparse.Namespace) -> int:
    older_than = parse_duration("--older-than", args.older_than)
    runs = attempts = batches = 0
    cutoff: datetime | None = None
    verb = "would delete" if args.dry_run else "deleted"
    started = last_report = time.monotonic()
    with open_connection(args) as conn:
        repo = AgentRunRepository(conn)
        for batch in repo.prune_batches(
            older_than=older_than, batch_size=args.batch, dry_run=args.dry_run
        ):
            runs += batch.runs
            attempts += batch.attempts
            batches += 1
            cutoff = batch.cutoff
            if time.monotonic() - last_report >= PROGRESS_SECONDS:
                last_report = time.monotonic()
                rate = runs / max(last_report - started, 1e-9)
                print(
                    f"... {verb} {runs} runs, {attempts} attempts so far ({rate:.0f} runs/s)",
                    file=sys.stderr,
                )
    if args.json:
        payload = {
            "dry_run": args.dry_run,
            "runs": runs,
            "attempts": attempts,
            "batches": batches,
            "cutoff": _json_value(cutoff),
        }
        print(json.dumps(payload, indent=2))
    else:
        before = "" if cutoff is None else f" (finished before {_ts(cutoff)})"
        print(f"{verb} {runs} runs and {attempts} attempts{before}")
    return 0


# -- shared ----------------------------------------------------------------------------------


def table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """An aligned table; every cell escaped (values from users and agents)."""
    return aligned([list(columns)] + [[escape(cell) for cell in row] for row in rows])


def _pairs(items: Iterable[tuple[str, int]]) -> str:
    text = "  ".join(f"{escape(k)} {n}" for k, n in items)
    return text or "-"


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    return value


def _ts(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
