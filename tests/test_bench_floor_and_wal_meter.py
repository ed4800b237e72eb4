"""The bench's lean floor and WAL meter: the floor writes the lifecycle's facts, the meter reads
a range back."""

from __future__ import annotations

from typing import Any

import psycopg

import agent_runs
from bench import lean_floor
from bench.lean_floor import LeanFloorClient
from bench.walstats import _TOTAL, WalMeter

LEASE = 60.0


def _row(conn: psycopg.Connection[Any], sql: Any, params: Any = None) -> tuple[Any, ...]:
    row = conn.execute(sql, params).fetchone()
    assert row is not None
    return tuple(row)


def test_lean_floor_claims_fifo_renews_and_completes_with_the_attempt(blank_dsn: str) -> None:
    with agent_runs.connect(blank_dsn) as conn:
        lean_floor.install(conn)
        lean_floor.seed_history(conn, 20)
        lean_floor.seed_pending(conn, 2, age_seconds=60)
        lean_floor.seed_pending(conn, 1)
        client = LeanFloorClient(conn)

        run_id = client.claim("w1", LEASE)
        assert run_id is not None
        oldest = _row(
            conn, "SELECT min(id) FROM bench_lean.runs WHERE status IN ('pending', 'running')"
        )
        assert int(run_id) == oldest[0]
        assert client.renew(run_id, "w1", LEASE)
        assert not client.renew(run_id, "someone-else", LEASE)
        assert not client.complete(run_id, "someone-else")
        assert client.complete(run_id, "w1")
        assert not client.complete(run_id, "w1")

        run = _row(
            conn,
            "SELECT status, worker_id, lease_expires_at, finished_at IS NOT NULL"
            " FROM bench_lean.runs WHERE id = %s",
            (int(run_id),),
        )
        assert run == ("completed", None, None, True)
        attempt = _row(
            conn,
            "SELECT attempt_no, worker_id, outcome, finished_at IS NOT NULL,"
            " heartbeat_at >= started_at FROM bench_lean.attempts WHERE run_id = %s",
            (int(run_id),),
        )
        assert attempt == (1, "w1", "completed", True, True)
        assert lean_floor.count_pending(conn) == 2
        assert client.claim("w2", LEASE) is not None
        assert client.claim("w3", LEASE) is not None
        assert client.claim("w4", LEASE) is None


def test_wal_meter_reads_back_an_interval(blank_dsn: str) -> None:
    with agent_runs.connect(blank_dsn) as observer:
        meter = WalMeter(observer)
        try:
            start = meter.start()
            observer.execute("CREATE TABLE t (x int)")
            observer.execute("INSERT INTO t SELECT generate_series(1, 1000)")
            wal = meter.measure(start)
        finally:
            meter.close()
    assert wal.lsn_bytes > 0
    if meter.splits_fpi:
        assert wal.records is not None and wal.fpi is not None
        assert 0 < wal.records <= wal.lsn_bytes
    else:
        assert wal.records is None, meter.method


def test_the_waldump_total_line_parses() -> None:
    text = (
        "Total                                      29344                       3690016 [97.69%]"
        "                87116 [2.31%]               3777132 [100%]\n"
    )
    match = _TOTAL.search(text)
    assert match is not None
    assert (match.group(2), match.group(3)) == ("3690016", "87116")
