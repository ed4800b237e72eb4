"""wait_for_run under a flood of other runs' finished notifications: its deadline holds, and the
end of its own run is not stuck behind them."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

import agent_runs
from agent_runs import AgentRunRepository, RunStatus
from agent_runs.notify import WAIT_POLL_SECONDS, wait_for_run
from tests.helpers import new_run


class Flood:
    """Another connection sends bursts of other runs' finished notifications until stopped."""

    def __init__(self, dsn: str) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._send, args=(dsn,))

    def _send(self, dsn: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not self.stop.is_set():
                conn.execute(
                    "SELECT pg_notify('agent_runs_finished', 'other-' || g)"
                    " FROM generate_series(1, 20000) AS g"
                )

    def __enter__(self) -> Flood:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def test_wait_for_runs_deadline_holds_while_other_notifications_pour_in(
    dsn: str, repo: AgentRunRepository
) -> None:
    run = new_run(repo)
    with agent_runs.connect(dsn) as conn, Flood(dsn):
        time.sleep(0.5)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            wait_for_run(conn, run.id, timeout_seconds=1)
        late = time.monotonic() - started - 1
    # The deadline is checked after every notification: at most one poll slice's read is late.
    assert late < WAIT_POLL_SECONDS, f"returned {late:.1f}s after its deadline"


def test_a_waiters_run_is_not_stuck_behind_other_runs_notifications(
    dsn: str, repo: AgentRunRepository
) -> None:
    run = new_run(repo)
    assert repo.mark_running(run.id, worker_id="w", lease_seconds=60).acquired
    finisher = threading.Timer(
        1.0, lambda: repo.set_terminal_status(run.id, status="completed", worker_id="w")
    )
    with agent_runs.connect(dsn) as conn, Flood(dsn):
        started = time.monotonic()
        finisher.start()
        ended = wait_for_run(conn, run.id, timeout_seconds=60)
        seen_after = time.monotonic() - started
    finisher.join()
    assert ended.status == RunStatus.COMPLETED
    assert seen_after < 1 + 2 * WAIT_POLL_SECONDS, f"seen {seen_after:.1f}s after the wait began"
