"""The worker runtime in-process: real threads, a real pool, a real database per test."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, RunStatus, create_pool
from agent_runs.agents import ScriptedAgent, step_for_attempt
from agent_runs.errors import InvalidArgument
from agent_runs.worker import AgentResult, RetryableError, RunContext, Worker
from tests.helpers import enqueue as enqueue_run
from tests.helpers import wait_until

LEASE = 1.0
HEARTBEAT = 0.1


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=1, max_size=8) as p:
        yield p


@pytest.fixture
def enqueue(repo: AgentRunRepository) -> Callable[..., AgentRun]:
    return functools.partial(enqueue_run, repo)


def make_worker(pool: ConnectionPool, agent: Any, **kwargs: Any) -> Worker:
    kwargs.setdefault("name", "test-worker")
    kwargs.setdefault("lease_seconds", LEASE)
    kwargs.setdefault("heartbeat_seconds", HEARTBEAT)
    kwargs.setdefault("poll_seconds", 0.05)
    return Worker(pool, agent, **kwargs)


def status_of(repo: AgentRunRepository, run_id: str) -> RunStatus:
    run = repo.get_run(run_id)
    assert run is not None
    return run.status


class Background:
    """run_once in a thread, so the test can act while the agent executes."""

    def __init__(self, worker: Worker) -> None:
        self.result: AgentRun | None = None
        self.thread = threading.Thread(target=self._run, args=(worker,))
        self.thread.start()

    def _run(self, worker: Worker) -> None:
        self.result = worker.run_once()

    def join(self, timeout: float = 10.0) -> AgentRun | None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "run_once did not return"
        return self.result


# -- outcomes --------------------------------------------------------------------------------


def test_run_once_returns_none_when_nothing_is_claimable(pool: ConnectionPool) -> None:
    with make_worker(pool, ScriptedAgent()) as worker:
        assert worker.run_once() is None


def test_a_completed_agent_completes_the_run_with_one_attempt(
    pool: ConnectionPool, repo: AgentRunRepository, enqueue: Callable[..., AgentRun]
) -> None:
    run = enqueue(["ok"])
    with make_worker(pool, ScriptedAgent()) as worker:
        ended = worker.run_once()
    assert ended is not None and ended.id == run.id
    assert ended.status == RunStatus.COMPLETED
    (attempt,) = repo.list_run_attempts(run.id)
    assert attempt.outcome == "completed"
    name, _, token = attempt.worker_id.partition(":")
    assert name == "test-worker" and len(token) == 32


def test_a_retryable_error_releases_the_run_and_the_next_claim_is_a_new_attempt(
    pool: ConnectionPool, repo: AgentRunRepository, enqueue: Callable[..., AgentRun]
) -> None:
    run = enqueue(["retry", "ok"])
    with make_worker(pool, ScriptedAgent()) as worker:
        first = worker.run_once()
        assert first is not None and first.status == RunStatus.PENDING
        second = worker.run_once()
    assert second is not None and second.status == RunStatus.COMPLETED
    attempts = repo.list_run_attempts(run.id)
    assert [(a.attempt_no, a.outcome) for a in attempts] == [
        (1, "retry_released"),
        (2, "completed"),
    ]
    assert attempts[0].worker_id != attempts[1].worker_id  # a fresh owner token per claim


def test_retries_are_exhausted_at_max_tries(
    pool: ConnectionPool, repo: AgentRunRepository, enqueue: Callable[..., AgentRun]
) -> None:
    run = enqueue(["retry"])
    with make_worker(pool, ScriptedAgent(), max_tries=2) as worker:
        worker.run_once()
        ended = worker.run_once()
        assert worker.run_once() is None
    assert ended is not None
    assert (ended.status, ended.error_type) == (RunStatus.FAILED, "retries_exhausted")
    assert "attempt 2 of 2" in (ended.error_message or "")
    assert [a.outcome for a in repo.list_run_attempts(run.id)] == ["retry_released", "failed"]


def test_an_unexpected_exception_fails_the_run_with_agent_error(
    pool: ConnectionPool, repo: AgentRunRepository, enqueue: Callable[..., AgentRun]
) -> None:
    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        raise KeyError("no such tool; -- '; DROP TABLE agent_runs")

    run = enqueue()
    with make_worker(pool, agent) as worker:
        ended = worker.run_once()
    assert ended is not None
    assert (ended.status, ended.error_type) == (RunStatus.FAILED, "agent_error")
    assert "KeyError" in (ended.error_message or "")
    assert "DROP TABLE" in (ended.error_message or "")  # data, never SQL
    (attempt,) = repo.list_run_attempts(run.id)
    assert (attempt.outcome, attempt.error_type) == ("failed", "agent_error")


@pytest.mark.parametrize(
    ("script", "status", "error_type"),
    [
        (["fail:bad_input"], RunStatus.FAILED, "bad_input"),
        (["interrupt"], RunStatus.INTERRUPTED, "interrupted"),
        (["sleep:0.05"], RunStatus.COMPLETED, None),
        ([], RunStatus.FAILED, "invalid_script"),
        (["dance"], RunStatus.FAILED, "invalid_script"),
    ],
)
def test_agent_results_map_to_terminal_statuses(
    pool: ConnectionPool,
    repo: AgentRunRepository,
    enqueue: Callable[..., AgentRun],
    *,
    script: list[str],
    status: RunStatus,
    error_type: str | None,
) -> None:
    run = enqueue(script)
    with make_worker(pool, ScriptedAgent()) as worker:
        ended = worker.run_once()
    assert ended is not None
    assert (ended.status, ended.error_type) == (status, error_type)
    (attempt,) = repo.list_run_attempts(run.id)
    assert (attempt.outcome, attempt.error_type) == (str(status), error_type)


def test_an_agent_returning_something_else_fails_the_run(
    pool: ConnectionPool, enqueue: Callable[..., AgentRun]
) -> None:
    enqueue()
    with make_worker(pool, lambda run, ctx: "done") as worker:
        ended = worker.run_once()
    assert ended is not None
    assert (ended.status, ended.error_type) == (RunStatus.FAILED, "agent_error")


def test_the_last_script_step_repeats() -> None:
    assert [step_for_attempt(["retry", "ok"], n) for n in (1, 2, 3)] == ["retry", "ok", "ok"]
    assert step_for_attempt("ok", 1) is None
    assert step_for_attempt([1], 1) is None


# -- cancel ----------------------------------------------------------------------------------


def test_a_claimed_run_already_cancel_requested_is_cancelled_without_running_the_agent(
    pool: ConnectionPool, repo: AgentRunRepository, enqueue: Callable[..., AgentRun]
) -> None:
    run = enqueue(["retry"])
    calls: list[str] = []

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        calls.append(run.id)
        raise RetryableError("again")

    with make_worker(pool, agent) as worker:
        worker.run_once()  # attempt 1 released: started, pending
        cancelled = repo.request_cancel(run.id)
        assert cancelled is not None and cancelled.status == RunStatus.CANCEL_REQUESTED
        ended = worker.run_once()
    assert calls == [run.id]
    assert ended is not None and ended.status == RunStatus.CANCELLED
    assert [a.outcome for a in repo.list_run_attempts(run.id)] == ["retry_released", "cancelled"]


def test_a_cancel_request_is_seen_by_the_heartbeat_and_ends_the_run_cancelled(
    pool: ConnectionPool, repo: AgentRunRepository, enqueue: Callable[..., AgentRun]
) -> None:
    run = enqueue(["wait_cancel"])
    with make_worker(pool, ScriptedAgent()) as worker:
        background = Background(worker)
        wait_until(lambda: status_of(repo, run.id) == RunStatus.RUNNING)
        repo.request_cancel(run.id)
        ended = background.join()
    assert ended is not None and ended.status == RunStatus.CANCELLED
    (attempt,) = repo.list_run_attempts(run.id)
    assert attempt.outcome == "cancelled"


def test_a_cancel_arriving_after_the_last_heartbeat_still_ends_cancelled(
    pool: ConnectionPool, repo: AgentRunRepository, enqueue: Callable[..., AgentRun]
) -> None:
    """The agent completes, but the run is cancel_requested: only `cancelled` is allowed."""
    run = enqueue()

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        repo.request_cancel(run.id)
        return AgentResult.completed()

    with make_worker(pool, agent, heartbeat_seconds=0.9) as worker:
        ended = worker.run_once()
    assert ended is not None and ended.status == RunStatus.CANCELLED
    assert [a.outcome for a in repo.list_run_attempts(run.id)] == ["cancelled"]


# -- heartbeats and leases -------------------------------------------------------------------


def test_one_heartbeat_thread_renews_every_lease_of_the_process(
    pool: ConnectionPool, repo: AgentRunRepository, enqueue: Callable[..., AgentRun]
) -> None:
    runs = [enqueue(["wait_cancel"]) for _ in range(3)]
    stop = threading.Event()
    with make_worker(pool, ScriptedAgent(), heartbeat_seconds=0.2) as worker:
        threads = [threading.Thread(target=worker.run_forever, args=(stop,)) for _ in range(3)]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: all(status_of(repo, r.id) == RunStatus.RUNNING for r in runs))
            first = {r.id: _lease_of(repo, r.id) for r in runs}
            rounds = worker.heartbeat.rounds
            wait_until(lambda: worker.heartbeat.rounds >= rounds + 3)
            for r in runs:
                assert _lease_of(repo, r.id) > first[r.id]  # renewed, longer than one lease
                (attempt,) = repo.list_run_attempts(r.id)
                assert attempt.lease_expires_at == _lease_of(repo, r.id)  # attempt moved too
            heartbeats = [t for t in threading.enumerate() if t.name == "agent-runs-heartbeat"]
            assert len(heartbeats) == 1
            for r in runs:
                repo.request_cancel(r.id)
            wait_until(lambda: all(status_of(repo, r.id) == RunStatus.CANCELLED for r in runs))
        finally:
            stop.set()
            for thread in threads:
                thread.join(10)
    assert len({repo.list_run_attempts(r.id)[0].worker_id for r in runs}) == 3


def _lease_of(repo: AgentRunRepository, run_id: str) -> datetime:
    run = repo.get_run(run_id)
    assert run is not None and run.lease_expires_at is not None
    return run.lease_expires_at


def test_a_refused_renewal_stops_the_agent_and_the_worker_writes_nothing(
    pool: ConnectionPool, repo: AgentRunRepository, enqueue: Callable[..., AgentRun]
) -> None:
    run = enqueue(["wait_cancel"])
    started = threading.Event()
    reasons: list[str | None] = []

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        started.set()
        while not ctx.wait(5):
            pass
        reasons.append(ctx.stop_reason())
        return AgentResult.completed()

    with make_worker(pool, agent) as worker:
        background = Background(worker)
        # The agent runs, not only the claim committed: a lease lost before the start is
        # seen there, and the agent is never called.
        assert started.wait(10)
        # Another process decided the lease is gone: the reconciler, with its clock moved on.
        (converged,) = repo.reconcile_expired_leases(now=datetime.now(UTC) + timedelta(hours=1))
        assert converged.id == run.id
        ended = background.join()
    assert reasons == ["lease_lost"]
    assert ended is not None and ended.status == RunStatus.FAILED
    assert ended.error_type == "worker_lease_expired"
    (attempt,) = repo.list_run_attempts(run.id)
    assert attempt.outcome == "lease_expired"


def test_a_hung_agent_s_late_completion_is_refused_by_the_repository(
    pool: ConnectionPool, repo: AgentRunRepository, enqueue: Callable[..., AgentRun]
) -> None:
    run = enqueue(["hang"])
    with make_worker(pool, ScriptedAgent(), lease_seconds=0.5, heartbeat_seconds=0.1) as worker:
        background = Background(worker)
        wait_until(lambda: status_of(repo, run.id) == RunStatus.RUNNING)
        ended = background.join()
    # The lease expired while the agent slept; its completion was refused, nothing changed.
    assert ended is not None and ended.status == RunStatus.RUNNING
    assert repo.set_terminal_status(run.id, status="completed", worker_id=ended.worker_id) == (
        ended,
        False,
    )
    (converged,) = repo.reconcile_expired_leases()
    assert (converged.status, converged.error_type) == ("failed", "worker_lease_expired")
    (attempt,) = repo.list_run_attempts(run.id)
    assert attempt.outcome == "lease_expired"


def test_renewals_that_keep_failing_drop_the_run_at_lease_expiry(
    pool: ConnectionPool, repo: AgentRunRepository, enqueue: Callable[..., AgentRun]
) -> None:
    """A failed renewal round does not prove the lease: at its expiry the agent is told to stop
    and the worker writes nothing, even though the database itself is reachable again."""
    run = enqueue(["wait_cancel"])
    reasons: list[str | None] = []

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        while not ctx.wait(5):
            pass
        reasons.append(ctx.stop_reason())
        return AgentResult.completed()

    # Renewals go to a server that does not exist; everything else to the real one.
    with (
        ConnectionPool(
            "postgresql://nobody@127.0.0.1:1/none",
            min_size=0,
            max_size=1,
            open=True,
            kwargs={"connect_timeout": 1},
        ) as dead,
        make_worker(pool, agent, lease_seconds=1.0, heartbeat_seconds=0.2) as worker,
    ):
        worker.heartbeat._pool = dead
        started = time.monotonic()
        ended = worker.run_once()
    assert reasons == ["lease_lost"]
    assert time.monotonic() - started < 5
    assert worker.heartbeat.failed_rounds >= 1
    assert ended is not None and ended.status == RunStatus.RUNNING  # untouched
    (attempt,) = repo.list_run_attempts(run.id)
    assert attempt.finished_at is None


def test_terminated_connections_do_not_stop_the_worker(
    pool: ConnectionPool,
    repo: AgentRunRepository,
    observer: psycopg.Connection[Any],
    enqueue: Callable[..., AgentRun],
) -> None:
    run = enqueue(["sleep:1.5"])
    with make_worker(pool, ScriptedAgent(), lease_seconds=2.0, heartbeat_seconds=0.2) as worker:
        background = Background(worker)
        wait_until(lambda: status_of(repo, run.id) == RunStatus.RUNNING)
        killed = _terminate_other_backends(observer, keep=repo)
        assert killed >= 1
        ended = background.join()
        assert ended is not None and ended.status == RunStatus.COMPLETED
        # The pool reconnected: the worker keeps working.
        again = enqueue(["ok"])
        _terminate_other_backends(observer, keep=repo)
        stop = threading.Event()
        loop = threading.Thread(target=worker.run_forever, args=(stop,))
        loop.start()
        try:
            wait_until(lambda: status_of(repo, again.id) == RunStatus.COMPLETED)
        finally:
            stop.set()
            loop.join(10)


def _terminate_other_backends(
    observer: psycopg.Connection[Any], *, keep: AgentRunRepository
) -> int:
    (keep_pid,) = keep.conn.execute("SELECT pg_backend_pid()").fetchone() or (0,)
    rows = observer.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid NOT IN (pg_backend_pid(), %s)",
        (keep_pid,),
    ).fetchall()
    return len(rows)


# -- stopping --------------------------------------------------------------------------------


def test_request_stop_releases_the_running_run_for_retry(
    pool: ConnectionPool, repo: AgentRunRepository, enqueue: Callable[..., AgentRun]
) -> None:
    run = enqueue(["sleep:30", "ok"])
    with make_worker(pool, ScriptedAgent()) as worker:
        background = Background(worker)
        wait_until(lambda: status_of(repo, run.id) == RunStatus.RUNNING)
        worker.request_stop()
        ended = background.join()
        assert worker.run_once() is None  # a stopping worker claims nothing
    assert ended is not None and ended.status == RunStatus.PENDING
    assert [a.outcome for a in repo.list_run_attempts(run.id)] == ["retry_released"]


def test_a_run_completed_while_stopping_is_recorded_completed(
    pool: ConnectionPool, enqueue: Callable[..., AgentRun]
) -> None:
    enqueue()
    worker = make_worker(pool, lambda run, ctx: AgentResult.completed())

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        worker.request_stop()
        return AgentResult.completed()

    worker.agent = agent
    with worker:
        ended = worker.run_once()
    assert ended is not None and ended.status == RunStatus.COMPLETED


def test_run_forever_claims_until_stopped_and_reconciles_expired_leases(
    pool: ConnectionPool, repo: AgentRunRepository, enqueue: Callable[..., AgentRun]
) -> None:
    stale = enqueue()
    assert repo.claim_next(worker_id="gone:1", lease_seconds=0.2) is not None  # never renewed
    runs = [enqueue(["ok"]) for _ in range(3)]
    stop = threading.Event()
    with make_worker(pool, ScriptedAgent()) as worker:
        loop = threading.Thread(target=worker.run_forever, args=(stop,))
        loop.start()
        try:
            wait_until(lambda: all(status_of(repo, r.id) == RunStatus.COMPLETED for r in runs))
            wait_until(lambda: status_of(repo, stale.id) == RunStatus.FAILED)
        finally:
            stop.set()
            loop.join(10)
        assert not loop.is_alive()
    converged = repo.get_run(stale.id)
    assert converged is not None and converged.error_type == "worker_lease_expired"


# -- context and configuration ---------------------------------------------------------------


def test_the_context_records_a_write_once_manifest(
    pool: ConnectionPool, repo: AgentRunRepository, enqueue: Callable[..., AgentRun]
) -> None:
    run = enqueue()
    seen: list[tuple[int, str, bool, bool]] = []

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        first = ctx.record_manifest({"model": "m-1", "tools": ["search"]})
        second = ctx.record_manifest({"model": "m-2"})
        seen.append((ctx.attempt_no, ctx.worker_id, first, second))
        return AgentResult.completed()

    with make_worker(pool, agent) as worker:
        worker.run_once()
    ((attempt_no, worker_id, first, second),) = seen
    assert (attempt_no, first, second) == (1, True, False)
    ended = repo.get_run(run.id)
    assert ended is not None and ended.manifest == {"model": "m-1", "tools": ["search"]}
    assert repo.list_run_attempts(run.id)[0].worker_id == worker_id


def test_agent_slugs_filter_what_the_worker_claims(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    other = repo.create_run(thread_id="t", agent_slug="other", uid="u", request_id="r-other")
    with make_worker(pool, ScriptedAgent(), agent_slugs=["agent"]) as worker:
        assert worker.run_once() is None
    assert status_of(repo, other.id) == RunStatus.PENDING


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lease_seconds": 0},
        {"lease_seconds": float("nan")},
        {"heartbeat_seconds": 5.0, "lease_seconds": 5.0},
        {"max_tries": 0},
        {"name": ""},
        {"name": "x" * 200},
        {"poll_seconds": -1},
    ],
)
def test_bad_worker_settings_are_refused(pool: ConnectionPool, kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        Worker(pool, ScriptedAgent(), **kwargs)


def test_default_heartbeat_is_a_third_of_the_lease(pool: ConnectionPool) -> None:
    worker = Worker(pool, ScriptedAgent(), lease_seconds=30)
    assert worker.heartbeat_seconds == 10
    assert worker.name  # host-pid by default
