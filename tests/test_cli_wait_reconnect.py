"""`agent-runs wait` and a lost connection: it reconnects and reports the real end, or exits 69
when the database stays unreachable."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import psycopg

from agent_runs import AgentRunRepository
from tests.helpers import new_run, wait_until

Conn = psycopg.Connection[Any]
AGENT_RUNS = [sys.executable, "-m", "agent_runs"]
WAITER_APP = "hardening-wait"


def _wait_process(dsn: str, run_id: str, timeout: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*AGENT_RUNS, "wait", run_id, "--dsn", dsn, "--timeout", timeout],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PGAPPNAME": WAITER_APP},
    )


def _listening_backends(observer: Conn) -> list[int]:
    """The waiter's backends, once it is past its first read (it LISTENs before it)."""
    rows = observer.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = %s AND state = 'idle' AND query NOT IN ('', %s)",
        (WAITER_APP, "LISTEN agent_runs_finished"),
    ).fetchall()
    return [pid for (pid,) in rows]


def test_cli_wait_reconnects_after_its_backend_is_killed_and_reports_the_real_end(
    dsn: str, repo: AgentRunRepository, observer: Conn
) -> None:
    run = new_run(repo)
    waiter = _wait_process(dsn, run.id, "60")
    try:
        assert wait_until(lambda: bool(_listening_backends(observer)), timeout=30)
        killed = set(_listening_backends(observer))
        for pid in killed:
            observer.execute("SELECT pg_terminate_backend(%s)", (pid,))
        # The run ends only once the waiter is back on a new backend, past its first read.
        assert wait_until(lambda: bool(set(_listening_backends(observer)) - killed), timeout=30)
        assert repo.mark_running(run.id, worker_id="w", lease_seconds=60).acquired
        assert repo.set_terminal_status(run.id, status="completed", worker_id="w").changed
        out, err = waiter.communicate(timeout=60)
    finally:
        waiter.kill()
    assert waiter.returncode == 0, err
    assert out.splitlines()[0] == f"{run.id}  completed"
    assert "reconnecting" in err


def test_cli_wait_exits_69_when_the_database_stays_unreachable(
    dsn: str, repo: AgentRunRepository, observer: Conn
) -> None:
    run = new_run(repo)
    name = str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])
    waiter = _wait_process(dsn, run.id, "3")
    try:
        assert wait_until(lambda: bool(_listening_backends(observer)), timeout=30)
        with psycopg.connect(dsn.replace(f"/{name}", "/postgres"), autocommit=True) as admin:
            admin.execute(
                psycopg.sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(
                    psycopg.sql.Identifier(name)
                )
            )
            try:
                for pid in _listening_backends(observer):
                    observer.execute("SELECT pg_terminate_backend(%s)", (pid,))
                _out, err = waiter.communicate(timeout=60)
            finally:
                admin.execute(
                    psycopg.sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(
                        psycopg.sql.Identifier(name)
                    )
                )
    finally:
        waiter.kill()
    assert waiter.returncode == 69, err
    assert "the run's end is unknown" in err.splitlines()[-1]
    assert "Traceback" not in err
