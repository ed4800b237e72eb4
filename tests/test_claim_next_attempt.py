"""claim_next_attempt answers the attempt it opened, so the worker never reads it back, and a
claim whose reply is lost is found and executed with its attempt."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, RunStatus, create_pool
from agent_runs.worker import AgentResult, RunContext, Worker

OWNER = "lean-worker:1"


def _create(repo: AgentRunRepository, key: str) -> AgentRun:
    return repo.create_run(thread_id=key, agent_slug="a", uid="u", request_id=key)


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=1, max_size=2) as p:
        yield p


# --- claim_next_attempt ------------------------------------------------------------------------


def test_claim_next_attempt_answers_the_attempt_it_opened(
    repo: AgentRunRepository, t0: datetime
) -> None:
    assert repo.claim_next_attempt(worker_id=OWNER, lease_seconds=30, now=t0) is None
    run = _create(repo, "r1")
    claimed = repo.claim_next_attempt(worker_id=OWNER, lease_seconds=30, now=t0)
    assert claimed is not None
    got, attempt_no = claimed
    assert got == repo.get_run(run.id) and got.status == RunStatus.RUNNING
    assert attempt_no == 1
    opened = repo.get_open_attempt(run.id)
    assert opened is not None and (opened.attempt_no, opened.worker_id) == (1, OWNER)

    assert repo.release_lease_for_retry(run.id, worker_id=OWNER, now=t0 + timedelta(seconds=1))
    again = repo.claim_next_attempt(
        worker_id="other:2", lease_seconds=30, now=t0 + timedelta(seconds=2)
    )
    assert again is not None and again[1] == 2 and again[0].worker_id == "other:2"


def test_claim_next_attempt_after_an_expired_lease_counts_the_expired_attempt(
    repo: AgentRunRepository, t0: datetime
) -> None:
    run = _create(repo, "r1")
    assert repo.claim_next_attempt(worker_id=OWNER, lease_seconds=1, now=t0) is not None
    assert repo.request_cancel(run.id, now=t0) is not None  # running -> cancel_requested
    assert repo.reconcile_expired_leases(now=t0 + timedelta(seconds=5))
    # An ownerless cancel_requested run is claimable again; its claim opens attempt 2 or the
    # reconciler ended it: either way the answer matches the open attempt.
    claimed = repo.claim_next_attempt(
        worker_id="w:2", lease_seconds=30, now=t0 + timedelta(seconds=6)
    )
    opened = repo.get_open_attempt(run.id)
    if claimed is None:
        assert opened is None
    else:
        assert opened is not None and claimed[1] == opened.attempt_no


def test_claim_next_keeps_its_public_return_type(repo: AgentRunRepository, t0: datetime) -> None:
    run = _create(repo, "r1")
    claimed = repo.claim_next(worker_id=OWNER, lease_seconds=30, now=t0)
    assert isinstance(claimed, AgentRun) and claimed.id == run.id


# --- the worker ------------------------------------------------------------------------------


def _recording_agent(seen: list[int]) -> Any:
    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        seen.append(ctx.attempt_no)
        return AgentResult.completed()

    return agent


def test_the_worker_does_not_read_the_open_attempt_after_a_claim(
    pool: ConnectionPool, repo: AgentRunRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _create(repo, "r1")

    def refuse(self: AgentRunRepository, run_id: str) -> None:
        raise AssertionError("a second round trip after the claim")

    monkeypatch.setattr(AgentRunRepository, "get_open_attempt", refuse)
    seen: list[int] = []
    with Worker(pool, _recording_agent(seen), name="lean", lease_seconds=30) as worker:
        ended = worker.run_once()
    assert ended is not None and ended.status == RunStatus.COMPLETED
    assert seen == [1]
    attempts = repo.list_run_attempts(run.id)
    assert [(a.attempt_no, a.outcome) for a in attempts] == [(1, "completed")]


def test_a_claim_whose_reply_is_lost_is_found_and_executed_with_its_attempt(
    pool: ConnectionPool, repo: AgentRunRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim commits in the real database; only its answer never reaches the worker."""
    run = _create(repo, "r1")
    real = AgentRunRepository.claim_next_attempt
    lost: list[str] = []

    def claim_then_lose_the_reply(self: AgentRunRepository, **kwargs: Any) -> Any:
        claimed = real(self, **kwargs)
        if claimed is not None and not lost:
            lost.append(claimed[0].id)
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return claimed

    monkeypatch.setattr(AgentRunRepository, "claim_next_attempt", claim_then_lose_the_reply)
    seen: list[int] = []
    with Worker(pool, _recording_agent(seen), name="lean", lease_seconds=30) as worker:
        ended = worker.run_once()
    assert lost == [run.id]
    assert ended is not None and ended.status == RunStatus.COMPLETED
    assert seen == [1]
    assert [a.outcome for a in repo.list_run_attempts(run.id)] == ["completed"]
