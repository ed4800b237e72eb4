"""Wake-ups over real LISTEN/NOTIFY: which transitions notify, when (at commit only), the
Wakeups listener handing one wake-up to one claimer, and wait_for_run."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

import agent_runs
from agent_runs import AgentRunRepository, InvalidArgument, RunStatus
from agent_runs import notify as notify_module
from agent_runs.notify import CLAIMABLE_CHANNEL, FINISHED_CHANNEL, Wakeups, wait_for_run
from tests.helpers import new_run, register_waiter, wait_until

Conn = psycopg.Connection[Any]
SENTINEL = "sentinel-end-of-batch"


@pytest.fixture
def listener(dsn: str) -> Iterator[Conn]:
    """A connection listening on both channels."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("LISTEN agent_runs_claimable")
        conn.execute("LISTEN agent_runs_finished")
        yield conn


def received(listener: Conn, sender: Conn) -> list[tuple[str, str]]:
    """Every notification committed before now: a sentinel is sent (and committed) last, and
    notifications arrive in commit order, so reading up to it needs no sleep."""
    sender.execute("SELECT pg_notify('agent_runs_finished', %s)", (SENTINEL,))
    got: list[tuple[str, str]] = []
    for item in listener.notifies(timeout=10):
        if item.payload == SENTINEL:
            return got
        got.append((item.channel, item.payload))
    raise AssertionError(f"the sentinel never arrived; got {got}")


# Each transition as the repository runs it: prepared (custom, then generic plans) or classic.
CONNECT_OPTIONS: dict[str, dict[str, Any]] = {
    "prepared": {},
    "generic-plan": {"options": "-c plan_cache_mode=force_generic_plan"},
    "no-prepare": {"prepare_threshold": None},
}


@pytest.fixture(params=list(CONNECT_OPTIONS))
def any_repo(request: pytest.FixtureRequest, dsn: str) -> Iterator[AgentRunRepository]:
    with agent_runs.connect(dsn, **CONNECT_OPTIONS[request.param]) as conn:
        yield AgentRunRepository(conn)


# --- which transitions notify ------------------------------------------------------------


def test_create_run_notifies_at_commit_and_never_for_a_repeat_or_a_rollback(
    repo: AgentRunRepository, conn: Conn, listener: Conn, observer: Conn
) -> None:
    with conn.transaction():
        run = new_run(repo, agent_slug="support")
        assert received(listener, observer) == []  # not before the run is visible
    assert received(listener, observer) == [(CLAIMABLE_CHANNEL, "support")]

    again = new_run(repo, agent_slug="support", request_id=run.request_id)
    assert again.id == run.id
    assert received(listener, observer) == []  # an idempotent repeat creates nothing

    with conn.transaction(force_rollback=True):
        new_run(repo, agent_slug="support")
    assert received(listener, observer) == []  # a rolled-back create wakes nobody


def test_release_and_terminal_transitions_notify_and_the_hot_path_does_not(
    any_repo: AgentRunRepository, listener: Conn, observer: Conn
) -> None:
    repo = any_repo
    run = new_run(repo, agent_slug="writer")
    assert received(listener, observer) == [(CLAIMABLE_CHANNEL, "writer")]

    claimed = repo.claim_next(worker_id="w1", lease_seconds=60)
    assert claimed is not None and claimed.id == run.id
    assert repo.renew_lease(run.id, worker_id="w1", lease_seconds=60)
    assert repo.renew_leases({run.id: "w1"}, lease_seconds=60)
    assert received(listener, observer) == []  # claims and renewals send nothing

    assert not repo.release_lease_for_retry(run.id, worker_id="intruder")
    assert received(listener, observer) == []
    assert repo.release_lease_for_retry(run.id, worker_id="w1")
    assert received(listener, observer) == [(CLAIMABLE_CHANNEL, "writer")]

    assert repo.mark_running(run.id, worker_id="w2", lease_seconds=60).acquired
    refused = repo.set_terminal_status(run.id, status="completed", worker_id="intruder")
    assert not refused.changed
    assert received(listener, observer) == []
    register_waiter(observer, run.id)  # the end of a run nobody waits for sends nothing
    done = repo.set_terminal_status(run.id, status="completed", worker_id="w2")
    assert done.changed
    assert received(listener, observer) == [(FINISHED_CHANNEL, run.id)]
    repo.set_terminal_status(run.id, status="failed", worker_id="w2")  # already terminal
    assert received(listener, observer) == []


def test_request_cancel_notifies_by_what_it_leaves(
    any_repo: AgentRunRepository, listener: Conn, observer: Conn
) -> None:
    repo = any_repo
    never_started, owned, released = (new_run(repo, agent_slug=s) for s in ("a", "b", "c"))
    unwatched = new_run(repo, agent_slug="d")
    received(listener, observer)

    gone = repo.request_cancel(unwatched.id)
    assert gone is not None and gone.status == RunStatus.CANCELLED
    assert received(listener, observer) == []  # nobody waits for it

    register_waiter(observer, never_started.id)
    # A registration announces a claimable run again: a claimer that skipped the row while the
    # registration held it (SKIP LOCKED) is woken once the lock is released.
    assert received(listener, observer) == [(CLAIMABLE_CHANNEL, "a")]
    cancelled = repo.request_cancel(never_started.id)
    assert cancelled is not None and cancelled.status == RunStatus.CANCELLED
    assert received(listener, observer) == [(FINISHED_CHANNEL, never_started.id)]

    assert repo.mark_running(owned.id, worker_id="w", lease_seconds=60).acquired
    asked = repo.request_cancel(owned.id)
    assert asked is not None and asked.status == RunStatus.CANCEL_REQUESTED
    assert received(listener, observer) == []  # its owner sees it on its next heartbeat

    assert repo.mark_running(released.id, worker_id="w", lease_seconds=60).acquired
    assert repo.release_lease_for_retry(released.id, worker_id="w")
    received(listener, observer)
    ownerless = repo.request_cancel(released.id)
    assert ownerless is not None and ownerless.status == RunStatus.CANCEL_REQUESTED
    assert ownerless.worker_id is None
    assert received(listener, observer) == [(CLAIMABLE_CHANNEL, "c")]  # a claimer finishes it

    assert repo.request_cancel(released.id) is not None  # unchanged: nothing to say
    assert received(listener, observer) == []


def test_each_waited_for_run_the_reconciler_converges_notifies_finished(
    any_repo: AgentRunRepository, listener: Conn, observer: Conn, t0: datetime
) -> None:
    repo = any_repo
    runs = [new_run(repo) for _ in range(4)]
    for i, run in enumerate(runs[:3]):
        assert repo.mark_running(run.id, worker_id=f"w{i}", lease_seconds=5, now=t0).acquired
    for run in (runs[0], runs[1], runs[3]):
        register_waiter(observer, run.id)
    received(listener, observer)
    converged = repo.reconcile_expired_leases(now=t0 + timedelta(seconds=10))
    assert sorted(r.id for r in converged) == sorted(r.id for r in runs[:3])
    assert sorted(received(listener, observer)) == sorted(
        (FINISHED_CHANNEL, r.id)
        for r in runs[:2]  # runs[2]: converged, nobody waits
    )
    assert repo.reconcile_expired_leases(now=t0 + timedelta(seconds=10)) == []
    assert received(listener, observer) == []


# --- Wakeups ------------------------------------------------------------------------------


@pytest.fixture
def make_wakeups(dsn: str) -> Iterator[Callable[..., Wakeups]]:
    started: list[Wakeups] = []

    def make(**kwargs: Any) -> Wakeups:
        wakeups = Wakeups(dsn, **kwargs)
        wakeups.start()
        started.append(wakeups)
        # Every (re)connect posts one catch-up wake-up: take it, so each test starts empty.
        assert wakeups.wait(10)
        assert wakeups.listening
        return wakeups

    yield make
    for wakeups in started:
        wakeups.close()


def test_a_wakeup_is_delivered_after_commit_only(
    make_wakeups: Callable[..., Wakeups], repo: AgentRunRepository, conn: Conn
) -> None:
    wakeups = make_wakeups()
    with conn.transaction(force_rollback=True):
        new_run(repo)
    with conn.transaction():
        new_run(repo)
        assert not wakeups.wait(0)  # nothing pending before the commit
    assert wakeups.wait(10)
    assert not wakeups.wait(0)  # the rolled-back create posted nothing


def test_wakeups_for_other_slugs_are_ignored(
    make_wakeups: Callable[..., Wakeups], repo: AgentRunRepository
) -> None:
    wakeups = make_wakeups(agent_slugs=["mine", "also-mine"])
    new_run(repo, agent_slug="theirs")
    new_run(repo, agent_slug="mine")
    # Notifications arrive in commit order: once the second is taken, the first was seen.
    assert wakeups.wait(10)
    assert not wakeups.wait(0)
    new_run(repo, agent_slug="also-mine")
    assert wakeups.wait(10)


def test_a_wakeup_with_no_claimer_waiting_is_kept_for_the_next_wait(
    make_wakeups: Callable[..., Wakeups], repo: AgentRunRepository
) -> None:
    wakeups = make_wakeups()
    for _ in range(3):
        new_run(repo)
    # The third notification (in commit order) has arrived once three tokens were taken.
    assert [wakeups.wait(10) for _ in range(3)] == [True, True, True]
    assert not wakeups.wait(0)


def test_pending_wakeups_are_bounded(dsn: str) -> None:
    wakeups = Wakeups(dsn, max_pending=2)  # not started: only the token bookkeeping
    for _ in range(5):
        wakeups._post()
    assert [wakeups.wait(0) for _ in range(3)] == [True, True, False]


@pytest.mark.parametrize(("burst", "claimers"), [(1, 4), (2, 5)])
def test_each_wakeup_releases_exactly_one_waiting_claimer(
    make_wakeups: Callable[..., Wakeups], repo: AgentRunRepository, burst: int, claimers: int
) -> None:
    wakeups = make_wakeups()
    results: list[bool] = []
    lock = threading.Lock()

    def claimer() -> None:
        woke = wakeups.wait(30)
        with lock:
            results.append(woke)

    threads = [threading.Thread(target=claimer) for _ in range(claimers)]
    for thread in threads:
        thread.start()
    for _ in range(burst):
        new_run(repo)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with lock:
            if results.count(True) >= burst:
                break
        time.sleep(0.01)
    wakeups.interrupt()  # shutdown: every other claimer returns now, without a wake-up
    for thread in threads:
        thread.join(10)
    assert sorted(results) == [False] * (claimers - burst) + [True] * burst
    assert not wakeups.wait(10)  # interrupted: later waits return False at once


def test_a_dropped_listener_reconnects_and_posts_a_catch_up_wakeup(
    make_wakeups: Callable[..., Wakeups],
    repo: AgentRunRepository,
    observer: Conn,
    caplog: pytest.LogCaptureFixture,
) -> None:
    wakeups = make_wakeups()
    pids = _listener_pids(observer)
    assert len(pids) == 1
    with caplog.at_level(logging.INFO, logger="agent_runs.notify"):
        observer.execute("SELECT pg_terminate_backend(%s)", (pids[0],))
        # Nothing was created: the only wake-up there can be is the reconnect's catch-up.
        assert wakeups.wait(30)
        assert wakeups.listening
        deadline = time.monotonic() + 10  # the terminated backend may linger a moment
        while pids[0] in _listener_pids(observer) and time.monotonic() < deadline:
            time.sleep(0.02)
        new_pids = _listener_pids(observer)
        assert len(new_pids) == 1 and new_pids != pids
        new_run(repo)  # and the new connection listens
        assert wakeups.wait(10)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].exc_info is None
    assert "reconnecting" in warnings[0].getMessage()


def _listener_pids(observer: Conn) -> list[int]:
    rows = observer.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND query = 'LISTEN agent_runs_claimable' AND pid <> pg_backend_pid()"
    ).fetchall()
    return [int(row[0]) for row in rows]


def test_close_stops_the_listener_and_releases_its_connection(dsn: str, observer: Conn) -> None:
    wakeups = Wakeups(dsn)
    wakeups.start()
    assert wakeups.wait(10)
    assert len(_listener_pids(observer)) == 1
    wakeups.close()
    assert not wakeups.listening
    assert not wakeups.wait(10)
    deadline = time.monotonic() + 10
    while _listener_pids(observer) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _listener_pids(observer) == []


# --- wait_for_run -------------------------------------------------------------------------


@pytest.fixture
def waiter(dsn: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Conn]:
    """The waiting caller's connection. Its poll fallback is pushed past the test timeouts, so
    these tests pass only through the notification."""
    monkeypatch.setattr(notify_module, "WAIT_POLL_SECONDS", 60.0)
    with agent_runs.connect(dsn) as conn:
        yield conn


def _later(action: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        time.sleep(0.2)  # let the waiter block first (either order is correct)
        action()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _listening_channels(conn: Conn) -> list[str]:
    return [row[0] for row in conn.execute("SELECT pg_listening_channels()").fetchall()]


def test_wait_for_run_returns_when_the_run_completes(
    waiter: Conn, repo: AgentRunRepository
) -> None:
    run = new_run(repo)
    assert repo.mark_running(run.id, worker_id="w", lease_seconds=60).acquired
    thread = _later(lambda: repo.set_terminal_status(run.id, status="completed", worker_id="w"))
    done = wait_for_run(waiter, run.id, timeout_seconds=30)
    thread.join()
    assert done.id == run.id and done.status == RunStatus.COMPLETED
    assert _listening_channels(waiter) == []  # never listened: idle and usable


def test_wait_for_run_returns_when_a_never_started_run_is_cancelled(
    waiter: Conn, repo: AgentRunRepository
) -> None:
    run = new_run(repo)
    thread = _later(lambda: repo.request_cancel(run.id))
    done = wait_for_run(waiter, run.id, timeout_seconds=30)
    thread.join()
    assert done.status == RunStatus.CANCELLED


def test_wait_for_run_returns_when_the_reconciler_fails_the_run(
    waiter: Conn, repo: AgentRunRepository, t0: datetime
) -> None:
    run = new_run(repo)
    assert repo.mark_running(run.id, worker_id="w", lease_seconds=5, now=t0).acquired
    thread = _later(lambda: repo.reconcile_expired_leases(now=t0 + timedelta(seconds=10)))
    done = wait_for_run(waiter, run.id, timeout_seconds=30)
    thread.join()
    assert done.status == RunStatus.FAILED
    assert done.error_type == "worker_lease_expired"


def test_wait_for_run_ignores_other_runs_and_returns_a_finished_run_at_once(
    waiter: Conn, repo: AgentRunRepository
) -> None:
    run, other = new_run(repo), new_run(repo)

    def finish_both() -> None:
        repo.request_cancel(other.id)
        time.sleep(0.1)
        repo.request_cancel(run.id)

    thread = _later(finish_both)
    assert wait_for_run(waiter, run.id, timeout_seconds=30).status == RunStatus.CANCELLED
    thread.join()
    assert wait_for_run(waiter, other.id, timeout_seconds=0).status == RunStatus.CANCELLED


def test_wait_for_run_times_out_and_leaves_the_connection_usable(
    waiter: Conn, repo: AgentRunRepository
) -> None:
    run = new_run(repo)
    with pytest.raises(TimeoutError, match="pending"):
        wait_for_run(waiter, run.id, timeout_seconds=0.3)
    with pytest.raises(TimeoutError):
        wait_for_run(waiter, run.id, timeout_seconds=0)
    assert _listening_channels(waiter) == []
    assert AgentRunRepository(waiter).get_run(run.id) == repo.get_run(run.id)


def test_wait_for_run_polls_when_no_notification_comes(
    dsn: str, repo: AgentRunRepository, observer: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(notify_module, "WAIT_POLL_SECONDS", 0.05)
    run = new_run(repo)

    def finish_silently() -> None:  # as if the notification was lost (e.g. behind a pooler)
        observer.execute(
            "UPDATE agent_runs SET status = 'cancelled', finished_at = now() WHERE id = %s",
            (run.id,),
        )

    thread = _later(finish_silently)
    with agent_runs.connect(dsn) as conn:
        done = wait_for_run(conn, run.id, timeout_seconds=30)
    thread.join()
    assert done.status == RunStatus.CANCELLED


@pytest.mark.parametrize(
    ("run_id", "timeout", "match"),
    [
        ("no-such-run", 1.0, "no such run"),
        ("", 1.0, "run_id"),
        ("x" * 65, 1.0, "run_id"),
        ("a\x00b", 1.0, "run_id"),
        ("ok", -1, "timeout_seconds"),
        ("ok", float("nan"), "timeout_seconds"),
        ("ok", float("inf"), "timeout_seconds"),
        ("ok", "5", "timeout_seconds"),
        ("ok", True, "timeout_seconds"),
    ],
)
def test_wait_for_run_refuses_bad_arguments_and_unknown_runs(
    waiter: Conn, run_id: str, timeout: Any, match: str
) -> None:
    with pytest.raises(InvalidArgument, match=match):
        wait_for_run(waiter, run_id, timeout_seconds=timeout)
    assert _listening_channels(waiter) == []


def test_wait_for_run_refuses_a_connection_inside_a_transaction(dsn: str) -> None:
    with psycopg.connect(dsn) as conn, pytest.raises(InvalidArgument, match="autocommit"):
        wait_for_run(conn, "any", timeout_seconds=1)


# --- agent-runs wait ----------------------------------------------------------------------


def _cli(*argv: str) -> int:
    from agent_runs.cli.main import main

    return main(list(argv))


def test_cli_wait_prints_the_final_status_and_why(
    dsn: str, repo: AgentRunRepository, capsys: pytest.CaptureFixture[str]
) -> None:
    run = new_run(repo)
    assert repo.mark_running(run.id, worker_id="w", lease_seconds=60).acquired
    thread = _later(lambda: repo.set_terminal_status(run.id, status="completed", worker_id="w"))
    assert _cli("wait", run.id, "--dsn", dsn, "--timeout", "30") == 0
    thread.join()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{run.id}  completed"
    assert out[1].startswith("completed: attempt 1 by w")


def test_cli_wait_exits_1_for_any_other_final_status_and_prints_json(
    dsn: str, repo: AgentRunRepository, capsys: pytest.CaptureFixture[str]
) -> None:
    run = new_run(repo)
    thread = _later(lambda: repo.request_cancel(run.id))
    assert _cli("wait", run.id, "--dsn", dsn, "--json") == 1
    thread.join()
    document = json.loads(capsys.readouterr().out)
    assert document["run"]["id"] == run.id
    assert document["run"]["status"] == "cancelled"
    assert document["attempts"] == []
    assert "before it ever started" in document["explanation"]


def test_cli_wait_exits_124_on_timeout_and_2_on_bad_input(
    dsn: str, repo: AgentRunRepository, capsys: pytest.CaptureFixture[str]
) -> None:
    run = new_run(repo)
    assert _cli("wait", run.id, "--dsn", dsn, "--timeout", "0.2") == 124
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1 and "pending" in captured.err
    assert _cli("wait", "no-such-run", "--dsn", dsn, "--timeout", "1") == 2
    assert "no such run" in capsys.readouterr().err
    for bad in ("-1", "nan", "soon"):
        assert _cli("wait", run.id, "--dsn", dsn, "--timeout", bad) == 2
    assert _cli("wait", "", "--dsn", dsn, "--timeout", "1") == 2


def test_wake_ups_kept_for_claimers_to_come_are_limited(dsn: str) -> None:
    """A burst while every claimer is busy leaves one wake-up per claimer, not one per run."""
    wakeups = Wakeups(dsn)
    wakeups.limit_pending(2)
    wakeups.start()
    try:
        wait_until(lambda: wakeups.listening)
        with agent_runs.connect(dsn) as conn:
            repo = AgentRunRepository(conn)
            for n in range(20):
                repo.create_run(thread_id=f"t{n}", agent_slug="a", uid="u", request_id=f"r{n}")
        time.sleep(0.5)  # every notification has arrived
        taken = 0
        while wakeups.wait(0.2):
            taken += 1
        assert taken == 2
    finally:
        wakeups.close()
