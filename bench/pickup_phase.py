"""Pickup latency and idle load: how fast idle `agent-runs worker` processes start a new run,
and what an idle worker process costs the server.

Latency ends at the first attempt's `started_at` (now() of the claiming transaction, the
server's clock) and starts when create_run's commit was acknowledged (this host's clock, which a
server on this host shares); the same from the run's `created_at` (the start of create_run's
transaction, so it also counts create_run's own statement and commit) is reported beside it,
and is the one used for a server elsewhere. Runs are created one at a time at random 80-250 ms
gaps, first with every worker idle, then with half of the worker threads busy on long `sleep:`
runs. Idle load is the server's committed + rolled-back transactions per second on the
database while only one idle worker process is connected, minus this phase's own probe.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, LiteralString

import psycopg
from psycopg.conninfo import conninfo_to_dict

import agent_runs
from agent_runs import AgentRunRepository
from bench.relay import RoundTripCounter
from bench.report import fmt, median, percentile, table

SLUG: Final = "bench-pickup"
CONCURRENCY: Final = 2
GAP_SECONDS: Final = (0.080, 0.250)
SEED: Final = 15


@dataclass(frozen=True)
class _Sizes:
    workers: int
    runs: int  # per latency sample
    idle_seconds: float  # idle-load window
    settle_seconds: float  # before it: PostgreSQL's idle statistics flush takes up to 10 s


FULL: Final = _Sizes(workers=2, runs=120, idle_seconds=20.0, settle_seconds=11.0)
QUICK: Final = _Sizes(workers=1, runs=15, idle_seconds=3.0, settle_seconds=1.0)


def run_phase(url: str, quick: bool) -> dict[str, Any]:
    """Measure on `url`, a fresh migrated database this phase may fill (postgresql:// URL)."""
    sizes = QUICK if quick else FULL
    rng = random.Random(SEED)
    result: dict[str, Any] = {
        "workers": sizes.workers,
        "concurrency": CONCURRENCY,
        "runs_per_sample": sizes.runs,
        "gap_ms": [GAP_SECONDS[0] * 1000, GAP_SECONDS[1] * 1000],
        "seed": SEED,
    }
    with agent_runs.connect(url) as conn:
        repo = AgentRunRepository(conn)
        with _workers(url, sizes.workers, "pickup") as names:
            _warm_up(repo, conn, names)
            local = _local(url)
            _samples(result, "idle", local, _pickup(repo, conn, rng, sizes.runs))
            # Half of the worker threads busy for the whole sample, the rest idle.
            busy = sizes.workers * CONCURRENCY // 2
            sleep_for = sizes.runs * sum(GAP_SECONDS) / 2 + 30
            sleepers = [_create(repo, [f"sleep:{sleep_for:.0f}"]) for _ in range(busy)]
            _await_started(conn, sleepers)
            _samples(result, "half_busy", local, _pickup(repo, conn, rng, sizes.runs))
            result["half_busy"]["busy_threads"] = busy
        # Stopped workers released the sleepers for retry: finish them, so nothing is left
        # to claim while the idle load is measured.
        for run_id in sleepers:
            repo.set_terminal_status(run_id, status="cancelled")
        _await_finished(conn, sleepers)
        # Only the idle worker's sessions remain on the database (tables vacuumed first, so
        # autovacuum has no reason to visit during the window).
        conn.execute("VACUUM (ANALYZE) agent_runs, agent_run_attempts")
        with (
            RoundTripCounter(url) as counter,
            _workers(counter.url, 1, "idle-load") as names,
        ):
            _warm_up(repo, conn, names)
            # Statistics still pending from before the window must not land in it: ours are
            # flushed now; an idle backend flushes its own within 10 s.
            conn.execute("SELECT pg_stat_force_next_flush()")
            time.sleep(sizes.settle_seconds)
            before = counter.count
            load = _idle_load(url, sizes.idle_seconds)
            load["round_trips"] = counter.count - before
            load["round_trips_per_s"] = load["round_trips"] / load["seconds"]
            result["idle_load"] = load
    return result


def render_phase(result: dict[str, Any]) -> list[str]:
    """The phase's lines for the bench report."""
    rows = []
    for key, label in (
        ("idle", "workers idle"),
        ("half_busy", "workers half busy"),
        ("idle_from_created_at", "idle, from created_at"),
        ("half_busy_from_created_at", "half busy, from created_at"),
    ):
        s = result[key]
        rows.append(
            [
                label,
                str(s["count"]),
                fmt(s["p50_ms"], " ms"),
                fmt(s["p90_ms"], " ms"),
                fmt(s["p99_ms"], " ms"),
                fmt(s["mean_ms"], " ms"),
                fmt(s["max_ms"], " ms"),
            ]
        )
    load = result["idle_load"]
    return [
        "Pickup latency, "
        + (
            "create_run's commit (acknowledged) -> attempt started_at, one host clock, "
            if result["idle"]["from"] == "commit"
            else "create_run's created_at -> attempt started_at (database clock), "
        )
        + f"{result['workers']} idle worker process(es) x {result['concurrency']} threads, runs "
        f"one at a time at {result['gap_ms'][0]:.0f}-{result['gap_ms'][1]:.0f} ms gaps:",
        table(["workers", "runs", "p50", "p90", "p99", "mean", "max"], rows),
        f"Idle load of one idle worker process over {load['seconds']:.1f} s: "
        f"{load['round_trips_per_s']:.2f} round trips/s on its connections (each one "
        f"transaction: {load['round_trips']} counted on the wire); the server's xact_commit "
        f"counter: {load['tx_per_s']:.2f}/s ({load['transactions']}, probe excluded)",
    ]


# -- worker processes ---------------------------------------------------------------------


@contextlib.contextmanager
def _workers(url: str, count: int, label: str) -> Iterator[list[str]]:
    """`count` `agent-runs worker` processes, stopped (SIGTERM, then SIGKILL) on exit."""
    tag = uuid.uuid4().hex[:6]
    names = [f"bench-{label}-{tag}-{i}" for i in range(count)]
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryFile() as logs:
        try:
            for name in names:
                command = [sys.executable, "-m", "agent_runs", "worker", "--dsn", url]
                command += ["--concurrency", str(CONCURRENCY), "--agent", "scripted"]
                command += ["--name", name, "--log-level", "WARNING"]
                procs.append(
                    subprocess.Popen(
                        command,
                        stdout=logs,
                        stderr=logs,
                        stdin=subprocess.DEVNULL,
                        env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    )
                )
            yield names
        except BaseException:
            _stop(procs)
            logs.seek(0)
            tail = logs.read()[-2000:].decode("utf-8", "replace")
            if tail:
                print(f"worker output (last 2000 bytes):\n{tail}", file=sys.stderr)
            raise
        _stop(procs)


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _warm_up(repo: AgentRunRepository, conn: psycopg.Connection[Any], names: Sequence[str]) -> None:
    """Create runs until every worker process has claimed one and all are done, so each is
    connected, warm and back in its idle wait."""
    created: list[str] = []
    deadline = time.monotonic() + 60
    while True:
        created.append(_create(repo, ["ok"]))
        _await_started(conn, created[-1:])
        seen = _claimers(conn, created)
        if all(name in seen for name in names):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers never claimed a run: saw {sorted(seen)}")
    _await_finished(conn, created)
    time.sleep(1.0)


def _claimers(conn: psycopg.Connection[Any], run_ids: Sequence[str]) -> set[str]:
    rows = conn.execute(
        "SELECT DISTINCT split_part(worker_id, ':', 1) FROM agent_run_attempts"
        " WHERE run_id = ANY(%s)",
        (list(run_ids),),
    ).fetchall()
    return {str(row[0]) for row in rows}


# -- measurements ---------------------------------------------------------------------------


def _create(repo: AgentRunRepository, script: list[str]) -> str:
    key = uuid.uuid4().hex
    run = repo.create_run(
        thread_id=f"pickup-{key}",
        agent_slug=SLUG,
        uid="bench",
        request_id=f"pickup-{key}",
        input_payload={"script": script},
    )
    return run.id


def _pickup(
    repo: AgentRunRepository, conn: psycopg.Connection[Any], rng: random.Random, runs: int
) -> tuple[list[float], list[float]]:
    """Pickup latencies (ms) of `runs` runs created one at a time at random gaps: from the
    moment create_run returned (its commit acknowledged; the host's clock, which a server on
    this host shares) and from the run's created_at (its transaction's start, so this one
    also counts create_run's own statement and commit)."""
    created: dict[str, float] = {}
    for _ in range(runs):
        time.sleep(rng.uniform(*GAP_SECONDS))
        run_id = _create(repo, ["ok"])
        created[run_id] = time.time()
    _await_started(conn, list(created))
    rows = conn.execute(
        "SELECT r.id, extract(epoch FROM a.started_at),"
        " extract(epoch FROM a.started_at - r.created_at) * 1000"
        " FROM agent_runs r JOIN agent_run_attempts a ON a.run_id = r.id AND a.attempt_no = 1"
        " WHERE r.id = ANY(%s)",
        (list(created),),
    ).fetchall()
    from_commit = [(float(started) - created[run_id]) * 1000 for run_id, started, _ in rows]
    return from_commit, [float(row[2]) for row in rows]


def _local(url: str) -> bool:
    """Whether the server runs on this host (then its clock is this host's clock)."""
    host = conninfo_to_dict(url).get("host")
    return host is None or str(host).startswith("/") or host in ("127.0.0.1", "localhost", "::1")


def _samples(
    result: dict[str, Any], key: str, local: bool, samples: tuple[list[float], list[float]]
) -> None:
    from_commit, from_created = samples
    result[key] = _summary(from_commit if local else from_created)
    result[key]["from"] = "commit" if local else "created_at"
    result[f"{key}_from_created_at"] = _summary(from_created)


_UNSTARTED: Final = "SELECT count(*) FROM agent_runs WHERE id = ANY(%s) AND started_at IS NULL"
_UNFINISHED: Final = "SELECT count(*) FROM agent_runs WHERE id = ANY(%s) AND finished_at IS NULL"


def _await_started(conn: psycopg.Connection[Any], run_ids: Sequence[str]) -> None:
    _await(conn, run_ids, _UNSTARTED, "started")


def _await_finished(conn: psycopg.Connection[Any], run_ids: Sequence[str]) -> None:
    _await(conn, run_ids, _UNFINISHED, "finished")


def _await(
    conn: psycopg.Connection[Any], run_ids: Sequence[str], query: LiteralString, what: str
) -> None:
    deadline = time.monotonic() + 60
    while True:
        row = conn.execute(query, (list(run_ids),)).fetchone()
        left = int(row[0]) if row else len(run_ids)
        if not left:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{left} of {len(run_ids)} runs not {what} after 60 s")
        time.sleep(0.05)


def _summary(latencies_ms: Sequence[float]) -> dict[str, Any]:
    return {
        "count": len(latencies_ms),
        "p50_ms": median(latencies_ms),
        "p90_ms": percentile(latencies_ms, 90),
        "p99_ms": percentile(latencies_ms, 99),
        "mean_ms": sum(latencies_ms) / len(latencies_ms),
        "max_ms": max(latencies_ms),
    }


# A probe that also flushes its own statistics at once (PostgreSQL 15+): the end reading then
# counts exactly one probe transaction, the start reading itself.
_PROBE: Final = (
    "SELECT xact_commit + xact_rollback, pg_stat_force_next_flush()"
    " FROM pg_stat_database WHERE datname = current_database()"
)


def _idle_load(url: str, seconds: float) -> dict[str, Any]:
    """Transactions per second on the database over `seconds`, minus the probe's own one.

    Backends flush their statistics at most once a second while active, so each end of the
    window is uncertain by about one second's worth of the idle worker's transactions. On
    PostgreSQL 15 a transaction that reads no table (a bare `SELECT 1`) is counted only when
    its backend next flushes table statistics: claims and reconciles read tables, so the
    worker's polling is counted in full."""
    with psycopg.connect(url, autocommit=True) as probe:
        start_row = probe.execute(_PROBE).fetchone()
        started = time.monotonic()
        time.sleep(seconds)
        end_row = probe.execute(_PROBE).fetchone()
        elapsed = time.monotonic() - started
    assert start_row is not None and end_row is not None
    transactions = int(end_row[0]) - int(start_row[0]) - 1
    return {
        "seconds": elapsed,
        "transactions": transactions,
        "tx_per_s": transactions / elapsed,
    }
