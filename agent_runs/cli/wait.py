"""`agent-runs wait RUN_ID`: block until a run is terminal, print its status and why."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, Final

from agent_runs.cli.common import PROG, open_connection
from agent_runs.display import escape
from agent_runs.explain import explain_run
from agent_runs.models import RunStatus
from agent_runs.notify import wait_for_run
from agent_runs.report import history_json
from agent_runs.repository import AgentRunRepository

EXIT_COMPLETED: Final = 0
EXIT_OTHER_FINAL_STATUS: Final = 1
EXIT_TIMEOUT: Final = 124  # as timeout(1)
# Without --timeout, wait in slices of this long until the run ends.
_SLICE_SECONDS: Final = 3600.0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "wait",
        parents=[common],
        help="wait until a run is finished; print its final status and why",
        epilog="exit codes: 0 completed, 1 any other final status, 124 timeout, "
        "2 bad input or unknown run",
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
    with open_connection(args) as conn:
        try:
            if args.timeout is not None:
                run = wait_for_run(conn, args.run_id, timeout_seconds=args.timeout)
            else:
                while True:
                    try:
                        run = wait_for_run(conn, args.run_id, timeout_seconds=_SLICE_SECONDS)
                        break
                    except TimeoutError:
                        continue
        except TimeoutError as exc:
            print(f"{PROG}: {escape(str(exc))}", file=sys.stderr)
            return EXIT_TIMEOUT
        attempts = AgentRunRepository(conn).list_run_attempts(run.id)
    explanation = explain_run(run, attempts)
    if args.json:
        print(json.dumps(history_json(run, attempts, explanation), indent=2, ensure_ascii=False))
    else:
        print(f"{escape(run.id)}  {run.status}")
        print(("" if explanation.explained else "!! ") + escape(explanation.text))
    return EXIT_COMPLETED if run.status == RunStatus.COMPLETED else EXIT_OTHER_FINAL_STATUS


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0: {text!r}")
    return value
