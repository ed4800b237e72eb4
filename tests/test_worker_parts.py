"""The worker's parts alone, against the real database, each built from the parts it uses (no
Worker): the claim statements and their lost-reply search, the claim source, the writer and
the executor."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, Finish, RunStatus, create_pool
from agent_runs.worker.checkout import repositories
from agent_runs.worker.claimer import Claimer
from agent_runs.worker.claims import Claiming
from agent_runs.worker.completer import Completer, release_unstarted
from agent_runs.worker.executor import Executor
from agent_runs.worker.flusher import Flusher
from agent_runs.worker.heartbeat import HeartbeatService
from agent_runs.worker.lease import Claimed, Lease
from agent_runs.worker.outcome import Decision
from agent_runs.worker.protocol import AgentResult, LeasedCalls, RunContext
from tests.helpers import new_run, wait_for_lock_waiters, wait_until

Conn = psycopg.Connection[Any]
LEASE = 30.0


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=1, max_size=4) as p:
        yield p


@pytest.fixture
def heartbeat(pool: ConnectionPool) -> Iterator[HeartbeatService]:
    service = HeartbeatService(pool, lease_seconds=LEASE, interval=3600, timeout=5)
    try:
        yield service
    finally:
        service.close()


def _claiming(pool: ConnectionPool, heartbeat: HeartbeatService) -> Claiming:
    return Claiming(
        repositories(pool, timeout=5, telemetry=None),
        heartbeat,
        name="parts",
        lease_seconds=LEASE,
        retry_cap=0.2,
        agent_slugs=None,
        stopping=threading.Event(),
    )


def _completer(pool: ConnectionPool) -> Completer:
    repository = repositories(pool, timeout=5, telemetry=None)
    return Completer(repository, lease_seconds=LEASE, retry_cap=0.2)


# --- the claim statements --------------------------------------------------------------------


def test_the_lost_reply_search_keeps_a_run_found_after_a_token_that_got_none(
    pool: ConnectionPool, repo: AgentRunRepository, heartbeat: HeartbeatService
) -> None:
    """A statement numbers its candidates before it drops those over their key's limit: the
    second token gets no run, the third does. The search looks up every token."""
    repo.set_limit("k", 1)
    first = new_run(repo, concurrency_key="k")
    new_run(repo, concurrency_key="k")  # over the key's limit within the statement
    unlimited = new_run(repo)
    claims = _claiming(pool, heartbeat)
    tokens = [claims.token() for _ in range(3)]
    claimed_at = time.monotonic()
    answer = repo.claim_next_attempts(worker_ids=tokens, lease_seconds=LEASE)  # reply "lost"
    assert [c.run.worker_id for c in answer] == [tokens[0], tokens[2]]

    found = claims.recover(tokens, claimed_at)

    assert [(c.run.id, c.lease.worker_id) for c in found] == [
        (first.id, tokens[0]),
        (unlimited.id, tokens[2]),
    ]
    assert all(c.attempt_no is None for c in found)  # the executor reads its attempt
    assert heartbeat.renew_once() and all(c.lease.provable() for c in found)  # tracked


def test_the_lost_reply_search_finds_nothing_for_tokens_that_claimed_nothing(
    pool: ConnectionPool, heartbeat: HeartbeatService
) -> None:
    claims = _claiming(pool, heartbeat)
    assert claims.recover([claims.token(), claims.token()], time.monotonic()) == []


def test_claims_for_slots_track_each_lease_before_answering(
    pool: ConnectionPool, repo: AgentRunRepository, heartbeat: HeartbeatService
) -> None:
    runs = [new_run(repo).id for _ in range(3)]
    claims = _claiming(pool, heartbeat)
    claimed = claims.for_slots(5)
    assert [c.run.id for c in claimed] == runs  # oldest first, no more than there are
    assert {c.attempt_no for c in claimed} == {1}
    assert len({c.lease.worker_id for c in claimed}) == 3  # a token each
    for one in claimed:
        assert heartbeat.track(one.run.id, one.lease.worker_id, deadline=0) is one.lease


# --- the claim source ------------------------------------------------------------------------


def test_the_claim_source_claims_with_ends_for_the_slots_already_free_too(
    pool: ConnectionPool, repo: AgentRunRepository, heartbeat: HeartbeatService
) -> None:
    """Three slots, one run held: the writer's statement is asked for the ending slot and the
    two free ones (reserved, so the claimer thread leaves them alone meanwhile)."""
    held = new_run(repo)
    claims = _claiming(pool, heartbeat)
    asked: list[int] = []

    def with_ends(
        finishes: list[Finish], count: int
    ) -> tuple[list[datetime | None] | None, list[Claimed]]:
        asked.append(count)
        return claims.with_ends(finishes, count)

    stop = threading.Event()
    source = Claimer(
        claims.for_slots,
        release=lambda runs: None,
        stopping=threading.Event(),
        poll_seconds=60,  # idle after its first claim: only the writer claims from then on
        close_timeout=5,
        claim_with_ends=with_ends,
    )
    slots = [source.join(stop) for _ in range(3)]
    try:
        first = source.take(10)
        assert first is not None and first.run.id == held.id
        wait_until(lambda: source.batches == 1)  # the claimer thread claimed, then went idle
        later = [new_run(repo).id for _ in range(3)]
        finish = Finish(first.run.id, first.lease.worker_id, RunStatus.COMPLETED)
        answer = source.claim_with_ends([finish])
        assert asked == [3]
        assert answer is not None
        finished, settled = answer
        assert finished is not None and finished[0] is not None and settled == 1
        next_run = source.take(10)
        assert next_run is not None and next_run.run.id == later[0]
    finally:
        stop.set()
        for slot in slots:
            source.leave(slot)
        source.close()
    stored = repo.get_run(held.id)
    assert stored is not None and stored.status == RunStatus.COMPLETED


def test_the_claim_source_releases_what_nobody_will_take(
    pool: ConnectionPool, repo: AgentRunRepository, heartbeat: HeartbeatService
) -> None:
    run = new_run(repo)
    claims = _claiming(pool, heartbeat)
    completer = _completer(pool)
    stop = threading.Event()
    source = Claimer(
        claims.for_slots,
        release=lambda runs: release_unstarted(runs, completer=completer, heartbeat=heartbeat),
        stopping=threading.Event(),
        poll_seconds=60,
        close_timeout=5,
    )
    slot = source.join(stop)
    wait_until(lambda: source.items == 1)
    stop.set()
    source.leave(slot)  # the last thread left: its queued run is released for retry
    source.close()
    stored = repo.get_run(run.id)
    assert stored is not None and stored.status == RunStatus.PENDING
    (attempt,) = repo.list_run_attempts(run.id)
    assert attempt.outcome == "retry_released"


# --- the writer and the executor -------------------------------------------------------------


def test_the_writer_writes_handed_ends_and_gives_their_slots_back(
    pool: ConnectionPool, repo: AgentRunRepository, heartbeat: HeartbeatService
) -> None:
    runs = [new_run(repo).id for _ in range(4)]
    claims = _claiming(pool, heartbeat)
    writer = Flusher(_completer(pool), heartbeat, max_batch=16)
    try:
        for one in claims.for_slots(4):
            assert writer.hand(one.run, one.lease, Decision(RunStatus.COMPLETED), "run")
        wait_until(lambda: writer.items == 4 and writer.pending == 0)
    finally:
        writer.close()
    for run_id in runs:
        stored = repo.get_run(run_id)
        assert stored is not None and stored.status == RunStatus.COMPLETED


def test_an_end_is_written_while_another_batch_waits_on_the_database(
    pool: ConnectionPool, repo: AgentRunRepository, heartbeat: HeartbeatService, dsn: str
) -> None:
    """Two writer threads: a batch held up (here by a row lock) does not hold up the next."""
    claims = _claiming(pool, heartbeat)
    new_run(repo)
    new_run(repo)
    first, second = claims.for_slots(2)
    writer = Flusher(_completer(pool), heartbeat, max_batch=16)
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT 1 FROM agent_runs WHERE id = %s FOR UPDATE", (first.run.id,))
        try:
            writer.hand(first.run, first.lease, Decision(RunStatus.COMPLETED), "first")
            with psycopg.connect(dsn, autocommit=True) as watcher:
                wait_for_lock_waiters(watcher, 1)  # the first batch waits for the row
            writer.hand(second.run, second.lease, Decision(RunStatus.COMPLETED), "second")
            assert writer.wait_written(second.lease, timeout=10)
            held = repo.get_run(first.run.id)
            assert held is not None and held.status == RunStatus.RUNNING
        finally:
            holder.rollback()
        try:
            assert writer.wait_written(first.lease, timeout=10)
        finally:
            writer.close()
    for claimed in first, second:
        stored = repo.get_run(claimed.run.id)
        assert stored is not None and stored.status == RunStatus.COMPLETED


def test_the_executor_runs_the_agent_and_has_its_end_written(
    pool: ConnectionPool, repo: AgentRunRepository, heartbeat: HeartbeatService
) -> None:
    run = new_run(repo)
    claims = _claiming(pool, heartbeat)
    handed: list[tuple[str, Decision]] = []
    seen: list[int] = []

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        seen.append(ctx.attempt_no)
        return AgentResult.completed({"ok": True})

    def hand(run: AgentRun, lease: Lease, decision: Decision, tag: str) -> bool:
        handed.append((run.id, decision))
        return False  # closed: the executor writes the end itself

    executor = Executor(
        agent,
        completer=_completer(pool),
        heartbeat=heartbeat,
        calls=LeasedCalls(repositories(pool, timeout=5, telemetry=None), retry_cap=0.2),
        hand=hand,
        pool=pool,
        stopping=threading.Event(),
        on_agent_exit=lambda: None,
        max_tries=3,
        async_completion=False,
    )
    claimed = claims.one()
    assert claimed is not None
    ended = executor.run(claimed, None, hand_over=True)
    assert seen == [1] and [run_id for run_id, _ in handed] == [run.id]
    assert ended.status == RunStatus.COMPLETED and ended.output == {"ok": True}
    assert ended == repo.get_run(run.id)
    # untracked: tracking the token again starts a new lease
    assert heartbeat.track(run.id, claimed.lease.worker_id, deadline=0) is not claimed.lease
    assert executor.exit_code == 0
