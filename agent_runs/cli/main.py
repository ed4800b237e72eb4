"""`main()`: parse, run one command, turn errors into exit codes and one line on stderr.

Exit codes: 0 success; 2 bad usage or input (one line on stderr, no traceback: unknown options,
a missing DSN, bad JSON, an argument the repository refuses, an unknown run id); 1 failure
(database unreachable or erroring, a busy thread on `enqueue`, a demo that did not converge).
Commands may return other codes of their own (`wait`: 124 on timeout, 69 when the database
could not be reached and the run's end is unknown; `worker`: 1 when a thread could not start).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import psycopg

from agent_runs.cli.common import PROG, UsageError
from agent_runs.cli.parser import build_parser
from agent_runs.display import escape, one_line
from agent_runs.errors import InvalidArgument, ThreadBusy
from agent_runs.migrate import MigrationLocked


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    for position, argument in enumerate(arguments, start=1):
        bad = _not_unicode(argument)
        if bad:
            return fail(2, f"argument {position} is not valid UTF-8 text ({bad})")
    try:
        args = build_parser().parse_args(arguments)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (UsageError, InvalidArgument) as exc:
        return fail(2, str(exc))
    except ThreadBusy as exc:
        return fail(1, f"thread busy: {exc}")
    except MigrationLocked as exc:
        return fail(1, str(exc))
    except psycopg.Error as exc:
        return fail(1, f"database error: {one_line(exc)}")
    except KeyboardInterrupt:
        return 130


def fail(code: int, message: str) -> int:
    print(f"{PROG}: {escape(' '.join(message.split()))}", file=sys.stderr)
    return code


def _not_unicode(text: str) -> str | None:
    """What makes `text` unusable: undecodable bytes (kept by Python as lone surrogates)."""
    for ch in text:
        if "\ud800" <= ch <= "\udfff":
            return "undecodable bytes" if "\udc80" <= ch <= "\udcff" else "a lone surrogate"
    return None
