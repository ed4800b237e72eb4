"""The worker's batched claims and completions under real threads and real killed processes:
the same facts as one run at a time, lost replies found again, a crash mid-batch converged."""

from __future__ import annotations

import functools
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, InvalidArgument, RunStatus, create_pool
from agent_runs.worker import AgentResult, RunContext, Worker
from tests.helpers import enqueue, new_run, wait_for_lock_waiters, wait_until

Conn = psycopg.Connection[Any]
ROOT = Path(__file__).resolve().parents[1]
THREADS = 8


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=2, max_size=THREADS + 2) as p:
        yield p


def _one_completed_attempt_each(observer: Conn, run_ids: list[str]) -> None:
    rows = observer.execute(
        "SELECT r.status, count(a.id), bool_and(a.outcome = 'completed' AND a.attempt_no = 1)"
        " FROM agent_runs r JOIN agent_run_attempts a ON a.run_id = r.id"
        " WHERE r.id = ANY(%s) GROUP BY r.id",
        (run_ids,),
    ).fetchall()
    assert len(rows) == len(run_ids)
    assert set(rows) == {("completed", 1, True)}


@pytest.mark.parametrize("loop", ["run_forever", "run_once"])
def test_threads_that_finish_together_share_statements_and_keep_every_fact(
    pool: ConnectionPool,
    repo: AgentRunRepository,
    observer: Conn,
    loop: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="agent_runs.worker")
    runs = [new_run(repo).id for _ in range(THREADS * 6)]
    together = threading.Barrier(THREADS)

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        try:
            together.wait(timeout=2)  # the threads end their runs at the same moment
        except threading.BrokenBarrierError:
            together.reset()
        return AgentResult.completed()

    stop = threading.Event()
    with Worker(pool, agent, name="batch", lease_seconds=30, poll_seconds=0.05) as worker:

        def run_once_until_stopped() -> None:
            while not stop.is_set():
                if worker.run_once(stop=stop) is None:
                    stop.wait(0.05)

        threads = [
            threading.Thread(target=worker.run_forever, args=(stop,))
            if loop == "run_forever"
            else threading.Thread(target=run_once_until_stopped)
            for _ in range(THREADS)
        ]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: _finished(observer) == len(runs), timeout=60)
        finally:
            stop.set()
            for t in threads:
                t.join(10)
    _one_completed_attempt_each(observer, runs)
    if loop == "run_forever":  # the claimer claims, the writer thread writes the ends
        claims: Any = worker.claimer
        finishes: Any = worker.flusher
    else:  # the threads themselves, sharing statements when they coincide
        claims, finishes = worker.claiming, worker.completer.finishing
    assert finishes.items == len(runs)
    assert finishes.batches < finishes.items  # some statements finished several runs
    assert claims.items >= len(runs)
    assert claims.batches < claims.items
    if loop == "run_forever":  # the writer logs one line per batch, naming each run it wrote
        lines = [r.getMessage() for r in caplog.records if "written" in r.getMessage()]
        for run_id in runs:
            assert sum(f"run {run_id} " in line for line in lines) == 1, (run_id, lines)
        assert any(" ends written: " in line for line in lines), lines
        assert len(lines) == finishes.batches


def _finished(observer: Conn) -> int:
    row = observer.execute(
        "SELECT count(*) FROM agent_runs WHERE finished_at IS NOT NULL"
    ).fetchone()
    assert row is not None
    return int(row[0])


def _finished_at_least(observer: Conn, n: int) -> bool:
    return _finished(observer) >= n


def test_a_claim_that_waited_behind_a_slow_batch_holds_its_lease_from_its_own_statement(
    pool: ConnectionPool, repo: AgentRunRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease a worker proves starts when the claim's statement was sent, not when its
    thread started waiting: a claim queued behind a batch that took longer than a lease must
    not start its agent with a lease it already counts as expired."""
    for _ in range(2):
        new_run(repo)
    single = AgentRunRepository.claim_next_attempt
    worker_ref: list[Worker] = []
    slowed: list[bool] = []

    def first_claim_is_slow(self: AgentRunRepository, **kwargs: Any) -> Any:
        if not slowed:
            slowed.append(True)
            wait_until(lambda: worker_ref[0].claiming.waiting == 1, timeout=10)
            time.sleep(1.5)  # longer than the lease
        return single(self, **kwargs)

    monkeypatch.setattr(AgentRunRepository, "claim_next_attempt", first_claim_is_slow)
    at_start: dict[str, str | None] = {}

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        at_start[threading.current_thread().name] = ctx.stop_reason()
        return AgentResult.completed()

    with Worker(pool, agent, name="slow-batch", lease_seconds=1) as worker:
        worker_ref.append(worker)
        first = threading.Thread(target=worker.run_once, name="first")
        first.start()
        wait_until(lambda: bool(slowed), timeout=10)
        worker.run_once()  # queued behind the first thread's slow batch
        first.join(10)
    assert at_start[threading.current_thread().name] is None


def test_a_batched_claim_whose_reply_is_lost_is_found_by_each_owner(
    pool: ConnectionPool,
    repo: AgentRunRepository,
    observer: Conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs = [new_run(repo).id for _ in range(4)]
    single, batch = AgentRunRepository.claim_next_attempt, AgentRunRepository.claim_next_attempts
    worker_ref: list[Worker] = []
    lost: list[list[str]] = []

    def lone_claim_waits_for_the_others(self: AgentRunRepository, **kwargs: Any) -> Any:
        wait_until(lambda: worker_ref[0].claiming.waiting == 3, timeout=10)
        return single(self, **kwargs)

    def batch_then_lose_the_reply(self: AgentRunRepository, **kwargs: Any) -> Any:
        claimed = batch(self, **kwargs)
        lost.append([c.run.id for c in claimed])
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(AgentRunRepository, "claim_next_attempt", lone_claim_waits_for_the_others)
    monkeypatch.setattr(AgentRunRepository, "claim_next_attempts", batch_then_lose_the_reply)
    ended: list[AgentRun | None] = []
    with Worker(pool, lambda run, ctx: AgentResult.completed(), lease_seconds=30) as worker:
        worker_ref.append(worker)
        threads = [
            threading.Thread(target=lambda: ended.append(worker.run_once())) for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    assert lost == [runs[1:]]  # one lone claim, then a batch of three whose reply was lost
    assert sorted(run.id for run in ended if run is not None) == sorted(runs)
    assert {run.status for run in ended if run is not None} == {RunStatus.COMPLETED}
    _one_completed_attempt_each(observer, runs)


def test_a_batched_completion_whose_reply_is_lost_is_confirmed_not_written_twice(
    pool: ConnectionPool,
    repo: AgentRunRepository,
    observer: Conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = new_run(repo)
    real = AgentRunRepository.finish_runs
    lost: list[str] = []

    def finish_then_lose_the_reply(self: AgentRunRepository, *args: Any, **kwargs: Any) -> Any:
        finished = real(self, *args, **kwargs)
        lost.extend(finished)
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(AgentRunRepository, "finish_runs", finish_then_lose_the_reply)
    with Worker(pool, lambda r, ctx: AgentResult.completed(), lease_seconds=30) as worker:
        ended = worker.run_once()
    assert lost == [run.id]
    assert ended is not None and ended.status == RunStatus.COMPLETED
    _one_completed_attempt_each(observer, [run.id])


def test_the_run_a_batched_completion_returns_is_the_stored_one(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    run = new_run(repo)

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        assert ctx.record_manifest({"model": "m", "tools": ["a"]})
        return AgentResult.failed("tool_error", "bad\x00 tool")

    with Worker(pool, agent, lease_seconds=30) as worker:
        ended = worker.run_once()
    assert ended is not None and ended == repo.get_run(run.id)
    assert ended.manifest == {"model": "m", "tools": ["a"]}
    assert ended.error_message == "bad\ufffd tool"


# --- a worker process killed while it claims and completes in batches ---------------------------


def _worker_process(dsn: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return _popen(dsn, out)


def _popen(dsn: str, out: Any, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent_runs",
            "worker",
            "--dsn",
            dsn,
            "--concurrency",
            str(THREADS),
            "--lease-seconds",
            "2",
            "--name",
            "killed",
            *extra,
        ],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def test_worker_processes_killed_mid_batch_leave_only_explained_runs(
    dsn: str, repo: AgentRunRepository, observer: Conn, tmp_path: Path
) -> None:
    runs = [enqueue(repo, ["sleep:0.01"], agent_slug="scripted").id for _ in range(240)]
    log = tmp_path / "workers.log"
    for kill_after in (40, 100, 160):
        proc = _worker_process(dsn, log)
        try:
            wait_until(functools.partial(_finished_at_least, observer, kill_after), timeout=60)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    # The killed processes' leases expire; the reconciler converges what they held.
    time.sleep(2.1)
    repo.reconcile_expired_leases(now=datetime.now(UTC) + timedelta(seconds=1))
    proc = _worker_process(dsn, log)
    try:
        wait_until(lambda: _finished(observer) == len(runs), timeout=60)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, log.read_text(errors="replace")

    facts = observer.execute(
        "SELECT r.status, r.error_type, count(a.id), min(a.outcome), bool_and(a.finished_at"
        " IS NOT NULL) FROM agent_runs r JOIN agent_run_attempts a ON a.run_id = r.id"
        " GROUP BY r.id"
    ).fetchall()
    assert len(facts) == len(runs)  # every run has its one attempt
    explained = {
        ("completed", None, 1, "completed", True),
        ("failed", "worker_lease_expired", 1, "lease_expired", True),
    }
    assert set(facts) <= explained, set(facts) - explained
    lost = sum(1 for fact in facts if fact[0] == "failed")
    assert lost <= 3 * THREADS  # at most what each killed process held


# --- the opt-in asynchronous completion ----------------------------------------------------------


def test_async_completion_writes_every_end_by_close(
    pool: ConnectionPool, repo: AgentRunRepository, observer: Conn
) -> None:
    runs = [new_run(repo).id for _ in range(40)]
    ended: list[AgentRun] = []
    stop = threading.Event()
    worker = Worker(
        pool, lambda r, c: AgentResult.completed(), lease_seconds=30, completion="async"
    )
    try:

        def loop() -> None:
            while (run := worker.run_once(stop=stop)) is not None:
                ended.append(run)

        threads = [threading.Thread(target=loop) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        worker.close()  # writes what the flusher still holds
    flusher = worker.flusher
    assert flusher is not None and flusher.pending == 0 and flusher.items == len(runs)
    # The thread was told the decision before it was written: no finished_at yet.
    assert {(run.status, run.finished_at) for run in ended} == {(RunStatus.COMPLETED, None)}
    _one_completed_attempt_each(observer, runs)


def test_async_completion_still_explains_a_refusal(
    pool: ConnectionPool, repo: AgentRunRepository, observer: Conn, dsn: str
) -> None:
    """A cancel that arrives after the last heartbeat: the batch refuses `completed`, the
    one-run path sees the cancel request and ends the run `cancelled`."""
    run = new_run(repo)

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        with psycopg.connect(dsn, autocommit=True) as other:
            assert AgentRunRepository(other).request_cancel(run.id) is not None
        return AgentResult.completed()

    with Worker(pool, agent, lease_seconds=30, completion="async") as worker:
        told = worker.run_once()
    assert told is not None and told.status == RunStatus.COMPLETED  # the decision, not the fact
    stored = repo.get_run(run.id)
    assert stored is not None and stored.status == RunStatus.CANCELLED
    (attempt,) = repo.list_run_attempts(run.id)
    assert attempt.outcome == "cancelled"


def test_a_crash_before_the_async_flush_ends_the_run_through_the_reconciler(
    dsn: str, repo: AgentRunRepository, observer: Conn, tmp_path: Path
) -> None:
    """The documented loss window, made wide on purpose: the flush waits on a row lock held
    here while the worker's host dies (process killed, its connections cut). The run is never
    lost and never `completed`: the reconciler ends it failed / worker_lease_expired."""
    run = enqueue(repo, ["sleep:0.3"], agent_slug="scripted")
    log = tmp_path / "worker.log"
    with log.open("ab") as out:
        proc = _popen(dsn, out, "--completion", "async", "--log-level", "DEBUG")
    try:
        wait_until(lambda: _status(observer, run.id) == "running", timeout=30)
        with psycopg.connect(dsn) as blocker:
            blocker.execute("SELECT 1 FROM agent_runs WHERE id = %s FOR UPDATE", (run.id,))
            handed = "completed, handed to the flusher"
            wait_until(lambda: handed in log.read_text(errors="replace"), timeout=30)
            wait_for_lock_waiters(observer, 1)  # the flush (or a renewal) waits on our lock
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            # The host is gone with its connections: what they sent never commits.
            ours = [c.info.backend_pid for c in (observer, blocker, repo.conn)]
            observer.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND NOT pid = ANY(%s)",
                (ours,),
            )
            blocker.rollback()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert _status(observer, run.id) == "running"  # the end the thread was told never committed
    converged = repo.reconcile_expired_leases(now=datetime.now(UTC) + timedelta(seconds=3))
    assert [r.id for r in converged] == [run.id]
    assert converged[0].status == RunStatus.FAILED
    assert converged[0].error_type == "worker_lease_expired"
    (attempt,) = repo.list_run_attempts(run.id)
    assert attempt.outcome == "lease_expired" and "at-least-once" in (attempt.error_message or "")


def _status(observer: Conn, run_id: str) -> str:
    row = observer.execute("SELECT status FROM agent_runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return str(row[0])


def test_completion_must_be_durable_or_async(pool: ConnectionPool) -> None:
    with pytest.raises(InvalidArgument, match="completion"):
        Worker(pool, lambda r, c: AgentResult.completed(), completion="fast")


def test_an_end_handed_over_after_close_is_written_by_its_own_thread(
    pool: ConnectionPool, repo: AgentRunRepository, observer: Conn
) -> None:
    """A thread still executing when the worker closes writes its end itself (durably): the
    flusher, gone, takes nothing more."""
    run = new_run(repo)
    worker = Worker(
        pool, lambda r, c: AgentResult.completed(), lease_seconds=30, completion="async"
    )
    flusher = worker.flusher
    assert flusher is not None
    flusher.close()  # as close() would, while this thread is still executing
    try:
        ended = worker.run_once()
    finally:
        worker.close()
    assert ended is not None and ended.status == RunStatus.COMPLETED
    assert ended.finished_at is not None  # written, not handed over
    assert flusher.items == 0
    _one_completed_attempt_each(observer, [run.id])
