"""Every numeric argument is checked, huge ones too: refused by name, nothing written."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRunRepository, InvalidArgument, create_pool
from agent_runs.notify import wait_for_run
from agent_runs.worker import AgentResult, Worker
from tests.helpers import everything

Conn = psycopg.Connection[Any]
AGENT_RUNS = [sys.executable, "-m", "agent_runs"]


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=1, max_size=8) as p:
        yield p


HUGE = 10**400
LATE = datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-14)))
EARLY = datetime(1, 1, 1, 1, tzinfo=timezone(timedelta(hours=14)))

NUMERIC_CALLS: list[tuple[str, Callable[[AgentRunRepository, Conn], object]]] = [
    ("timeout_seconds", lambda r, c: wait_for_run(c, "x", timeout_seconds=HUGE)),
    ("timeout_seconds", lambda r, c: wait_for_run(c, "x", timeout_seconds=-HUGE)),
    ("lease_seconds", lambda r, c: r.claim_next(worker_id="w", lease_seconds=HUGE)),
    ("lease_seconds", lambda r, c: r.mark_running("x", worker_id="w", lease_seconds=HUGE)),
    ("lease_seconds", lambda r, c: r.renew_lease("x", worker_id="w", lease_seconds=HUGE)),
    ("limit", lambda r, c: r.reconcile_expired_leases(limit=HUGE)),
    ("limit", lambda r, c: r.list_runs(limit=HUGE)),
    ("batch_size", lambda r, c: r.prune_finished_runs(older_than=timedelta(1), batch_size=HUGE)),
    ("since", lambda r, c: r.list_runs(since=LATE)),
    ("since", lambda r, c: r.list_runs(since=EARLY)),
    ("since", lambda r, c: r.run_stats(since=EARLY)),
    ("now", lambda r, c: r.request_cancel("x", now=EARLY)),
]


@pytest.mark.parametrize(("argument", "call"), NUMERIC_CALLS)
def test_a_number_out_of_range_is_refused_by_name(
    repo: AgentRunRepository,
    observer: Conn,
    argument: str,
    call: Callable[[AgentRunRepository, Conn], object],
) -> None:
    before = everything(observer)
    with pytest.raises(InvalidArgument, match=argument):
        call(repo, repo.conn)
    assert everything(observer) == before


@pytest.mark.parametrize(
    "setting", ["lease_seconds", "heartbeat_seconds", "max_tries", "poll_seconds"]
)
def test_worker_settings_refuse_huge_numbers_by_name(pool: ConnectionPool, setting: str) -> None:
    settings: dict[str, Any] = {setting: HUGE}
    with pytest.raises(InvalidArgument, match=setting):
        Worker(pool, lambda run, ctx: AgentResult.completed(), **settings)


def test_cli_reconcile_refuses_a_period_too_long_to_wait_in_one_line(dsn: str) -> None:
    done = subprocess.run(
        [*AGENT_RUNS, "reconcile", "--dsn", dsn, "--every", "1e300"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1
    assert "--every" in done.stderr and "Traceback" not in done.stderr
