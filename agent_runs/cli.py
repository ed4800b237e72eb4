"""The `agent-runs` command line (also `python -m agent_runs`).

Exit codes: 0 success; 2 bad usage or input (one line on stderr, no traceback: unknown options,
a missing DSN, bad JSON, an argument the repository refuses, an unknown run id for `attempts`);
1 failure (database unreachable or erroring, a busy thread on `enqueue`, a demo that did not
converge).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, NoReturn

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool

from agent_runs.db import connect, create_pool
from agent_runs.errors import InvalidArgument, ThreadBusy
from agent_runs.explain import explain_run
from agent_runs.report import history_json, render_history
from agent_runs.repository import AgentRunRepository
from agent_runs.worker import DB_ERRORS, Agent, Backoff, Worker

log = logging.getLogger("agent_runs.cli")

PROG = "agent-runs"
# libpq gives up on an unreachable server after this long; workers then back off and retry.
CONNECT_TIMEOUT_SECONDS = 5
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class UsageError(Exception):
    """Bad usage or input: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument(
        "--dsn", help="PostgreSQL URL or libpq DSN (default: $DATABASE_URL)", default=None
    )
    parser = _Parser(
        prog=PROG,
        description="Durable agent runs on PostgreSQL. Every command takes --dsn "
        "(default: $DATABASE_URL).",
        epilog="exit codes: 0 ok, 2 bad usage or input, 1 failure",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("migrate", parents=[common], help="apply the schema migrations")
    p.add_argument("--rollback", action="store_true", help="roll back the last migration")
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("enqueue", parents=[common], help="create a run; prints its id")
    p.add_argument("--thread", required=True, help="conversation thread id")
    p.add_argument("--agent-slug", required=True, help="which agent runs it")
    p.add_argument("--uid", required=True, help="user id")
    p.add_argument("--payload", default=None, help="input payload, a JSON object")
    p.add_argument("--request-id", default=None, help="idempotency key (default: a new uuid)")
    p.add_argument("--run-type", default="chat", choices=("chat", "resume", "subagent"))
    p.add_argument("--created-by-run-id", default=None, help="parent run of a sub-agent run")
    p.set_defaults(func=cmd_enqueue)

    p = sub.add_parser("worker", parents=[common], help="claim and execute runs until SIGTERM")
    p.add_argument(
        "--concurrency", type=_positive_int, default=1, metavar="N", help="threads (default 1)"
    )
    p.add_argument(
        "--agent", default="scripted", help="`scripted` (default) or an import path module:callable"
    )
    p.add_argument(
        "--agent-slug",
        action="append",
        dest="agent_slugs",
        default=None,
        metavar="SLUG",
        help="only claim runs of this agent slug (repeatable; default: any)",
    )
    p.add_argument(
        "--lease-seconds", type=_positive_float, default=60.0, metavar="S", help="default 60"
    )
    p.add_argument(
        "--heartbeat-seconds", type=_positive_float, metavar="H", help="default: lease / 3"
    )
    p.add_argument("--max-tries", type=_positive_int, default=3, metavar="M", help="default 3")
    p.add_argument("--name", help="stable worker identity (default: host-pid)")
    p.add_argument(
        "--poll-seconds",
        type=_positive_float,
        default=1.0,
        metavar="P",
        help="idle wait between claims (default 1)",
    )
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=_LOG_LEVELS)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("reconcile", parents=[common], help="fail runs whose lease expired")
    p.add_argument(
        "--every",
        type=_positive_float,
        metavar="SECONDS",
        help="repeat every SECONDS until SIGTERM (default: once)",
    )
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=_LOG_LEVELS)
    p.set_defaults(func=cmd_reconcile)

    p = sub.add_parser("attempts", parents=[common], help="a run's attempt history, explained")
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_attempts)

    p = sub.add_parser(
        "demo", parents=[common], help="run workers on a scripted mix (embedded PostgreSQL)"
    )
    p.add_argument(
        "--lease-seconds", type=_positive_float, default=2.0, metavar="S", help="default 2"
    )
    p.add_argument(
        "--workers", type=_positive_int, default=3, metavar="N", help="worker processes (3)"
    )
    p.add_argument(
        "--timeout", type=_positive_float, default=60.0, metavar="S", help="give up after S (60)"
    )
    p.add_argument("--show-worker-logs", action="store_true", help="pass the workers' logs through")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (UsageError, InvalidArgument) as exc:
        return _fail(2, str(exc))
    except ThreadBusy as exc:
        return _fail(1, f"thread busy: {exc}")
    except psycopg.Error as exc:
        return _fail(1, f"database error: {_one_line(exc)}")
    except KeyboardInterrupt:
        return 130


# -- commands --------------------------------------------------------------------------------


def cmd_migrate(args: argparse.Namespace) -> int:
    from agent_runs.migrate import apply_migrations, rollback_migrations

    dsn = resolve_dsn(args.dsn, url_only=True)
    if args.rollback:
        done = rollback_migrations(dsn, count=1)
        print(f"rolled back: {', '.join(done)}" if done else "nothing to roll back")
    else:
        done = apply_migrations(dsn)
        print(f"applied: {', '.join(done)}" if done else "already up to date")
    return 0


def cmd_enqueue(args: argparse.Namespace) -> int:
    dsn = resolve_dsn(args.dsn)
    payload: Any = {}
    if args.payload is not None:
        try:
            payload = json.loads(args.payload)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--payload is not valid JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise UsageError("--payload must be a JSON object")
    with connect(dsn, connect_timeout=CONNECT_TIMEOUT_SECONDS) as conn:
        run = AgentRunRepository(conn).create_run(
            thread_id=args.thread,
            agent_slug=args.agent_slug,
            uid=args.uid,
            request_id=args.request_id or str(uuid.uuid4()),
            input_payload=payload,
            run_type=args.run_type,
            created_by_run_id=args.created_by_run_id,
        )
    print(run.id)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    dsn = resolve_dsn(args.dsn)
    _setup_logging(args.log_level)
    agent = load_agent(args.agent)
    pool = _worker_pool(dsn, max_size=args.concurrency + 2)
    try:
        worker = Worker(
            pool,
            agent,
            name=args.name,
            lease_seconds=args.lease_seconds,
            heartbeat_seconds=args.heartbeat_seconds,
            max_tries=args.max_tries,
            poll_seconds=args.poll_seconds,
            agent_slugs=args.agent_slugs,
        )
    except InvalidArgument:
        pool.close()
        raise
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("%s: stop claiming; asking running agents to stop", signal.Signals(signum).name)
        stop.set()
        worker.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threads = [
        threading.Thread(
            target=worker.run_forever, args=(stop,), name=f"{worker.name}/{i}", daemon=True
        )
        for i in range(1, args.concurrency + 1)
    ]
    log.info(
        "worker %s: %d thread(s), lease %.1fs, heartbeat %.1fs, max tries %d, agent %s",
        worker.name,
        args.concurrency,
        worker.lease_seconds,
        worker.heartbeat_seconds,
        worker.max_tries,
        args.agent,
    )
    for thread in threads:
        thread.start()
    while not stop.is_set() and any(t.is_alive() for t in threads):
        stop.wait(0.5)
    # Agents that honour should_stop() are done quickly; one that ignores it gets one lease.
    deadline = time.monotonic() + worker.lease_seconds
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        log.warning("an agent ignored the stop request for a whole lease; exiting anyway")
        logging.shutdown()
        os._exit(0)  # the abandoned run's lease expires and the reconciler converges it
    worker.close()
    pool.close(timeout=2.0)
    log.info("worker %s stopped", worker.name)
    return 0


def cmd_reconcile(args: argparse.Namespace) -> int:
    dsn = resolve_dsn(args.dsn)
    _setup_logging(args.log_level)
    if args.every is None:
        with connect(dsn, connect_timeout=CONNECT_TIMEOUT_SECONDS) as conn:
            total = _reconcile_all(AgentRunRepository(conn))
        print(f"reconciled {total} run(s)")
        return 0

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    pool = _worker_pool(dsn, max_size=1)
    backoff = Backoff()
    log.info("reconciler: every %.1fs", args.every)
    try:
        while not stop.is_set():
            try:
                with pool.connection(timeout=CONNECT_TIMEOUT_SECONDS) as conn:
                    _reconcile_all(AgentRunRepository(conn))
            except DB_ERRORS as exc:
                delay = backoff.next_delay()
                log.warning("reconcile failed (%s); retrying in %.1fs", _one_line(exc), delay)
                stop.wait(delay)
                continue
            except Exception:  # a long-lived reconciler logs a bug loudly and carries on
                delay = backoff.next_delay()
                log.exception("reconcile error; retrying in %.1fs", delay)
                stop.wait(delay)
                continue
            backoff.reset()
            stop.wait(args.every)
    finally:
        pool.close(timeout=2.0)
    return 0


def cmd_attempts(args: argparse.Namespace) -> int:
    dsn = resolve_dsn(args.dsn)
    with connect(dsn, connect_timeout=CONNECT_TIMEOUT_SECONDS) as conn:
        repo = AgentRunRepository(conn)
        run = repo.get_run(args.run_id)
        if run is None:
            raise UsageError(f"no run with id {args.run_id!r}")
        attempts = repo.list_run_attempts(run.id)
    explanation = explain_run(run, attempts)
    if args.json:
        print(json.dumps(history_json(run, attempts, explanation), indent=2, ensure_ascii=False))
    else:
        print(render_history(run, attempts, explanation))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from agent_runs.demo import run_demo

    dsn = args.dsn or os.environ.get("DATABASE_URL") or None
    if dsn is not None:
        _check_dsn(dsn)
    return run_demo(
        dsn,
        lease_seconds=args.lease_seconds,
        workers=args.workers,
        timeout=args.timeout,
        show_worker_logs=args.show_worker_logs,
    )


# -- helpers ---------------------------------------------------------------------------------


def resolve_dsn(dsn: str | None, *, url_only: bool = False) -> str:
    """--dsn, else $DATABASE_URL; a missing or malformed one is a usage error."""
    dsn = dsn or os.environ.get("DATABASE_URL") or None
    if dsn is None:
        raise UsageError("no database: pass --dsn or set DATABASE_URL")
    _check_dsn(dsn)
    if url_only and not dsn.startswith(("postgresql://", "postgres://", "postgresql+psycopg://")):
        raise UsageError("migrate needs a postgresql:// URL, not a key=value DSN")
    return dsn


def _check_dsn(dsn: str) -> None:
    try:
        conninfo_to_dict(dsn.replace("postgresql+psycopg://", "postgresql://", 1))
    except psycopg.ProgrammingError as exc:
        raise UsageError(f"invalid DSN: {_one_line(exc)}") from None


def load_agent(spec: str) -> Agent:
    """`scripted`, or `module:callable` (a class is instantiated with no arguments)."""
    if spec == "scripted":
        from agent_runs.agents import ScriptedAgent

        return ScriptedAgent()
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise UsageError(f"--agent must be 'scripted' or module:callable, not {spec!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: agents next to where you run it
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"--agent {spec}: {_one_line(exc)}") from None
    if isinstance(obj, type):
        obj = obj()
    if not callable(obj):
        raise UsageError(f"--agent {spec} is not callable")
    agent: Agent = obj
    return agent


def _reconcile_all(repo: AgentRunRepository, limit: int = 500) -> int:
    total = 0
    while True:
        converged = repo.reconcile_expired_leases(limit=limit)
        for run in converged:
            log.info("reconciled run %s: %s (%s)", run.id, run.status, run.error_type)
        total += len(converged)
        if len(converged) < limit:
            return total


def _worker_pool(dsn: str, *, max_size: int) -> ConnectionPool:
    # open() does not wait: a worker started before its database keeps retrying instead of dying.
    return create_pool(
        dsn,
        min_size=1,
        max_size=max_size,
        kwargs={"connect_timeout": CONNECT_TIMEOUT_SECONDS},
        name="agent-runs",
    )


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)-7s %(name)s [%(process)d %(threadName)s] %(message)s",
    )


def _fail(code: int, message: str) -> int:
    print(f"{PROG}: {' '.join(message.split())}", file=sys.stderr)
    return code


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number: {text!r}")
    return value
