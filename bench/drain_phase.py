"""Drain rate: one idle `agent-runs worker` process (16 threads, a no-op agent) and a burst,
beside PgQueuer and Procrastinate on the same server in the same run.

Each queue has its own database on the bench server, its schema installed by its own tool:
- agent-runs: `agent-runs worker --concurrency 16` with a no-op agent, once per completion
  mode when the CLI has `--completion` (durable, the default, and async);
- PgQueuer: `pgq run` with `--batch-size 16` (its fetch batching), the asyncpg driver and a
  no-op entrypoint (bench.drain_pgqueuer);
- Procrastinate: `procrastinate worker --concurrency 16` with a no-op async task
  (bench.drain_procrastinate).

The queues take turns, the order rotating with each repetition. In its turn a queue's worker
process is started, waits until it LISTENs, and settles (idle and ready); then all the jobs are
enqueued at once, in one transaction (agent-runs: INSERT … generate_series, which sends no
wake-ups, then one notification per claimer thread; the others through their own bulk
enqueue, whose commit notifies their worker). The drain time runs on the database clock from
that commit to the completion time the queue records for its last job (agent-runs: the run's
`finished_at`; PgQueuer: its log row's `created`; Procrastinate: its `succeeded` event's `at`);
it is also polled every 50 ms. Then the worker is stopped by its PID. Median of the
repetitions. PgQueuer and Procrastinate come with `pip install 'agent_runs[compare]'` (`make
bench` installs them); where they are not installed they are left out, with the reason.
"""

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
from agent_runs import AgentRun
from agent_runs.worker import AgentResult, RunContext
from bench import cpu, seed
from bench.report import fmt, median, table

CONCURRENCY: Final = 16
PGQUEUER_BATCH: Final = 16
POLL_SECONDS: Final = 0.05
ROOT: Final = Path(__file__).resolve().parent.parent
OTHERS: Final = ("pgqueuer", "procrastinate")
LABELS: Final = {
    "agent_runs": "agent-runs worker",
    "agent_runs_durable": "agent-runs worker, durable",
    "agent_runs_async": "agent-runs worker, async",
    "pgqueuer": "PgQueuer",
    "procrastinate": "Procrastinate",
}


@dataclass(frozen=True)
class _Sizes:
    runs: int
    reps: int
    settle: float  # seconds between LISTEN in force and the burst


FULL: Final = _Sizes(runs=3_000, reps=3, settle=1.0)
QUICK: Final = _Sizes(runs=200, reps=1, settle=0.3)

Conn = psycopg.Connection[Any]


def noop(run: AgentRun, ctx: RunContext) -> AgentResult:
    """The drain's agent: does nothing and completes."""
    return AgentResult.completed()


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


def run_phase(url: str, quick: bool) -> dict[str, Any]:
    """Measure on `url`, a fresh migrated database this phase may fill (postgresql:// URL); the
    other queues get databases of their own beside it, dropped afterwards."""
    sizes = QUICK if quick else FULL
    queues: list[Queue] = []
    skipped: dict[str, str] = {}
    siblings: list[str] = []
    modes = completion_modes()
    for mode in modes:
        queues.append(_agent_runs_queue(url, mode))
    try:
        for name in OTHERS:
            if importlib.util.find_spec(name) is None:
                skipped[name] = "not installed (pip install 'agent_runs[compare]')"
                continue
            try:
                sibling = _sibling_database(url, name)
                siblings.append(sibling)
                queues.append(_other_queue(name, sibling))
            except Exception as exc:  # another queue failing to set up keeps ours
                skipped[name] = f"not measured: {type(exc).__name__}: {exc}"
        for rep in range(sizes.reps):
            shift = rep % len(queues)
            for queue in queues[shift:] + queues[:shift]:
                if queue.key in skipped:
                    continue
                try:
                    queue.repetitions.append(_turn(queue, sizes))
                except Exception as exc:
                    if queue.key not in OTHERS:
                        raise
                    skipped[queue.key] = f"failed: {type(exc).__name__}: {exc}"
        queues = [q for q in queues if q.key not in skipped]
    finally:
        for sibling in siblings:
            _drop_database(url, sibling)
    return _summary(queues, skipped, sizes, modes)


def completion_modes() -> tuple[str | None, ...]:
    """The worker's `--completion` modes when its CLI has the option, else the default only."""
    out = subprocess.run(
        [sys.executable, "-m", "agent_runs", "worker", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    ).stdout
    return ("durable", "async") if "--completion" in out else (None,)


def _summary(
    queues: list[Queue], skipped: dict[str, str], sizes: _Sizes, modes: tuple[str | None, ...]
) -> dict[str, Any]:
    measured: dict[str, dict[str, Any]] = {
        q.key: {
            "label": LABELS[q.key],
            "settings": q.settings,
            "runs_per_second": median([r["runs_per_second"] for r in q.repetitions]),
            "polled_runs_per_second": median([r["polled_runs_per_second"] for r in q.repetitions]),
            "server_cpu_us_per_job": _median_known(q.repetitions, "server_cpu_us_per_job"),
            "worker_cpu_us_per_job": _median_known(q.repetitions, "worker_cpu_us_per_job"),
            "repetitions": q.repetitions,
        }
        for q in queues
    }
    ours_key = "agent_runs_durable" if modes[0] else "agent_runs"
    ours = measured[ours_key]
    nan = float("nan")
    pgqueuer = measured.get("pgqueuer", {"runs_per_second": nan, "repetitions": []})
    ratios: dict[str, float] = {}
    per_repetition: dict[str, list[float]] = {}
    for key, name in (
        ("durable_over_pgqueuer", ours_key),
        ("async_over_pgqueuer", "agent_runs_async"),
    ):
        if name in measured:
            ratios[key] = measured[name]["runs_per_second"] / pgqueuer["runs_per_second"]
            per_repetition[key] = [  # within a repetition the queues ran back to back
                a["runs_per_second"] / b["runs_per_second"]
                for a, b in zip(
                    measured[name]["repetitions"], pgqueuer["repetitions"], strict=False
                )
            ]
    return {
        "runs": sizes.runs,
        "concurrency": CONCURRENCY,
        "pgqueuer_batch_size": PGQUEUER_BATCH,
        "completion_modes": [m or "default" for m in modes],
        "queues": measured,
        "skipped": skipped,
        "ratios": ratios,
        "ratios_per_repetition": per_repetition,
        # the durable worker's, as reported before the other queues were measured
        "runs_per_second": ours["runs_per_second"],
        "polled_runs_per_second": ours["polled_runs_per_second"],
        "repetitions": ours["repetitions"],
    }


def _median_known(repetitions: list[dict[str, Any]], key: str) -> float | None:
    known = [r[key] for r in repetitions if r.get(key) is not None]
    return median(known) if known else None


def render_phase(result: dict[str, Any]) -> list[str]:
    """The phase's lines for the bench report."""
    queues = result.get("queues")
    if queues is None:  # a result written before the other queues were measured
        queues = {"agent_runs": {**result, "label": LABELS["agent_runs"], "settings": ""}}
    rows = [
        [
            q["label"],
            fmt(q["runs_per_second"]),
            fmt(q["polled_runs_per_second"]),
            _us(q.get("server_cpu_us_per_job")),
            _us(q.get("worker_cpu_us_per_job")),
            ", ".join(fmt(r["runs_per_second"]) for r in q["repetitions"]),
            q["settings"],
        ]
        for q in queues.values()
    ]
    skipped = result.get("skipped", {}).items()
    rows += [[LABELS[name], "-", "-", "-", "-", "", why] for name, why in skipped]
    ratios = result.get("ratios", {})
    reps = max(len(q["repetitions"]) for q in queues.values())
    lines = [
        f"Drain: one idle worker process per queue, {result['runs']:,} jobs enqueued at once, "
        f"queues in turns (median of {reps}):",
        table(
            [
                "queue",
                "jobs/s (db clock)",
                "jobs/s (polled)",
                "server CPU µs/job",
                "worker CPU µs/job",
                "repetitions",
                "settings",
            ],
            rows,
        ),
        "  CPU per job: /proc of the worker process, and of its connections' backends (not of the"
        " enqueue, nor of this phase's own observing connection); '-' where not readable",
    ]
    for key, label in (
        ("durable_over_pgqueuer", "agent-runs (durable) ÷ PgQueuer"),
        ("async_over_pgqueuer", "agent-runs (async) ÷ PgQueuer"),
    ):
        if key in ratios:
            each = result.get("ratios_per_repetition", {}).get(key, [])
            by_rep = f" (by repetition: {', '.join(fmt(r, 'x') for r in each)})" if each else ""
            lines.append(f"  {label}: {fmt(ratios[key], 'x')}{by_rep}")
    pgqueuer_cpu = queues.get("pgqueuer", {}).get("server_cpu_us_per_job")
    for key, label in (
        ("agent_runs_durable", "agent-runs (durable)"),
        ("agent_runs_async", "agent-runs (async)"),
    ):
        ours_cpu = queues.get(key, {}).get("server_cpu_us_per_job")
        if ours_cpu and pgqueuer_cpu:
            lines.append(
                f"  server CPU per job, {label} ÷ PgQueuer: {fmt(ours_cpu / pgqueuer_cpu, 'x')}"
            )
    return lines


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


# -- the queues -----------------------------------------------------------------------------


def _agent_runs_queue(url: str, mode: str | None) -> Queue:
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
        ready_sql=_LISTENING,
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


def _other_queue(name: str, url: str) -> Queue:
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
        ready_sql=_CONNECTED if name == "pgqueuer" else _LISTENING,
    )


def _sibling_database(url: str, name: str) -> str:
    """A new empty database beside `url`'s, for another queue; returns its URL."""
    with agent_runs.connect(url) as conn:
        row = conn.execute("SELECT current_database()").fetchone()
        assert row is not None
        database = f"{row[0]}_{name}"
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + quote(database, safe="")))


def _drop_database(url: str, sibling: str) -> None:
    database = urlsplit(sibling).path.lstrip("/")
    with contextlib.suppress(psycopg.Error), agent_runs.connect(url) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
        )


# -- one turn ---------------------------------------------------------------------------------


def _env(extra: dict[str, str]) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **extra}


def _turn(queue: Queue, sizes: _Sizes) -> dict[str, Any]:
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
_LISTENING: Final[LiteralString] = (
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
