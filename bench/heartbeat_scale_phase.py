"""Heartbeats at scale: many live leases renewed through renew_leases, and what one server carries.

Live leases are inserted directly as running runs with their open attempts. Two crews of four
threads, each thread on its own connection, renew the same shares of those leases back to back
(time compressed: a worker renews each lease once per heartbeat interval, here every renewal
follows the last at once): one crew with one renew_lease per lease, the other with renew_leases
in batches of 100. The crews take turns in short slices, so that both see the same machine (its
speed drifts within seconds) and their ratio compares like with like. Server CPU is read per
backend: from pg_stat_statements when it is loaded (execution + planning time), else from
/proc/<pid>/stat of the renewing backends (read locally, or through pg_read_file when the server
runs elsewhere on the same kernel), else wall time per renewal.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, LiteralString

import psycopg

import agent_runs
from agent_runs import AgentRunRepository
from bench.cpu import TICKS_PER_SECOND, backend_ticks
from bench.pgstats import wal_bytes_since, wal_lsn
from bench.report import fmt, table

THREADS: Final = 4
BATCH: Final = 100
LEASE_SECONDS: Final = 60.0
INTERVAL_SECONDS: Final = 20.0  # the worker's default heartbeat: lease / 3
LEASES_PER_PROCESS: Final = 16  # one worker process with 16 threads, each holding one lease


@dataclass(frozen=True)
class _Sizes:
    leases: int
    slices: int  # turns per crew
    batched_seconds: float  # per slice
    single_seconds: float  # per slice


FULL: Final = _Sizes(leases=10_000, slices=5, batched_seconds=2.0, single_seconds=1.6)
QUICK: Final = _Sizes(leases=500, slices=2, batched_seconds=0.5, single_seconds=0.4)
WARMUP_SECONDS: Final = 0.3  # per crew, unmeasured: statements prepared, generic plans chosen

# Running runs under a live lease, each with its open attempt. Parameters: tag, count, lease.
_LIVE: Final[LiteralString] = """\
WITH runs AS (
    INSERT INTO agent_runs (
        id, request_id, thread_id, agent_slug, uid, status, worker_id, heartbeat_at,
        lease_expires_at, started_at, created_at, updated_at
    )
    SELECT gen_random_uuid()::text,
           %(tag)s || '-l-' || i,
           %(tag)s || '-thread-' || i,
           'agent-' || mod(i, 4),
           'user-' || mod(i, 101),
           'running',
           'bench-hb-' || mod(i, 16) || ':' || md5(%(tag)s || i),
           now(),
           now() + make_interval(secs => %(lease)s::float8),
           now() - interval '1 second',
           now() - interval '2 seconds',
           now()
    FROM generate_series(1, %(count)s::int) AS i
    RETURNING id, worker_id, started_at, heartbeat_at, lease_expires_at
),
attempts AS (
    INSERT INTO agent_run_attempts (
        run_id, attempt_no, worker_id, started_at, heartbeat_at, lease_expires_at, created_at,
        updated_at
    )
    SELECT id, 1, worker_id, started_at, heartbeat_at, lease_expires_at, started_at, heartbeat_at
    FROM runs
)
SELECT id, worker_id FROM runs ORDER BY id"""

_STATEMENTS: Final = (
    "SELECT coalesce(sum(total_exec_time + total_plan_time), 0), coalesce(sum(calls), 0)"
    " FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database"
    " WHERE datname = current_database())"
)


def run_phase(url: str, quick: bool) -> dict[str, Any]:
    """Measure on `url`, a fresh migrated database this phase may fill (postgresql:// URL)."""
    sizes = QUICK if quick else FULL
    with agent_runs.connect(url) as observer:
        rows = observer.execute(
            _LIVE, {"tag": f"hb{os.getpid()}", "count": sizes.leases, "lease": LEASE_SECONDS}
        ).fetchall()
        leases = [(str(r[0]), str(r[1])) for r in rows]
        observer.execute("VACUUM (ANALYZE) agent_runs, agent_run_attempts")
        statements = _statements_available(observer)
        shares = [leases[i::THREADS] for i in range(THREADS)]
        seconds = {1: sizes.single_seconds, BATCH: sizes.batched_seconds}
        crews: dict[int, _Crew] = {}
        try:
            for batch in seconds:
                crews[batch] = _Crew(url, shares, batch=batch)
                crews[batch].run(WARMUP_SECONDS)
            for turn in range(sizes.slices):
                for batch in (1, BATCH) if turn % 2 == 0 else (BATCH, 1):
                    crews[batch].measure(seconds[batch], observer, statements)
        finally:
            for crew in crews.values():
                crew.close()
    single, batched = (crews[batch].result(sizes.leases) for batch in (1, BATCH))
    rate = batched["renewals_per_second"]
    per_process = LEASES_PER_PROCESS / INTERVAL_SECONDS  # renewals/s one worker process needs
    cpu_us = batched["server_cpu_us_per_renewal"]
    return {
        "leases": sizes.leases,
        "threads": THREADS,
        "batch": BATCH,
        "slices": sizes.slices,
        "lease_seconds": LEASE_SECONDS,
        "interval_seconds": INTERVAL_SECONDS,
        "leases_per_process": LEASES_PER_PROCESS,
        "cpu_method": batched["cpu_method"],
        "single": single,
        "batched": batched,
        "batch_over_single": rate / single["renewals_per_second"],
        # The pace the leases need: every lease once per interval.
        "needed_renewals_per_second": sizes.leases / INTERVAL_SECONDS,
        "headroom": rate / (sizes.leases / INTERVAL_SECONDS),
        "processes_carried": rate / per_process,
        "processes_per_server_core": (
            1e6 / cpu_us / per_process if cpu_us and batched["cpu_method"] != "wall" else None
        ),
    }


def render_phase(result: dict[str, Any]) -> list[str]:
    """The phase's lines for the bench report."""
    s, b = result["single"], result["batched"]
    method = {
        "pg_stat_statements": "server time per renewal (pg_stat_statements)",
        "proc": "server CPU per renewal (/proc of the backends)",
        "wall": "wall time per renewal (no server CPU reading)",
    }[result["cpu_method"]]
    rows = [
        [
            label,
            fmt(x["renewals_per_second"]),
            f"{x['server_cpu_us_per_renewal']:.1f}",
            f"{x['client_cpu_us_per_renewal']:.1f}",
            fmt(x["wal_bytes_per_renewal"]),
        ]
        for label, x in (("renew_lease (1)", s), (f"renew_leases ({result['batch']})", b))
    ]
    per_core = result["processes_per_server_core"]
    return [
        f"Heartbeats at scale: {result['leases']:,} live leases, {result['threads']} threads "
        f"renewing back to back, single and batched calls in {result['slices']} alternating "
        f"slices each (the default pace is once per {result['interval_seconds']:g} s):",
        table(
            ["call", "renewals/s", "server µs/renewal", "client µs/renewal", "WAL B/renewal"], rows
        ),
        f"  server column: {method}; batch ÷ single renewals/s "
        f"{result['batch_over_single']:.1f}x; a full round of every lease takes "
        f"{b['round_seconds'] * 1000:.0f} ms ({result['headroom']:.1f}x the needed "
        f"{fmt(result['needed_renewals_per_second'])}/s)",
        f"  worker processes one server carries at {result['leases_per_process']} leases each: "
        f"{fmt(result['processes_carried'])} by measured renewals/s"
        + (f", {fmt(per_core)} per server core by CPU" if per_core else ""),
    ]


# -- one crew: threads renewing in calls of `batch` leases, measured slice by slice --------------


@dataclass
class _Totals:
    renewals: int = 0
    calls: int = 0
    seconds: float = 0.0
    server_ms: float = 0.0  # pg_stat_statements time
    ticks: int = 0  # utime + stime of the backends
    client_seconds: float = 0.0
    wal_bytes: int = 0
    statements: bool = True  # every slice had a pg_stat_statements reading
    proc: bool = True  # every slice had a /proc reading


class _Crew:
    """THREADS connections, each renewing its share in calls of `batch` leases; each thread
    goes on where it stopped at the end of the previous slice."""

    def __init__(self, url: str, shares: Sequence[Sequence[tuple[str, str]]], *, batch: int):
        self.batch = batch
        self.conns = [agent_runs.connect(url) for _ in shares]
        self.repos = [AgentRunRepository(conn) for conn in self.conns]
        self.pids = [_backend_pid(conn) for conn in self.conns]
        self.chunks = [
            [dict(share[i : i + batch]) for i in range(0, len(share), batch)] for share in shares
        ]
        self.positions = [0] * len(shares)
        self.totals = _Totals()

    def run(self, seconds: float) -> tuple[int, int]:
        """Every thread renews for `seconds`: (renewals, calls)."""
        renewed = [0] * len(self.conns)
        calls = [0] * len(self.conns)
        errors: list[BaseException] = []
        deadline = time.monotonic() + seconds

        def renewer(index: int) -> None:
            try:
                chunks, repo = self.chunks[index], self.repos[index]
                position = self.positions[index]
                while time.monotonic() < deadline:
                    renewed[index] += _renew(repo, chunks[position], self.batch)
                    calls[index] += 1
                    position = (position + 1) % len(chunks)
                self.positions[index] = position
            except BaseException as exc:  # reported by the calling thread
                errors.append(exc)

        threads = [threading.Thread(target=renewer, args=(i,)) for i in range(len(self.conns))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise RuntimeError(f"a renewing thread failed: {errors[0]!r}") from errors[0]
        return sum(renewed), sum(calls)

    def measure(self, seconds: float, observer: psycopg.Connection[Any], statements: bool) -> None:
        """One slice of `seconds`, with the counters read around it."""
        totals = self.totals
        ticks_before = backend_ticks(observer, self.pids)
        time_before = _statement_time(observer) if statements else None
        lsn = wal_lsn(observer)
        client_before = _client_cpu()
        started = time.perf_counter()
        renewals, calls = self.run(seconds)
        totals.seconds += time.perf_counter() - started
        totals.client_seconds += _client_cpu() - client_before
        totals.wal_bytes += wal_bytes_since(observer, lsn)
        time_after = _statement_time(observer) if statements else None
        ticks_after = backend_ticks(observer, self.pids)
        totals.renewals += renewals
        totals.calls += calls
        if time_before is not None and time_after is not None:
            totals.server_ms += time_after - time_before
        else:
            totals.statements = False
        if ticks_before is not None and ticks_after is not None:
            totals.ticks += ticks_after - ticks_before
        else:
            totals.proc = False

    def result(self, leases: int) -> dict[str, Any]:
        t = self.totals
        if t.statements:
            method, server_us = "pg_stat_statements", t.server_ms * 1000 / t.renewals
        elif t.proc:
            method, server_us = "proc", t.ticks / TICKS_PER_SECOND * 1e6 / t.renewals
        else:
            method, server_us = "wall", t.seconds * len(self.conns) * 1e6 / t.renewals
        rate = t.renewals / t.seconds
        return {
            "batch": self.batch,
            "renewals": t.renewals,
            "calls": t.calls,
            "rounds": t.renewals / leases,
            "seconds": t.seconds,
            "renewals_per_second": rate,
            "round_seconds": leases / rate,  # one renewal of every lease at this rate
            "cpu_method": method,
            "server_cpu_us_per_renewal": server_us,
            "client_cpu_us_per_renewal": t.client_seconds * 1e6 / t.renewals,
            "wal_bytes_per_renewal": t.wal_bytes / t.renewals,
        }

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


def _renew(repo: AgentRunRepository, chunk: dict[str, str], batch: int) -> int:
    if batch == 1:
        ((run_id, worker),) = chunk.items()
        if not repo.renew_lease(run_id, worker_id=worker, lease_seconds=LEASE_SECONDS):
            raise AssertionError(f"the live lease of {run_id} was not renewed")
        return 1
    renewed = repo.renew_leases(chunk, lease_seconds=LEASE_SECONDS)
    if len(renewed) != len(chunk):
        raise AssertionError("a live lease was not renewed")
    return len(renewed)


def _backend_pid(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    return int(row[0]) if row else 0


# -- CPU readings ---------------------------------------------------------------------------


def _client_cpu() -> float:
    times = os.times()
    return times.user + times.system


def _statements_available(conn: psycopg.Connection[Any]) -> bool:
    """Whether pg_stat_statements answers here (it must be in shared_preload_libraries)."""
    try:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        conn.execute(_STATEMENTS).fetchone()
    except psycopg.Error:
        return False
    return True


def _statement_time(conn: psycopg.Connection[Any]) -> float:
    row = conn.execute(_STATEMENTS).fetchone()
    return float(row[0]) if row else 0.0
