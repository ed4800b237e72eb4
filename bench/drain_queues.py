"""The drain's queues and one queue's turn: its database, worker process, burst and drain time
(bench/drain_phase.py runs the turns and reports them)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, LiteralString
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
from psycopg import sql

import agent_runs
from bench import cpu, seed

CONCURRENCY: Final = 16
PGQUEUER_BATCH: Final = 16
POLL_SECONDS: Final = 0.05
ROOT: Final = Path(__file__).resolve().parent.parent

Conn = psycopg.Connection[Any]


@dataclass(frozen=True)
class Sizes:
    """How many jobs per burst, how many repetitions, how long a worker settles first."""

    runs: int
    reps: int
    settle: float  # seconds between LISTEN in force and the burst


@dataclass
class Queue:
    """One contestant: its database, its worker command, and how to enqueue and read it."""

    key: str
    url: str
    command: list[str]
    env: dict[str, str]
    enqueue: Callable[[Conn, int], Any]  # enqueues, returns the database time of the commit
    done_sql: LiteralString
    last_done_sql: LiteralString
    settings: str
    check_sql: LiteralString | None = None  # counts jobs that ended otherwise than done
    ready_sql: LiteralString = ""  # counts the worker's backends that show it ready
    repetitions: list[dict[str, Any]] = field(default_factory=list)


# -- the queues -----------------------------------------------------------------------------


def agent_runs_queue(url: str, mode: str | None) -> Queue:
    command = [sys.executable, "-m", "agent_runs", "worker", "--dsn", url]
    command += ["--concurrency", str(CONCURRENCY), "--agent", "bench.drain_phase:noop"]
    command += ["--lease-seconds", "60", "--log-level", "WARNING"]
    if mode is not None:
        command += ["--completion", mode]
    settings = f"--concurrency {CONCURRENCY}" + (f" --completion {mode}" if mode else "")
    return Queue(
        key=f"agent_runs_{mode}" if mode else "agent_runs",
        url=url,
        command=command,
        env={},
        enqueue=_enqueue_runs,
        done_sql="SELECT count(*) FROM agent_runs WHERE status = 'completed'",
        last_done_sql="SELECT max(finished_at) FROM agent_runs",
        settings=settings,
        check_sql="SELECT count(*) FROM agent_runs WHERE status <> 'completed'",
        ready_sql=LISTENING,
    )


def _enqueue_runs(conn: Conn, runs: int) -> Any:
    seed.seed_pending([conn], runs)  # one statement, autocommit: one transaction
    row = conn.execute(
        "SELECT clock_timestamp(), count(pg_notify('agent_runs_claimable', 'drain-' || i))"
        " FROM generate_series(1, %s) AS i",
        (CONCURRENCY,),
    ).fetchone()
    assert row is not None
    return row[0]


def other_queue(name: str, url: str) -> Queue:
    module = importlib.import_module(f"bench.drain_{name}")
    command, env = module.install_command(url)
    done = subprocess.run(
        command, env=_env(env), cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"schema install failed: {(done.stderr or done.stdout)[-500:]}")
    if name == "pgqueuer":
        command, env = module.worker_command(url, PGQUEUER_BATCH)
        settings = f"pgq run --batch-size {PGQUEUER_BATCH}, asyncpg"
    else:
        command, env = module.worker_command(url, CONCURRENCY)
        settings = f"worker --concurrency {CONCURRENCY}, psycopg pool defaults"

    def enqueue(conn: Conn, count: int) -> Any:
        module.enqueue(url, count)
        row = conn.execute("SELECT clock_timestamp()").fetchone()  # just after the commit
        assert row is not None
        return row[0]

    return Queue(
        key=name,
        url=url,
        command=command,
        env=env,
        enqueue=enqueue,
        done_sql=module.DONE_SQL,
        last_done_sql=module.LAST_DONE_SQL,
        settings=settings,
        ready_sql=_CONNECTED if name == "pgqueuer" else LISTENING,
    )


def sibling_database(url: str, name: str) -> str:
    """A new empty database beside `url`'s, for another queue; returns its URL."""
    with agent_runs.connect(url) as conn:
        row = conn.execute("SELECT current_database()").fetchone()
        assert row is not None
        database = f"{row[0]}_{name}"
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + quote(database, safe="")))


def drop_database(url: str, sibling: str) -> None:
    database = urlsplit(sibling).path.lstrip("/")
    with contextlib.suppress(psycopg.Error), agent_runs.connect(url) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
        )


# -- one turn ---------------------------------------------------------------------------------


def _env(extra: dict[str, str]) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **extra}


def turn(queue: Queue, sizes: Sizes) -> dict[str, Any]:
    with agent_runs.connect(queue.url) as conn, _process(queue.command, queue.env) as worker:
        _await_ready(conn, queue.ready_sql)
        time.sleep(sizes.settle)  # past its first empty fetch: idle and ready
        before = _cpu(conn, worker.pid)
        drained = _drain(conn, queue, sizes.runs)
        return {**drained, **_cpu_per_job(before, _cpu(conn, worker.pid), sizes.runs)}


@contextlib.contextmanager
def _process(command: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """One worker process, stopped by its PID (SIGTERM, then SIGKILL) on exit."""
    with tempfile.TemporaryFile() as logs:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=logs,
            stderr=logs,
            stdin=subprocess.DEVNULL,
            env=_env(env),
        )
        try:
            yield proc
        except BaseException:
            logs.seek(0)
            tail = logs.read()[-2000:].decode("utf-8", "replace")
            if tail:
                print(f"worker output (last 2000 bytes):\n{tail}", file=sys.stderr)
            raise
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# Ready: a backend of the worker has LISTEN in force (its last statement). PgQueuer listens and
# queries on one connection, so there: its backend is connected and idle.
LISTENING: Final[LiteralString] = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
    " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
    " AND query ILIKE 'LISTEN %'"
)
_CONNECTED: Final[LiteralString] = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
    " AND backend_type = 'client backend' AND pid <> pg_backend_pid() AND state = 'idle'"
)


def _await_ready(conn: Conn, ready_sql: LiteralString) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if int(_scalar(conn, ready_sql)):
            return
        time.sleep(POLL_SECONDS)
    raise RuntimeError("the worker was not ready (listening) within 30 s")


@dataclass(frozen=True)
class _Cpu:
    """Clock ticks of the worker process and of its backends (by PID); None where unreadable."""

    worker: int | None
    backends: dict[int, int] | None


def _cpu(conn: Conn, worker_pid: int) -> _Cpu:
    return _Cpu(cpu.process_ticks(worker_pid), cpu.database_backend_ticks(conn))


def _cpu_per_job(before: _Cpu, after: _Cpu, jobs: int) -> dict[str, float | None]:
    """CPU µs per job of the worker process and of the database's other backends (the worker's
    connections: this phase's own observing one is left out; a backend that connected during
    the drain counts whole)."""

    def per_job(ticks: int) -> float:
        return ticks / cpu.TICKS_PER_SECOND * 1e6 / jobs

    server = None
    if before.backends is not None and after.backends is not None:
        server = per_job(sum(t - before.backends.get(pid, 0) for pid, t in after.backends.items()))
    worker = None
    if before.worker is not None and after.worker is not None:
        worker = per_job(after.worker - before.worker)
    return {"server_cpu_us_per_job": server, "worker_cpu_us_per_job": worker}


def _scalar(conn: Conn, query: LiteralString) -> Any:
    row = conn.execute(query).fetchone()
    return None if row is None else row[0]


def _drain(conn: Conn, queue: Queue, runs: int) -> dict[str, Any]:
    before = int(_scalar(conn, queue.done_sql))
    woken_at = queue.enqueue(conn, runs)
    started = time.perf_counter()
    deadline = started + max(60.0, runs / 20)
    while (done := int(_scalar(conn, queue.done_sql)) - before) < runs:
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{done} of {runs} jobs done after {deadline - started:.0f} s")
        time.sleep(POLL_SECONDS)
    polled = time.perf_counter() - started
    if queue.check_sql is not None and int(_scalar(conn, queue.check_sql)):
        raise RuntimeError(f"{queue.key}: jobs ended otherwise than done")
    row = conn.execute(
        "SELECT extract(epoch FROM %s::timestamptz - %s::timestamptz)",
        (_scalar(conn, queue.last_done_sql), woken_at),
    ).fetchone()
    seconds = float(row[0]) if row and row[0] is not None else polled
    return {
        "seconds": seconds,
        "runs_per_second": runs / seconds,
        "polled_seconds": polled,
        "polled_runs_per_second": runs / polled,
    }
