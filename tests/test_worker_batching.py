"""The worker's batched claims and completions under real threads and real killed processes:
the same facts as one run at a time, lost replies found again, a crash mid-batch converged."""

from __future__ import annotations

import functools
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

from agent_runs import AgentRun, AgentRunRepository, RunStatus, create_pool
from agent_runs.worker import AgentResult, RunContext, Worker
from tests.helpers import enqueue, new_run, wait_until

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


def test_threads_that_finish_together_share_statements_and_keep_every_fact(
    pool: ConnectionPool, repo: AgentRunRepository, observer: Conn
) -> None:
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
        threads = [
            threading.Thread(target=worker.run_forever, args=(stop,)) for _ in range(THREADS)
        ]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: _finished(observer) == len(runs), timeout=60)
        finally:
            stop.set()
            for t in threads:
                t.join(10)
        claims, finishes = worker.claiming, worker.completer.finishing
    _one_completed_attempt_each(observer, runs)
    assert finishes.items == len(runs)
    assert finishes.batches < finishes.items  # some statements finished several runs
    assert claims.batches < claims.items


def _finished(observer: Conn) -> int:
    row = observer.execute(
        "SELECT count(*) FROM agent_runs WHERE finished_at IS NOT NULL"
    ).fetchone()
    assert row is not None
    return int(row[0])


def _finished_at_least(observer: Conn, n: int) -> bool:
    return _finished(observer) >= n


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


def _popen(dsn: str, out: Any) -> subprocess.Popen[bytes]:
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
