"""`agent-runs wait RUN_ID`: block until a run is terminal, print its status and why."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Final

import psycopg

from agent_runs import validation as check
from agent_runs.backoff import Backoff
from agent_runs.cli.common import PROG, open_connection
from agent_runs.display import escape, one_line
from agent_runs.errors import DB_ERRORS, InvalidArgument
from agent_runs.explain import explain_run
from agent_runs.models import AgentRun, RunStatus
from agent_runs.notify import wait_for_run
from agent_runs.report import history_json
from agent_runs.repository import AgentRunRepository

EXIT_COMPLETED: Final = 0
EXIT_OTHER_FINAL_STATUS: Final = 1
EXIT_TIMEOUT: Final = 124  # as timeout(1)
# The database could not be reached (sysexits' EX_UNAVAILABLE): the run's end is unknown.
EXIT_UNREACHABLE: Final = 69
# Without --timeout, wait in slices of this long until the run ends.
_SLICE_SECONDS: Final = 3600.0
# Without --timeout, a lost connection is retried for this long before giving up (exit 69).
RECONNECT_SECONDS: Final = 60.0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "wait",
        parents=[common],
        help="wait until a run is finished; print its final status and why",
        epilog="exit codes: 0 completed, 1 any other final status, 124 timeout, "
        "2 bad input or unknown run, 69 database unreachable (the run's end is unknown)",
    )
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        metavar="S",
        help="give up after S seconds (exit 124; default: wait until the run ends)",
    )
    p.add_argument("--json", action="store_true", help="print the run's history as JSON")
    p.set_defaults(func=cmd_wait)


def cmd_wait(args: argparse.Namespace) -> int:
    """Wait on one connection; a lost one is replaced (the run's end is in the database) until
    --timeout, or for RECONNECT_SECONDS without it. A first connection that fails is not
    retried: the DSN or the server is wrong, and waiting would hide it."""
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    backoff = Backoff(initial=0.1, cap=2.0)
    connected_once = False
    lost_since: float | None = None
    while True:
        try:
            with open_connection(args) as conn:
                connected_once, lost_since = True, None
                backoff.reset()
                run = _wait(conn, args.run_id, deadline)
                attempts = AgentRunRepository(conn).list_run_attempts(run.id)
            break
        except TimeoutError as exc:
            print(f"{PROG}: {escape(str(exc))}", file=sys.stderr)
            return EXIT_TIMEOUT
        except DB_ERRORS as exc:
            now = time.monotonic()
            lost_since = now if lost_since is None else lost_since
            give_up_at = lost_since + RECONNECT_SECONDS if deadline is None else deadline
            delay = backoff.next_delay()
            if not connected_once or now + delay >= give_up_at:
                why = "lost" if connected_once else "not reachable"
                print(
                    f"{PROG}: database {why}, the run's end is unknown: {escape(one_line(exc))}",
                    file=sys.stderr,
                )
                return EXIT_UNREACHABLE
            print(
                f"{PROG}: connection lost ({escape(one_line(exc))}); reconnecting",
                file=sys.stderr,
            )
            time.sleep(delay)
    explanation = explain_run(run, attempts)
    if args.json:
        print(json.dumps(history_json(run, attempts, explanation), indent=2, ensure_ascii=False))
    else:
        print(f"{escape(run.id)}  {run.status}")
        print(("" if explanation.explained else "!! ") + escape(explanation.text))
    return EXIT_COMPLETED if run.status == RunStatus.COMPLETED else EXIT_OTHER_FINAL_STATUS


def _wait(conn: psycopg.Connection[Any], run_id: str, deadline: float | None) -> AgentRun:
    """wait_for_run until the monotonic `deadline` (None: until the run ends)."""
    while True:
        left = _SLICE_SECONDS if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return wait_for_run(conn, run_id, timeout_seconds=left)
        except TimeoutError:
            if deadline is not None:
                raise


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    try:
        return check.timeout_seconds(value, "--timeout")
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
