"""`agent-runs worker` and `agent-runs reconcile`: the long-running processes."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

from psycopg_pool import ConnectionPool

from agent_runs import validation as check
from agent_runs.cli.common import (
    CONNECT_TIMEOUT_SECONDS,
    LOG_LEVELS,
    OTEL_HELP,
    PROG,
    UsageError,
    check_dsn,
    connect_options,
    no_prepare,
    open_connection,
    otel_from_env,
    positive_float,
    positive_int,
    resolve_dsn,
    setup_logging,
)
from agent_runs.db import create_pool
from agent_runs.display import escape, one_line
from agent_runs.errors import DB_ERRORS, InvalidArgument
from agent_runs.logs import logger
from agent_runs.repository import AgentRunRepository
from agent_runs.validation import COMPLETIONS
from agent_runs.worker import Agent, Backoff, Worker

if TYPE_CHECKING:
    from agent_runs.telemetry import Telemetry

log = logger("agent_runs.cli")


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("worker", parents=[common], help="claim and execute runs until SIGTERM")
    p.add_argument(
        "--concurrency",
        type=_concurrency,
        default=1,
        metavar="N",
        help=f"threads, 1-{check.MAX_CONCURRENCY} (default 1)",
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
        "--lease-seconds", type=positive_float, default=60.0, metavar="S", help="default 60"
    )
    p.add_argument(
        "--heartbeat-seconds", type=positive_float, metavar="H", help="default: lease / 3"
    )
    p.add_argument("--max-tries", type=positive_int, default=3, metavar="M", help="default 3")
    p.add_argument("--name", help="stable worker identity (default: host-pid)")
    p.add_argument(
        "--poll-seconds",
        type=positive_float,
        default=None,
        metavar="P",
        help="safety-net poll while idle (default: 10 per process with wake-ups, 1 without)",
    )
    p.add_argument(
        "--listen-dsn",
        default=None,
        metavar="DSN",
        help="direct connection for wake-ups when --dsn goes through a transaction pooler",
    )
    p.add_argument(
        "--no-listen", action="store_true", help="no wake-ups: find new runs by polling only"
    )
    p.add_argument(
        "--completion",
        choices=COMPLETIONS,
        default="durable",
        help="durable (default): a thread's slot is claimed for again once its run's end "
        "committed; async: once the end was handed to the writer thread, so more ends may wait "
        "unwritten (a crash before they are written ends those runs through the reconciler: "
        "failed, worker_lease_expired)",
    )
    p.add_argument("--otel", action="store_true", help=OTEL_HELP)
    p.add_argument(
        "--otel-observe-queue",
        action="store_true",
        help="with --otel: also the gauges agent_runs.run.count and agent_runs.pending.age "
        "(one grouped query per export; turn it on in one process)",
    )
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("reconcile", parents=[common], help="fail runs whose lease expired")
    p.add_argument(
        "--every",
        type=_every,
        metavar="SECONDS",
        help="repeat every SECONDS (at most 86400) until SIGTERM (default: once)",
    )
    p.add_argument("--otel", action="store_true", help=OTEL_HELP)
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    p.set_defaults(func=cmd_reconcile)


def cmd_worker(args: argparse.Namespace) -> int:
    dsn = resolve_dsn(args.dsn)
    if args.listen_dsn is not None:
        check_dsn(args.listen_dsn)
    agent = load_agent(args.agent)
    setup_logging(args.log_level)
    otel = otel_from_env(args, "agent-runs-worker", observe_queue=args.otel_observe_queue)
    pool = worker_pool(args, dsn, max_size=args.concurrency + Worker.own_connections)
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
            completion=args.completion,
            telemetry=None if otel is None else otel.telemetry,
            **_listen_options(args, dsn),
        )
    except BaseException:
        pool.close()
        raise
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("%s: stop claiming; asking running agents to stop", signal.Signals(signum).name)
        worker.request_stop()  # first: a thread that sees `stop` sees the worker stopping too
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threads = [
        threading.Thread(
            target=worker.run_forever, args=(stop,), name=f"{worker.name}/{i}", daemon=True
        )
        for i in range(1, args.concurrency + 1)
    ]
    log.info(
        "worker %s: %d thread(s), lease %.1fs, heartbeat %.1fs, max tries %d, agent %s, %s, "
        "%s completion",
        worker.name,
        args.concurrency,
        worker.lease_seconds,
        worker.heartbeat_seconds,
        worker.max_tries,
        args.agent,
        f"wake-ups + poll every {worker.poll_seconds:g}s"
        if worker.listen_dsn
        else f"poll every {worker.poll_seconds:g}s",
        worker.completion,
    )
    threads, not_started = _start(worker, threads)
    if not_started is not None:  # stop the threads that did start, as SIGTERM would
        worker.request_stop()
        stop.set()
    while not stop.is_set() and any(t.is_alive() for t in threads):
        stop.wait(0.5)
    # Agents that honour should_stop() are done quickly; one that ignores it gets one lease.
    deadline = time.monotonic() + worker.lease_seconds
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        log.warning(
            "a thread did not end within a lease (an agent ignored the stop request, or ends "
            "could not be written); exiting anyway"
        )
        if otel is not None:
            otel.shutdown()
        logging.shutdown()
        os._exit(worker.exit_code)  # the abandoned run's lease expires; the reconciler converges it
    worker.close()
    if otel is not None:
        otel.shutdown()  # exports what is still buffered (the queue gauges read the pool)
    pool.close(timeout=2.0)
    log.info("worker %s stopped", worker.name)
    if not_started is not None:
        print(
            f"{PROG}: worker: could not start thread {len(threads) + 1} of {args.concurrency} "
            f"({escape(one_line(not_started))}); the {len(threads)} started stopped cleanly",
            file=sys.stderr,
        )
        return 1
    return worker.exit_code


def _start(
    worker: Worker, threads: list[threading.Thread]
) -> tuple[list[threading.Thread], Exception | None]:
    """Start the worker's own threads, then `threads` in order; stops at the first that cannot
    start (the system's thread or memory limit) and returns the started ones and that error."""
    started: list[threading.Thread] = []
    try:
        worker.start_threads()  # before any run is claimed: a refusal leaves nothing to undo
    except RuntimeError as exc:
        log.error("could not start the worker's own threads (%s); stopping", one_line(exc))
        return started, exc
    for thread in threads:
        try:
            thread.start()
        except RuntimeError as exc:  # "can't start new thread"
            log.error("could not start thread %s (%s); stopping", thread.name, one_line(exc))
            return started, exc
        started.append(thread)
    return started, None


def _every(text: str) -> float:
    try:
        return check.every_seconds(positive_float(text))
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _concurrency(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= value <= check.MAX_CONCURRENCY:
        raise argparse.ArgumentTypeError(
            f"must be from 1 to {check.MAX_CONCURRENCY} (threads of one process; run more "
            f"worker processes for more): {text!r}"
        )
    return value


def _listen_options(args: argparse.Namespace, dsn: str) -> dict[str, Any]:
    """Where wake-ups are listened for. LISTEN needs a server session that stays put, which a
    transaction pooler does not give: with --no-prepare (the pooler switch) the main DSN is not
    used for it, only an explicit --listen-dsn."""
    if args.no_listen:
        return {"listen_dsn": None}
    if args.listen_dsn is None and no_prepare(args):
        log.warning(
            "no --listen-dsn while --dsn goes through a pooler (--no-prepare): this worker finds "
            "new runs by polling only"
        )
        return {"listen_dsn": None}
    return {"listen_dsn": args.listen_dsn or dsn}


def cmd_reconcile(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    otel = otel_from_env(args, "agent-runs-reconcile")
    try:
        return _reconcile(args, None if otel is None else otel.telemetry)
    finally:
        if otel is not None:
            otel.shutdown()


def _reconcile(args: argparse.Namespace, telemetry: Telemetry | None) -> int:
    if args.every is None:
        with open_connection(args) as conn:
            total = _reconcile_all(AgentRunRepository(conn, telemetry=telemetry))
        print(f"reconciled {total} run(s)")
        return 0

    dsn = resolve_dsn(args.dsn)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    pool = worker_pool(args, dsn, max_size=1)
    backoff = Backoff()
    log.info("reconciler: every %.1fs", args.every)
    try:
        while not stop.is_set():
            try:
                with pool.connection(timeout=CONNECT_TIMEOUT_SECONDS) as conn:
                    _reconcile_all(AgentRunRepository(conn, telemetry=telemetry))
            except DB_ERRORS as exc:
                delay = backoff.next_delay()
                log.warning("reconcile failed (%s); retrying in %.1fs", one_line(exc), delay)
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


def load_agent(spec: str) -> Agent:
    """`scripted`, or `module:callable` (a class is instantiated with no arguments)."""
    if spec == "scripted":
        from agent_runs.devtools.scripted import ScriptedAgent

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
    except Exception as exc:  # an agent module that fails to import is bad input, not a crash
        raise UsageError(f"--agent {spec}: {one_line(exc)}") from None
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


def worker_pool(args: argparse.Namespace, dsn: str, *, max_size: int) -> ConnectionPool:
    """The worker process's pool. open() does not wait: a worker started before its database
    keeps retrying instead of dying. No check per checkout (a round trip before every claim,
    renewal and completion, and before an idle worker's first claim after a wake-up): the worker
    retries a failed call with back-off on a fresh connection, and the pool drops the broken one
    when it comes back."""
    return create_pool(
        dsn,
        min_size=1,
        max_size=max_size,
        kwargs=connect_options(args),
        name="agent-runs",
        check=None,
    )
