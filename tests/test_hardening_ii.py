"""Hardening II: facts, logs and exit codes hold against hostile agents, lineage loops and lost
connections. One section per class of hole; each test failed before its fix."""

from __future__ import annotations

import logging
import os
import resource
import subprocess
import sys
import threading
import time
import unicodedata
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

import agent_runs
from agent_runs import AgentRun, AgentRunRepository, InvalidArgument, RunStatus, create_pool
from agent_runs import validation as check
from agent_runs.logs import logger
from agent_runs.migrate import apply_migrations, rollback_migrations
from agent_runs.notify import WAIT_POLL_SECONDS, wait_for_run
from agent_runs.worker import AgentResult, RunContext, Worker
from tests.helpers import everything, new_run, wait_until
from tests.test_migrations import ALL as MIGRATIONS

Conn = psycopg.Connection[Any]
HOSTILE = "evil\r\nFORGED LINE\x1b]0;owned\x07\x1b[2J\u202egnp.exe\u2028end"
AGENT_RUNS = [sys.executable, "-m", "agent_runs"]
WAITER_APP = "hardening-wait"


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=1, max_size=8) as p:
        yield p


def run_agent(pool: ConnectionPool, agent: Any) -> AgentRun:
    with Worker(pool, agent, name="hardening", lease_seconds=5, heartbeat_seconds=1) as worker:
        ended = worker.run_once()
    assert ended is not None
    return ended


# -- 1. lineage is a tree -------------------------------------------------------------------------


def test_a_run_cannot_be_its_own_parent(repo: AgentRunRepository, observer: Conn) -> None:
    before = everything(observer)
    with pytest.raises(InvalidArgument, match="created_by_run_id"):
        new_run(repo, run_id="loop", created_by_run_id="loop")
    assert everything(observer) == before


def test_the_schema_refuses_a_self_parent_and_a_loop_made_by_any_client(
    repo: AgentRunRepository, observer: Conn
) -> None:
    with pytest.raises(psycopg.errors.CheckViolation, match="ck_agent_runs_not_own_parent"):
        observer.execute(
            "INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid,"
            " created_by_run_id) VALUES ('x', 'rx', 't', 'a', 'u', 'x')"
        )
    root = new_run(repo)
    child = new_run(repo, created_by_run_id=root.id)
    grandchild = new_run(repo, created_by_run_id=child.id)
    with pytest.raises(psycopg.errors.CheckViolation, match="its own ancestor"):
        observer.execute(
            "UPDATE agent_runs SET created_by_run_id = %s WHERE id = %s", (grandchild.id, root.id)
        )
    # A re-parenting that keeps a tree is still allowed; so is cutting a link.
    other = new_run(repo)
    observer.execute(
        "UPDATE agent_runs SET created_by_run_id = %s WHERE id = %s", (other.id, root.id)
    )
    observer.execute("UPDATE agent_runs SET created_by_run_id = NULL WHERE id = %s", (root.id,))


def test_0009_cuts_the_loops_already_stored_and_prune_then_removes_them(blank_dsn: str) -> None:
    apply_migrations(blank_dsn)
    later = MIGRATIONS[MIGRATIONS.index("0009_lineage_is_a_tree") :]
    assert rollback_migrations(blank_dsn, count=len(later)) == later[::-1]
    old = datetime(2020, 1, 1, tzinfo=UTC)
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        for run_id, parent in (("self", "self"), ("a", None), ("b", "a"), ("below-self", "self")):
            conn.execute(
                "INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status,"
                " created_by_run_id, created_at, finished_at)"
                " VALUES (%s, %s, %s, 'a', 'u', 'completed', %s, %s, %s)",
                (run_id, f"r-{run_id}", f"t-{run_id}", parent, old, old),
            )
        conn.execute("UPDATE agent_runs SET created_by_run_id = 'b' WHERE id = 'a'")  # a <-> b
    apply_migrations(blank_dsn)
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT id, created_by_run_id FROM agent_runs").fetchall()
        parents: dict[str, str | None] = dict(rows)
        assert parents == {"self": None, "a": None, "b": "a", "below-self": "self"}
        pruned = AgentRunRepository(conn).prune_finished_runs(older_than=timedelta(days=1))
        assert pruned == 4


# -- 2. a long error is cut once ------------------------------------------------------------------


def test_a_huge_error_from_an_agent_is_cut_once_and_the_marker_counts_every_cut_character(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    size = 5_000_000
    cut = f" … [truncated {size - check.MAX_ERROR_MESSAGE_LENGTH} characters]"

    def fails(run: AgentRun, ctx: RunContext) -> AgentResult:
        return AgentResult.failed("too_long", "m" * size)

    def raises(run: AgentRun, ctx: RunContext) -> AgentResult:
        raise RuntimeError("r" * (size - len("RuntimeError: ")))

    for agent, error_type in ((fails, "too_long"), (raises, "agent_error")):
        run = new_run(repo)
        ended = run_agent(pool, agent)
        assert ended.id == run.id
        stored = repo.get_run(run.id)
        assert stored is not None and stored.error_type == error_type
        assert stored.error_message is not None and stored.error_message.endswith(cut)
        assert len(stored.error_message) == check.MAX_ERROR_MESSAGE_LENGTH + len(cut)
        (attempt,) = repo.list_run_attempts(run.id)
        assert attempt.error_message == stored.error_message


def test_error_message_is_idempotent_and_a_cut_message_is_not_cut_again() -> None:
    once = check.error_message("x" * 20_000)
    assert once is not None and once.endswith(" … [truncated 11808 characters]")
    assert check.error_message(once) == once
    assert check.agent_error("kind", once) == ("kind", once)


# -- 3. a bad error_type keeps the agent's message ------------------------------------------------


def test_a_bad_error_type_keeps_the_agents_own_message(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    def bad_type(run: AgentRun, ctx: RunContext) -> AgentResult:
        return AgentResult.failed("T" * 5_000_000, "the real message")

    run = new_run(repo)
    run_agent(pool, bad_type)
    stored = repo.get_run(run.id)
    assert stored is not None and stored.error_type == check.INVALID_ERROR_TYPE
    assert stored.error_message is not None
    assert stored.error_message.endswith(": the real message")
    assert len(stored.error_message) < 400  # a short prefix of the bad type, not 8 kB of it
    assert "TTTT" in stored.error_message


# -- 4. log lines carry hostile text as visible text ----------------------------------------------


def _assert_one_visible_line(text: str) -> None:
    assert "\n" not in text and "\r" not in text
    for ch in text:
        assert unicodedata.category(ch) not in ("Cc", "Cs", "Zl", "Zp"), repr(text)
        assert ch not in "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069", repr(text)


def test_worker_and_reconciler_log_lines_escape_run_ids_and_error_texts(
    pool: ConnectionPool, repo: AgentRunRepository, caplog: pytest.LogCaptureFixture
) -> None:
    def fails(run: AgentRun, ctx: RunContext) -> AgentResult:
        return AgentResult.failed("hostile", HOSTILE)

    hostile_id = "run\r\n\x1b[31mFAKE\u202e"
    new_run(repo, run_id=hostile_id)
    caplog.set_level(logging.DEBUG, logger="agent_runs")
    run_agent(pool, fails)
    stale = new_run(repo, run_id="stale\n\x1b]0;t\x07")
    long_ago = datetime.now(UTC) - timedelta(hours=1)
    assert repo.mark_running(stale.id, worker_id="gone", lease_seconds=1, now=long_ago).acquired
    with Worker(pool, fails, name="reconciler", lease_seconds=5) as worker:
        converged = worker.maybe_reconcile()
    assert [run.id for run in converged] == [stale.id]
    lines = [record.getMessage() for record in caplog.records]
    assert any("run\\r\\n\\e[31mFAKE\\u202e" in line for line in lines), lines
    assert any("evil\\r\\nFORGED LINE\\e]0;owned\\x07" in line for line in lines), lines
    assert any("stale\\n\\e]0;t\\x07" in line for line in lines), lines
    for line in lines:
        _assert_one_visible_line(line)


def test_a_logged_exception_keeps_its_frames_and_escapes_its_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logger("agent_runs.test")
    caplog.set_level(logging.INFO, logger="agent_runs.test")
    try:
        raise ValueError(HOSTILE)
    except ValueError:
        log.exception("failed for %s", "run\n1")
    (record,) = caplog.records
    assert record.exc_info is None  # the traceback travels as escaped text, not as exc_info
    message = record.getMessage()
    head, *frames = message.split("\n")
    assert head == "failed for run\\n1"
    assert frames[0] == "Traceback (most recent call last):"
    assert any(line.startswith("  File ") and __file__ in line for line in frames)
    assert frames[-1].startswith("ValueError: evil\\r\\nFORGED LINE\\e]0;owned")
    for line in [head, frames[-1]]:
        _assert_one_visible_line(line)


# -- 5. agent-runs wait and a lost connection -----------------------------------------------------


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


# -- 6. wait_for_run's deadline holds under a flood of other runs' notifications ------------------


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


# -- 7. every numeric argument is checked, huge ones too ------------------------------------------

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


# -- 8. absurd worker concurrency -----------------------------------------------------------------


def test_cli_worker_refuses_an_absurd_concurrency_in_one_line(dsn: str) -> None:
    done = subprocess.run(
        [*AGENT_RUNS, "worker", "--dsn", dsn, "--concurrency", "100000"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1
    assert f"1 to {check.MAX_CONCURRENCY}" in done.stderr


def test_cli_worker_that_cannot_start_a_thread_stops_the_started_ones_and_exits_1(
    dsn: str,
) -> None:
    address_space = 1024 * 1024 * 1024  # enough to start, too little for 1,000 thread stacks

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    done = subprocess.run(
        [*AGENT_RUNS, "worker", "--dsn", dsn, "--concurrency", str(check.MAX_CONCURRENCY)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limited,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("agent-runs: worker: could not start thread"), last
    assert "stopped cleanly" in last
