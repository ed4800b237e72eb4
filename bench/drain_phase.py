"""Drain rate: one idle `agent-runs worker` process (16 threads, a no-op agent) and a burst.

The worker is started, waits until its wake-up listener has LISTEN in force, and settles. Then
a batch of pending runs is inserted in one transaction (INSERT … generate_series, which sends
no wake-ups of its own) and the idle claimer threads are woken with one notification each (a
notification wakes exactly one idle claimer). The drain time runs on the database clock from
that notification to the last run's `finished_at`; it is also polled every 50 ms. PgQueuer and
Procrastinate are measured beside it only when importable here (never installed by the bench).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import psycopg

import agent_runs
from agent_runs import AgentRun
from agent_runs.worker import AgentResult, RunContext
from bench import seed
from bench.report import fmt, median, table

CONCURRENCY: Final = 16
POLL_SECONDS: Final = 0.05
ROOT: Final = Path(__file__).resolve().parent.parent
OTHERS: Final = ("pgqueuer", "procrastinate")


@dataclass(frozen=True)
class _Sizes:
    runs: int
    reps: int


FULL: Final = _Sizes(runs=3_000, reps=3)
QUICK: Final = _Sizes(runs=200, reps=1)


def noop(run: AgentRun, ctx: RunContext) -> AgentResult:
    """The drain's agent: does nothing and completes."""
    return AgentResult.completed()


def run_phase(url: str, quick: bool) -> dict[str, Any]:
    """Measure on `url`, a fresh migrated database this phase may fill (postgresql:// URL)."""
    sizes = QUICK if quick else FULL
    reps: list[dict[str, Any]] = []
    with agent_runs.connect(url) as conn, _worker(url):
        _await_listening(conn)
        time.sleep(1.0)  # every claimer thread past its first empty claim, idle
        for _ in range(sizes.reps):
            reps.append(_drain(conn, sizes.runs))
    rates = [r["runs_per_second"] for r in reps]
    return {
        "runs": sizes.runs,
        "concurrency": CONCURRENCY,
        "repetitions": reps,
        "runs_per_second": median(rates),
        "polled_runs_per_second": median([r["polled_runs_per_second"] for r in reps]),
        "others": {
            name: "installed, not measured by this bench"
            if importlib.util.find_spec(name)
            else "not installed"
            for name in OTHERS
        },
    }


def render_phase(result: dict[str, Any]) -> list[str]:
    """The phase's lines for the bench report."""
    rows = [
        [
            "agent-runs worker",
            fmt(result["runs_per_second"]),
            fmt(result["polled_runs_per_second"]),
            ", ".join(fmt(r["runs_per_second"]) for r in result["repetitions"]),
        ]
    ]
    rows += [[name, state, "", ""] for name, state in result["others"].items()]
    return [
        f"Drain: one idle worker process × {result['concurrency']} threads, no-op agent, "
        f"{result['runs']:,} runs inserted at once (median of {len(result['repetitions'])}):",
        table(["queue", "runs/s (db clock)", "runs/s (polled)", "repetitions"], rows),
    ]


# -- the worker process ---------------------------------------------------------------------


@contextmanager
def _worker(url: str) -> Iterator[subprocess.Popen[bytes]]:
    """One `agent-runs worker` process, stopped by its PID (SIGTERM, then SIGKILL) on exit."""
    command = [sys.executable, "-m", "agent_runs", "worker", "--dsn", url]
    command += ["--concurrency", str(CONCURRENCY), "--agent", "bench.drain_phase:noop"]
    command += ["--lease-seconds", "60", "--log-level", "WARNING"]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryFile() as logs:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=logs,
            stderr=logs,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path},
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


def _await_listening(conn: psycopg.Connection[Any]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND query = 'LISTEN agent_runs_claimable'"
        ).fetchone()
        if row and int(row[0]):
            return
        time.sleep(POLL_SECONDS)
    raise RuntimeError("the worker never listened for wake-ups within 30 s")


# -- one burst ------------------------------------------------------------------------------


def _drain(conn: psycopg.Connection[Any], runs: int) -> dict[str, Any]:
    before = _count(conn, "completed")
    seed.seed_pending([conn], runs)  # one statement, autocommit: one transaction
    row = conn.execute(
        "SELECT clock_timestamp(), count(pg_notify('agent_runs_claimable', 'drain-' || i))"
        " FROM generate_series(1, %s) AS i",
        (CONCURRENCY,),
    ).fetchone()
    started = time.perf_counter()
    assert row is not None
    woken_at = row[0]
    deadline = started + max(60.0, runs / 20)
    while (done := _count(conn, "completed") - before) < runs:
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{done} of {runs} runs completed after {deadline - started:.0f} s")
        time.sleep(POLL_SECONDS)
    polled = time.perf_counter() - started
    other = conn.execute("SELECT count(*) FROM agent_runs WHERE status <> 'completed'").fetchone()
    if other and int(other[0]):
        raise RuntimeError(f"{other[0]} runs ended otherwise than completed")
    last = conn.execute(
        "SELECT extract(epoch FROM max(finished_at) - %s::timestamptz) FROM agent_runs",
        (woken_at,),
    ).fetchone()
    seconds = float(last[0]) if last and last[0] is not None else polled
    return {
        "seconds": seconds,
        "runs_per_second": runs / seconds,
        "polled_seconds": polled,
        "polled_runs_per_second": runs / polled,
    }


def _count(conn: psycopg.Connection[Any], status: str) -> int:
    row = conn.execute("SELECT count(*) FROM agent_runs WHERE status = %s", (status,)).fetchone()
    return int(row[0]) if row else 0
