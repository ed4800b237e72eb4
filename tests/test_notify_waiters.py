"""agent_runs_finished only for runs someone waits for: registrations (agent_run_waiters),
the race between a registration and the run's end forced in both orders with real row locks,
cleanup of registrations, and one agent_runs_claimable per slug on bulk paths."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

import agent_runs
from agent_runs import AgentRunRepository, Finish, RunStatus, waiters
from agent_runs import notify as notify_module
from agent_runs.notify import CLAIMABLE_CHANNEL, FINISHED_CHANNEL, wait_for_run
from tests.helpers import new_run, register_waiter, wait_for_lock_waiters
from tests.test_notify import received

Conn = psycopg.Connection[Any]
Finisher = Callable[[AgentRunRepository, str, datetime], object]


@pytest.fixture
def listener(dsn: str) -> Iterator[Conn]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("LISTEN agent_runs_claimable")
        conn.execute("LISTEN agent_runs_finished")
        yield conn


@pytest.fixture
def no_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """wait_for_run's poll fallback pushed past every timeout here: a waiter returns only
    through its notification or its own reads around the registration."""
    monkeypatch.setattr(notify_module, "WAIT_POLL_SECONDS", 60.0)


def registrations(observer: Conn, run_id: str | None = None) -> int:
    row = observer.execute(
        "SELECT count(*) FROM agent_run_waiters WHERE %(run_id)s::text IS NULL"
        " OR run_id = %(run_id)s::text",
        {"run_id": run_id},
    ).fetchone()
    assert row is not None
    return int(row[0])


# Each way a run ends, from the state `_ready` leaves it in (t0 is the clock of its lease).
FINISHERS: dict[str, Finisher] = {
    "set_terminal_status": lambda repo, run_id, t0: repo.set_terminal_status(
        run_id, status="completed", worker_id="w", now=t0
    ),
    "finish_runs": lambda repo, run_id, t0: repo.finish_runs(
        [Finish(run_id, "w", "failed", "e", "m")], now=t0
    ),
    "reconcile_expired_leases": lambda repo, run_id, t0: repo.reconcile_expired_leases(
        now=t0 + timedelta(seconds=60)
    ),
    "request_cancel": lambda repo, run_id, t0: repo.request_cancel(run_id, now=t0),
}


def _ready(repo: AgentRunRepository, how: str, t0: datetime) -> str:
    run = new_run(repo)
    if how != "request_cancel":  # a never-started pending run is cancelled at once
        assert repo.mark_running(run.id, worker_id="w", lease_seconds=30, now=t0).acquired
    return run.id


@pytest.mark.parametrize("how", list(FINISHERS))
def test_a_run_nobody_waits_for_ends_without_a_notification(
    repo: AgentRunRepository, listener: Conn, observer: Conn, t0: datetime, how: str
) -> None:
    unwatched = _ready(repo, how, t0)
    received(listener, observer)
    FINISHERS[how](repo, unwatched, t0)
    assert repo.get_run(unwatched).is_terminal  # type: ignore[union-attr]
    assert received(listener, observer) == []
    watched = _ready(repo, how, t0)
    register_waiter(observer, watched)
    received(listener, observer)
    FINISHERS[how](repo, watched, t0)
    assert received(listener, observer) == [(FINISHED_CHANNEL, watched)]
    assert registrations(observer) == 0  # the run's end took its registration


@pytest.mark.usefixtures("no_poll")
@pytest.mark.parametrize("how", list(FINISHERS))
def test_a_waiter_arriving_while_the_finisher_holds_the_run_reads_it_ended(
    dsn: str, observer: Conn, listener: Conn, t0: datetime, how: str
) -> None:
    """The finisher locked the run (its statement ran, saw no registration) and has not
    committed: the registration waits for it, then the waiter reads the run as it ended."""
    with agent_runs.connect(dsn) as finisher_conn, agent_runs.connect(dsn) as waiter_conn:
        finisher = AgentRunRepository(finisher_conn)
        run_id = _ready(finisher, how, t0)
        received(listener, observer)
        outcome: list[object] = []
        with finisher_conn.transaction():
            FINISHERS[how](finisher, run_id, t0)
            thread = threading.Thread(
                target=lambda: outcome.append(wait_for_run(waiter_conn, run_id, timeout_seconds=30))
            )
            thread.start()
            wait_for_lock_waiters(observer, 1)  # the registration waits for the run row
        thread.join(30)
        assert not thread.is_alive()
        [run] = outcome
        assert run.is_terminal  # type: ignore[attr-defined]
        assert received(listener, observer) == []  # nobody had registered when it ended
        assert registrations(observer) == 0  # the waiter removed its own


@pytest.mark.parametrize("how", ["set_terminal_status", "finish_runs", "request_cancel"])
def test_a_finisher_waiting_behind_a_registration_sees_it_and_notifies(
    dsn: str, observer: Conn, listener: Conn, t0: datetime, how: str
) -> None:
    """The registration read the run (not ended) and holds it until it commits; the finisher's
    statement began before that commit, so only a fresh look at agent_run_waiters finds it."""
    with agent_runs.connect(dsn) as finisher_conn, agent_runs.connect(dsn) as waiter_conn:
        finisher = AgentRunRepository(finisher_conn)
        run_id = _ready(finisher, how, t0)
        received(listener, observer)
        thread = threading.Thread(target=FINISHERS[how], args=(finisher, run_id, t0))
        with waiter_conn.transaction():
            assert waiters.register(waiter_conn, run_id, waiters.new_waiter_id(), 60.0)
            thread.start()
            wait_for_lock_waiters(observer, 1)  # the finisher waits for the registration
        thread.join(30)
        assert not thread.is_alive()
        ended = finisher.get_run(run_id)
        assert ended is not None and ended.is_terminal
        # A run that was still pending when registered is announced claimable again first.
        announced = [(CLAIMABLE_CHANNEL, ended.agent_slug)] if how == "request_cancel" else []
        assert received(listener, observer) == [*announced, (FINISHED_CHANNEL, run_id)]
        assert registrations(observer) == 0


def test_the_reconciler_skips_a_run_being_registered_and_notifies_on_its_next_pass(
    repo: AgentRunRepository, dsn: str, observer: Conn, listener: Conn, t0: datetime
) -> None:
    run_id = _ready(repo, "reconcile_expired_leases", t0)
    received(listener, observer)
    with agent_runs.connect(dsn) as waiter_conn, waiter_conn.transaction():
        assert waiters.register(waiter_conn, run_id, waiters.new_waiter_id(), 60.0)
        assert repo.reconcile_expired_leases(now=t0 + timedelta(seconds=60)) == []
    [converged] = repo.reconcile_expired_leases(now=t0 + timedelta(seconds=60))
    assert converged.id == run_id
    assert received(listener, observer) == [(FINISHED_CHANNEL, run_id)]


@pytest.mark.usefixtures("no_poll")
def test_waiters_racing_finishers_are_all_woken(
    dsn: str, repo: AgentRunRepository, observer: Conn
) -> None:
    """Waits and ends started at random offsets of each other: every waiter returns the ended
    run well before its timeout, with no poll to fall back on."""
    count = 24
    ids = [_ready(repo, "set_terminal_status", datetime.now().astimezone()) for _ in range(count)]
    results: dict[str, object] = {}
    rng = random.Random(26)

    def wait(run_id: str) -> None:
        threading.Event().wait(rng.random() * 0.05)
        with agent_runs.connect(dsn) as conn:
            results[run_id] = wait_for_run(conn, run_id, timeout_seconds=20)

    def finish() -> None:
        with agent_runs.connect(dsn) as conn:
            finisher = AgentRunRepository(conn)
            for run_id in ids:
                threading.Event().wait(rng.random() * 0.004)
                assert finisher.set_terminal_status(run_id, status="completed", worker_id="w")

    threads = [threading.Thread(target=wait, args=(run_id,)) for run_id in ids]
    threads.append(threading.Thread(target=finish))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(results) == sorted(ids)
    assert all(run.status == RunStatus.COMPLETED for run in results.values())  # type: ignore[attr-defined]
    assert registrations(observer) == 0


# --- registrations do not pile up ---------------------------------------------------------


def test_a_waiter_that_times_out_removes_its_registration(
    dsn: str, repo: AgentRunRepository, observer: Conn, listener: Conn
) -> None:
    run = new_run(repo)
    with agent_runs.connect(dsn) as conn, pytest.raises(TimeoutError):
        wait_for_run(conn, run.id, timeout_seconds=0.1)
    assert registrations(observer) == 0
    received(listener, observer)
    repo.request_cancel(run.id)
    assert received(listener, observer) == []


def test_a_killed_waiters_registration_goes_with_the_runs_end(
    dsn: str, repo: AgentRunRepository, observer: Conn, listener: Conn
) -> None:
    run = new_run(repo)
    with psycopg.connect(dsn, autocommit=True) as doomed:
        register_waiter(doomed, run.id)
        pid = doomed.info.backend_pid
        observer.execute("SELECT pg_terminate_backend(%s)", (pid,))
    assert registrations(observer, run.id) == 1  # nobody unregistered it
    received(listener, observer)
    repo.request_cancel(run.id)
    assert received(listener, observer) == [(FINISHED_CHANNEL, run.id)]  # one spare wake-up
    assert registrations(observer) == 0


def test_expired_registrations_of_runs_that_never_end_are_deleted_by_later_waiters(
    dsn: str, repo: AgentRunRepository, observer: Conn
) -> None:
    stuck, live, other = new_run(repo), new_run(repo), new_run(repo)
    observer.execute(
        "INSERT INTO agent_run_waiters (run_id, waiter_id, expires_at)"
        " SELECT %s, 'killed-' || g, now() - interval '1 minute' FROM generate_series(1, 150) g",
        (stuck.id,),
    )
    register_waiter(observer, live.id)  # not expired: kept
    with agent_runs.connect(dsn) as conn:
        with pytest.raises(TimeoutError):
            wait_for_run(conn, other.id, timeout_seconds=0)
        assert registrations(observer, stuck.id) == 50  # a bounded batch per unregistration
        with pytest.raises(TimeoutError):
            wait_for_run(conn, other.id, timeout_seconds=0)
    assert registrations(observer, stuck.id) == 0
    assert registrations(observer, live.id) == 1


def test_no_registration_for_a_run_that_ended_or_does_not_exist(
    repo: AgentRunRepository, observer: Conn
) -> None:
    run = new_run(repo)
    repo.request_cancel(run.id)
    assert not waiters.register(observer, run.id, waiters.new_waiter_id(), 10.0)
    assert not waiters.register(observer, "no-such-run", waiters.new_waiter_id(), 10.0)
    assert registrations(observer) == 0


# --- bulk paths: one agent_runs_claimable per transaction and slug ---------------------------


def test_a_transaction_wakes_each_slug_once_however_many_runs_it_makes_claimable(
    repo: AgentRunRepository, conn: Conn, listener: Conn, observer: Conn
) -> None:
    with repo.transaction():
        runs = [new_run(repo, agent_slug=slug) for slug in ("a", "a", "a", "b", "b")]
    assert sorted(received(listener, observer)) == [
        (CLAIMABLE_CHANNEL, "a"),
        (CLAIMABLE_CHANNEL, "b"),
    ]
    for i, run in enumerate(runs):
        assert repo.mark_running(run.id, worker_id=f"w{i}", lease_seconds=60).acquired
    with repo.transaction():
        for i, run in enumerate(runs):
            assert repo.release_lease_for_retry(run.id, worker_id=f"w{i}")
    assert sorted(received(listener, observer)) == [
        (CLAIMABLE_CHANNEL, "a"),
        (CLAIMABLE_CHANNEL, "b"),
    ]


def test_cancelling_a_tree_of_released_runs_wakes_each_slug_once(
    repo: AgentRunRepository, listener: Conn, observer: Conn
) -> None:
    parent = new_run(repo, agent_slug="lead")
    children = [new_run(repo, agent_slug="sub", created_by_run_id=parent.id) for _ in range(4)]
    for i, run in enumerate([parent, *children]):
        assert repo.mark_running(run.id, worker_id=f"w{i}", lease_seconds=60).acquired
        assert repo.release_lease_for_retry(run.id, worker_id=f"w{i}")
    received(listener, observer)
    changed = repo.request_cancel_tree(parent.id)
    assert len(changed) == 5
    assert all(r.status == RunStatus.CANCEL_REQUESTED and r.worker_id is None for r in changed)
    assert sorted(received(listener, observer)) == [
        (CLAIMABLE_CHANNEL, "lead"),
        (CLAIMABLE_CHANNEL, "sub"),
    ]


def test_a_run_held_locked_past_the_timeout_times_the_waiter_out_registering_nothing(
    dsn: str, repo: AgentRunRepository, observer: Conn
) -> None:
    run = new_run(repo)
    with agent_runs.connect(dsn) as holder, holder.transaction():
        holder.execute("SELECT FROM agent_runs WHERE id = %s FOR UPDATE", (run.id,))
        with agent_runs.connect(dsn) as conn:
            with pytest.raises(TimeoutError, match="locked"):
                wait_for_run(conn, run.id, timeout_seconds=0.2)
            assert not conn.info.transaction_status  # idle, usable
            assert conn.execute("SHOW lock_timeout").fetchone() == ("0",)  # reset
    assert registrations(observer) == 0
