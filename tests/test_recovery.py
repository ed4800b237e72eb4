"""The recovery policy: retry_or_fail, lost leases, requeues and policies decide from the
attempt facts, inside the run lock, and record each decision (sync and async faces)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from agent_runs import AgentRunRepository, InvalidArgument, RunPolicy, RunStatus, ThreadBusy
from tests.helpers import everything, new_run
from tests.test_aio_contract import blocking_face

Repo = Any


@pytest.fixture(params=["sync", "async"])
def repo(request: pytest.FixtureRequest, dsn: str, conn: psycopg.Connection[Any]) -> Iterator[Repo]:
    if request.param == "sync":
        yield AgentRunRepository(conn)
    else:
        with blocking_face(dsn) as face:
            yield face


def _claim(repo: Repo, now: datetime, worker: str = "w:1") -> Any:
    return repo.claim_next(worker_id=worker, lease_seconds=30, now=now)


def _fail(repo: Repo, run_id: str, now: datetime | None, **kw: Any) -> Any:
    return repo.retry_or_fail(
        run_id, worker_id="w:1", error_type="rate_limited", error_message="429", now=now, **kw
    )


def test_without_a_policy_a_retry_keeps_the_runs_place_and_the_third_attempt_fails(
    repo: Repo, t0: datetime
) -> None:
    run = new_run(repo)
    assert repo.get_policy("agent") == RunPolicy("agent")
    for n in (1, 2):
        assert _claim(repo, t0 + timedelta(seconds=n)).id == run.id
        retried, changed = _fail(repo, run.id, t0 + timedelta(seconds=n))
        assert changed and retried.status == RunStatus.PENDING
        assert retried.available_at == run.available_at  # no back-off: its place kept
        attempt = repo.list_run_attempts(run.id)[-1]
        assert (attempt.outcome, attempt.error_type) == ("retry_released", "rate_limited")
        assert attempt.retry_at == run.available_at
    assert _claim(repo, t0 + timedelta(seconds=3)).id == run.id
    ended, changed = _fail(repo, run.id, t0 + timedelta(seconds=3))
    assert changed and (ended.status, ended.error_type) == ("failed", "retries_exhausted")
    assert "attempt 3 of 3" in ended.error_message and "rate_limited: 429" in ended.error_message
    last = repo.list_run_attempts(run.id)[-1]
    assert (last.outcome, last.error_type, last.retry_at) == ("failed", "retries_exhausted", None)


def test_back_off_doubles_and_a_claim_waits_for_available_at(repo: Repo, t0: datetime) -> None:
    repo.set_policy("agent", backoff_seconds=10, backoff_jitter=0, max_attempts=5)
    run = new_run(repo)
    _claim(repo, t0)
    retried, _ = _fail(repo, run.id, t0)
    assert retried.available_at == t0 + timedelta(seconds=10)
    assert _claim(repo, t0 + timedelta(seconds=9)) is None
    assert _claim(repo, t0 + timedelta(seconds=10)).id == run.id
    retried, _ = _fail(repo, run.id, t0 + timedelta(seconds=10))
    assert retried.available_at == t0 + timedelta(seconds=30)  # 10 x 2^1
    assert repo.list_run_attempts(run.id)[-1].retry_at == retried.available_at


def test_retry_after_is_capped_and_jitter_only_shortens(repo: Repo, t0: datetime) -> None:
    repo.set_policy("agent", backoff_seconds=100, backoff_max_seconds=120, backoff_jitter=0.5)
    run = new_run(repo)
    _claim(repo, t0)
    retried, _ = _fail(repo, run.id, t0, retry_after_seconds=500)
    assert retried.available_at == t0 + timedelta(seconds=120)
    _claim(repo, t0 + timedelta(seconds=120))
    retried, _ = _fail(repo, run.id, t0 + timedelta(seconds=120))
    delay = (retried.available_at - t0).total_seconds() - 120
    assert 60 < delay <= 120  # min(120, 200) x (1 - 0.5u)


def test_the_deadline_ends_a_run_deadline_exceeded(repo: Repo, t0: datetime) -> None:
    repo.set_policy("agent", deadline_seconds=60, max_attempts=10)
    run = new_run(repo)
    late = run.created_at + timedelta(seconds=61)
    _claim(repo, late)
    ended, _ = _fail(repo, run.id, late)
    assert (ended.status, ended.error_type) == ("failed", "deadline_exceeded")


def test_a_workers_max_tries_caps_the_policy(repo: Repo, t0: datetime) -> None:
    repo.set_policy("agent", max_attempts=5)
    run = new_run(repo)
    _claim(repo, t0)
    ended, _ = _fail(repo, run.id, t0, max_attempts=1)
    assert ended.error_type == "retries_exhausted"


def test_refused_when_not_the_owner_writing_nothing(
    repo: Repo, observer: psycopg.Connection[Any], t0: datetime
) -> None:
    run = new_run(repo)
    _claim(repo, t0)
    before = everything(observer)
    current, changed = repo.retry_or_fail(
        run.id, worker_id="other", error_type="x", now=t0 + timedelta(seconds=1)
    )
    assert not changed and current.status == RunStatus.RUNNING
    assert everything(observer) == before


def test_lost_leases_are_retried_up_to_the_allowance_then_the_run_is_poison(
    repo: Repo, t0: datetime
) -> None:
    repo.set_policy("agent", max_lost_leases=2, max_attempts=10)
    run = new_run(repo)
    now = t0
    for loss in (1, 2):
        assert _claim(repo, now).id == run.id
        now += timedelta(seconds=31)
        (converged,) = repo.reconcile_expired_leases(now=now)
        assert converged.status == RunStatus.PENDING, loss
        lost = repo.list_run_attempts(run.id)[-1]
        assert lost.outcome == "lease_expired" and lost.retry_at == converged.available_at
    _claim(repo, now)
    now += timedelta(seconds=31)
    (converged,) = repo.reconcile_expired_leases(now=now)
    assert (converged.status, converged.error_type) == ("failed", "lost_leases_exhausted")
    assert "lost its lease 3 times (attempts 1–3); the policy allows 2" in converged.error_message


def test_without_an_allowance_a_lost_lease_fails_as_before(repo: Repo, t0: datetime) -> None:
    run = new_run(repo)
    _claim(repo, t0)
    (converged,) = repo.reconcile_expired_leases(now=t0 + timedelta(seconds=31))
    assert (converged.status, converged.error_type) == ("failed", "worker_lease_expired")
    assert "at-least-once" in converged.error_message
    assert repo.list_run_attempts(run.id)[-1].retry_at is None


def test_a_requeue_gives_a_fresh_budget_and_is_recorded(repo: Repo, t0: datetime) -> None:
    run = new_run(repo)
    repo.set_policy("agent", max_attempts=1)
    _claim(repo, t0)
    _fail(repo, run.id, t0)
    later = t0 + timedelta(seconds=5)
    requeued, changed = repo.requeue_run(run.id, reason="provider is back", now=later)
    assert changed and requeued.status == RunStatus.PENDING
    assert requeued.available_at == later and requeued.error_type is None
    (requeue,) = repo.list_run_requeues(run.id)
    assert (requeue.previous_status, requeue.previous_error_type, requeue.reason) == (
        "failed",
        "retries_exhausted",
        "provider is back",
    )
    claimed = _claim(repo, later)
    assert claimed.id == run.id
    ended, _ = _fail(repo, run.id, later)
    assert "attempt 1 of 1" in ended.error_message  # counted from the requeue


def test_a_requeued_interrupted_run_leaves_its_output_behind(repo: Repo, t0: datetime) -> None:
    run = new_run(repo)
    _claim(repo, t0)
    pending = [{"id": "i-1", "value": "approve?"}]
    repo.set_terminal_status(
        run.id,
        status="interrupted",
        worker_id="w:1",
        error_type="human_input_required",
        output=pending,
        now=t0,
    )
    assert repo.get_run(run.id).output == pending
    requeued, changed = repo.requeue_run(run.id, now=t0 + timedelta(seconds=1))
    assert changed and requeued.output is None and repo.get_run(run.id).output is None


def test_requeue_refusals(repo: Repo, t0: datetime) -> None:
    done = new_run(repo)
    _claim(repo, t0)
    repo.set_terminal_status(done.id, status="completed", worker_id="w:1", now=t0)
    with pytest.raises(InvalidArgument, match="create a new run"):
        repo.requeue_run(done.id)
    pending = new_run(repo)
    assert repo.requeue_run(pending.id) == (pending, False)
    with pytest.raises(InvalidArgument, match="not an existing run"):
        repo.requeue_run("no-such-run")
    failed = new_run(repo, thread_id="busy")
    repo.set_terminal_status(failed.id, status="failed", error_type="x")
    new_run(repo, thread_id="busy")
    with pytest.raises(ThreadBusy):
        repo.requeue_run(failed.id)


def test_policies_are_set_merged_listed_and_deleted(repo: Repo) -> None:
    default = repo.set_policy("*", max_attempts=7)
    assert (default.max_attempts, default.source) == (7, "*")
    assert repo.get_policy("other").max_attempts == 7
    mine = repo.set_policy("agent", deadline_seconds=600)
    assert (mine.max_attempts, mine.deadline_seconds, mine.source) == (7, 600, "agent")
    assert repo.set_policy("agent", deadline_seconds=None).deadline_seconds is None
    assert [p.agent_slug for p in repo.list_policies()] == ["*", "agent"]
    assert repo.delete_policy("agent") and not repo.delete_policy("agent")
    assert repo.get_policy("agent").source == "*"


@pytest.mark.parametrize(
    ("argument", "call"),
    [
        ("priority", lambda r: new_run(r, priority=10)),
        ("available_at", lambda r: new_run(r, available_at=datetime(2030, 1, 1))),
        ("available_at", lambda r: new_run(r, available_at=datetime(1999, 1, 1, tzinfo=UTC))),
        ("backoff_seconds", lambda r: r.set_policy("agent", backoff_seconds=-1)),
        ("backoff_jitter", lambda r: r.set_policy("agent", backoff_jitter=2)),
        ("max_attempts", lambda r: r.set_policy("agent", max_attempts=0)),
        ("agent_slug", lambda r: r.set_policy("a" * 200, max_attempts=2)),
        ("backoff_max_seconds", lambda r: r.set_policy("agent", backoff_max_seconds=-5)),
        ("retry_after_seconds", lambda r: _fail(r, "x", None, retry_after_seconds=-1)),
    ],
)
def test_bad_input_is_refused_by_name_writing_nothing(
    repo: Repo, observer: psycopg.Connection[Any], argument: str, call: Any
) -> None:
    before = everything(observer)
    policies = observer.execute("SELECT count(*) FROM agent_run_policies").fetchone()
    with pytest.raises(InvalidArgument, match=argument):
        call(repo)
    assert everything(observer) == before
    assert observer.execute("SELECT count(*) FROM agent_run_policies").fetchone() == policies


def test_claims_take_the_lowest_priority_then_the_earliest_available_at(
    repo: Repo, t0: datetime
) -> None:
    late = new_run(repo, available_at=t0 + timedelta(seconds=60))
    low = new_run(repo, priority=5)
    first = new_run(repo, priority=1)
    second = new_run(repo, priority=1, available_at=t0 - timedelta(seconds=60))
    got = [_claim(repo, t0 + timedelta(seconds=1), f"w:{i}").id for i in range(3)]
    assert got == [second.id, first.id, low.id]
    assert _claim(repo, t0 + timedelta(seconds=1), "w:9") is None
    assert _claim(repo, t0 + timedelta(seconds=60), "w:9").id == late.id


def test_requeues_and_closed_retry_at_are_immutable(
    repo: Repo, observer: psycopg.Connection[Any], t0: datetime
) -> None:
    run = new_run(repo)
    repo.set_terminal_status(run.id, status="failed", error_type="x")
    repo.requeue_run(run.id, now=t0)
    _claim(repo, t0)
    _fail(repo, run.id, t0)
    for statement in (
        "UPDATE agent_run_requeues SET reason = 'rewritten'",
        "DELETE FROM agent_run_requeues",
        "UPDATE agent_run_attempts SET retry_at = now()",
    ):
        with pytest.raises(psycopg.errors.RestrictViolation):
            observer.execute(statement)
