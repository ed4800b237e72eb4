"""Through a real PgBouncer (1.18-style defaults: no prepared-statement support) in transaction
and in session mode: every call correct, migrations, and real worker processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

import agent_runs
from agent_runs import AgentRunRepository, RunStatus
from agent_runs import migrate as migrate_module
from agent_runs.devtools.pgbouncer import MODES, PgBouncer, pgbouncer, pgbouncer_binary
from agent_runs.migrate import MigrationLocked, apply_migrations, rollback_migrations
from agent_runs.notify import Wakeups
from tests.helpers import wait_until

pytestmark = pytest.mark.skipif(
    pgbouncer_binary() is None, reason="pgbouncer is not installed (CI installs it)"
)

ROOT = Path(__file__).resolve().parents[1]
OWNER = "bouncer-worker:1"
LEASE = 30.0


@pytest.fixture(scope="module", params=MODES)
def bouncer(request: pytest.FixtureRequest, pg_server: Any) -> Iterator[PgBouncer]:
    """pool_size 1: the clients share one server session, as a busy pooler makes them."""
    with pgbouncer(pg_server.admin_url, mode=request.param, pool_size=1) as started:
        yield started


@pytest.fixture(scope="module")
def tx_bouncer(pg_server: Any) -> Iterator[PgBouncer]:
    with pgbouncer(pg_server.admin_url, mode="transaction", pool_size=2) as started:
        yield started


def _new_run(repo: AgentRunRepository, key: str, **kwargs: Any) -> agent_runs.AgentRun:
    return repo.create_run(
        thread_id=f"t-{key}", agent_slug="agent", uid="u", request_id=f"r-{key}", **kwargs
    )


def _lifecycles(url: str, thread_no: int, rounds: int, options: dict[str, Any]) -> list[str]:
    """Full lifecycles on a connection of its own; every answer checked against its request."""
    done = []
    with agent_runs.connect(url, **options) as conn:
        repo = AgentRunRepository(conn)
        worker = f"w{thread_no}:1"
        for i in range(rounds):
            key = f"{thread_no}-{i}-{uuid.uuid4().hex[:8]}"
            run = _new_run(repo, key, input_payload={"k": key})
            assert run.request_id == f"r-{key}" and run.input_payload == {"k": key}
            got = repo.get_run(run.id)
            assert got is not None and got.id == run.id
            assert repo.list_run_attempts(run.id) == []
            claim = repo.mark_running(run.id, worker_id=worker, lease_seconds=LEASE)
            assert claim.acquired and claim.run is not None and claim.run.id == run.id
            assert repo.renew_lease(run.id, worker_id=worker, lease_seconds=LEASE)
            [attempt] = repo.list_run_attempts(run.id)
            assert attempt.run_id == run.id and attempt.worker_id == worker
            final = repo.set_terminal_status(run.id, status="completed", worker_id=worker)
            assert final.changed and final.run is not None and final.run.id == run.id
            done.append(run.id)
    return done


@pytest.mark.parametrize("prepare", ["default", "prepare_threshold=None"])
def test_threads_with_their_own_connections_get_their_own_answers(
    bouncer: PgBouncer, dsn: str, observer: psycopg.Connection[Any], *, prepare: str
) -> None:
    """Several clients sharing one server session: no prepared-statement error ever reaches a
    caller, and every call answers with its own statement's rows."""
    url = bouncer.url_for(dsn)
    options: dict[str, Any] = {} if prepare == "default" else {"prepare_threshold": None}
    results: dict[int, list[str]] = {}
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            results[n] = _lifecycles(url, n, 15, options)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors[:3]
    ids = [run_id for done in results.values() for run_id in done]
    assert len(ids) == 60
    rows = observer.execute(
        "SELECT status, count(*) FROM agent_runs WHERE id = ANY(%s) GROUP BY status", (ids,)
    ).fetchall()
    assert rows == [("completed", 60)]


def test_no_named_statement_reaches_the_server_with_prepare_threshold_none(
    tx_bouncer: PgBouncer, dsn: str, observer: psycopg.Connection[Any]
) -> None:
    _lifecycles(tx_bouncer.url_for(dsn), 0, 6, {"prepare_threshold": None})
    # Through transaction pooling the server sessions are the pooler's: ask them.
    with psycopg.connect(tx_bouncer.url_for(dsn), autocommit=True, prepare_threshold=None) as c:
        for _ in range(4):
            found = c.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
            assert found == (0,)


def test_create_pool_passes_prepare_threshold_through(tx_bouncer: PgBouncer, dsn: str) -> None:
    with (
        agent_runs.create_pool(
            tx_bouncer.url_for(dsn), min_size=1, max_size=2, prepare_threshold=None
        ) as pool,
        pool.connection() as conn,
    ):
        assert conn.prepare_threshold is None
        repo = AgentRunRepository(conn)
        run = _new_run(repo, uuid.uuid4().hex)
        assert repo.get_run(run.id) == run


@pytest.mark.parametrize("mode", MODES)
def test_migrate_rollback_migrate_through_pgbouncer(
    pg_server: Any, blank_dsn: str, observer: psycopg.Connection[Any], mode: str
) -> None:
    with pgbouncer(pg_server.admin_url, mode=mode, pool_size=2) as started:
        url = started.url_for(blank_dsn)
        applied = apply_migrations(url)
        assert applied
        assert rollback_migrations(url) == applied[-1:]
        assert apply_migrations(url) == applied[-1:]
        assert apply_migrations(url) == []
    with psycopg.connect(blank_dsn, autocommit=True) as direct:
        assert direct.execute("SELECT count(*) FROM yoyo_lock").fetchone() == (0,)


def test_a_left_lock_is_reported_with_how_to_clear_it(
    blank_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    apply_migrations(blank_dsn)
    with psycopg.connect(blank_dsn, autocommit=True) as direct:
        direct.execute("INSERT INTO yoyo_lock (locked, ctime, pid) VALUES (1, now(), 999999)")
    monkeypatch.setattr(migrate_module, "LOCK_WAIT_SECONDS", 0.2)
    with pytest.raises(MigrationLocked, match=r"DELETE FROM yoyo_lock"):
        rollback_migrations(blank_dsn)
    with psycopg.connect(blank_dsn, autocommit=True) as direct:
        direct.execute("DELETE FROM yoyo_lock")
    assert rollback_migrations(blank_dsn)


# -- real worker processes ------------------------------------------------------------------

SCRIPTS: dict[str, tuple[list[str], str, int]] = {
    # script: (steps, final status, attempts)
    "ok": (["ok"], "completed", 1),
    "retry": (["retry", "ok"], "completed", 2),
    "fail": (["fail:boom"], "failed", 1),
    "interrupt": (["interrupt"], "interrupted", 1),
}


def test_worker_processes_through_transaction_pooling(
    tx_bouncer: PgBouncer, dsn: str, observer: psycopg.Connection[Any]
) -> None:
    """Three `agent-runs worker` processes over 200 scripted runs, through transaction-mode
    PgBouncer with default settings: every run ends as scripted, no error in any log."""
    url = tx_bouncer.url_for(dsn)
    expected: dict[str, str] = {}
    with agent_runs.connect(dsn) as conn:
        repo = AgentRunRepository(conn)
        for i in range(200):
            kind = list(SCRIPTS)[i % len(SCRIPTS)]
            run = repo.create_run(
                thread_id=f"t-{i}",
                agent_slug="scripted",
                uid="u",
                request_id=f"r-{i}",
                input_payload={"script": SCRIPTS[kind][0]},
            )
            expected[run.id] = kind
    folder = tempfile.TemporaryDirectory(prefix="agent_runs-workers-")
    logs = [(Path(folder.name) / f"worker-{n}.log").open("wb") for n in range(3)]
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agent_runs",
                "worker",
                "--dsn",
                url,
                "--concurrency",
                "2",
                "--lease-seconds",
                "5",
                "--poll-seconds",
                "0.2",
                "--no-listen",
                "--name",
                f"bouncer-{n}",
            ],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        for n, log in enumerate(logs)
    ]
    try:
        deadline = time.monotonic() + 90  # a ceiling, not a timing assertion
        while time.monotonic() < deadline:
            row = observer.execute(
                "SELECT count(*) FROM agent_runs WHERE status NOT IN"
                " ('completed', 'failed', 'interrupted', 'cancelled')"
            ).fetchone()
            if row == (0,):
                break
            assert all(w.poll() is None for w in workers), "a worker exited"
            time.sleep(0.2)
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
    for log in logs:
        log.close()
    outputs = [Path(log.name).read_text(errors="replace") for log in logs]
    folder.cleanup()
    rows = observer.execute(
        "SELECT r.id, r.status, r.error_type, count(a.id) FROM agent_runs r"
        " LEFT JOIN agent_run_attempts a ON a.run_id = r.id GROUP BY r.id"
    ).fetchall()
    assert len(rows) == 200
    for run_id, status, error_type, attempts in rows:
        steps, final, tries = SCRIPTS[expected[run_id]]
        assert (status, attempts) == (final, tries), (run_id, steps, error_type)
        if status == "failed":
            assert error_type == "boom"
    for output in outputs:
        bad = [line for line in output.splitlines() if " ERROR " in line or "Traceback" in line]
        assert not bad, bad[:5]


def test_a_repository_behind_pgbouncer_keeps_the_right_clock(
    tx_bouncer: PgBouncer, dsn: str
) -> None:
    """Timestamps through the pooler are UTC and exact (binary rows, unnamed statements)."""
    t0 = datetime.now(UTC).replace(microsecond=0)
    with agent_runs.connect(tx_bouncer.url_for(dsn), prepare_threshold=None) as conn:
        repo = AgentRunRepository(conn)
        run = _new_run(repo, uuid.uuid4().hex)
        claimed = repo.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0)
        assert claimed.run is not None
        assert claimed.run.lease_expires_at == t0 + timedelta(seconds=LEASE)
        assert claimed.run.status == RunStatus.RUNNING


@pytest.mark.parametrize("mode", MODES)
def test_a_listener_behind_transaction_pooling_knows_it_hears_nothing(
    mode: str, pg_server: Any, dsn: str, repo: AgentRunRepository
) -> None:
    """Session mode keeps LISTEN's session: wake-ups arrive. Transaction mode lends it to
    others: the listener's probe finds that out, it stops, and claimers poll instead."""
    with pgbouncer(pg_server.admin_url, mode=mode, pool_size=3) as bouncer:
        _listen_through(bouncer, dsn, repo)


def _listen_through(bouncer: PgBouncer, dsn: str, repo: AgentRunRepository) -> None:
    wakeups = Wakeups(bouncer.url_for(dsn))
    wakeups.start()
    try:
        assert wait_until(lambda: wakeups.listening or wakeups.deaf, timeout=15)
        if bouncer.mode == "session":
            assert (wakeups.listening, wakeups.deaf) == (True, False)
            wakeups.wait(0.5)  # the catch-up wake-up posted after connecting
            _new_run(repo, "woken")
            assert wakeups.wait(5)
        else:
            assert (wakeups.listening, wakeups.deaf) == (False, True)
    finally:
        wakeups.close()
