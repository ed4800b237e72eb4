"""explain_run: every status explained from its attempt facts, and every inconsistency caught."""

from __future__ import annotations

import dataclasses
import unicodedata
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from agent_runs.explain import LEGACY, explain_run
from agent_runs.models import AgentRun, AttemptOutcome, RunAttempt, RunStatus
from tests.helpers import at

T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
LEASE_ERROR = "worker_lease_expired"


def make_run(status: RunStatus | str, **changes: Any) -> AgentRun:
    """A run in `status`, shaped as the repository leaves it (override any column)."""
    status = RunStatus(status)
    values: dict[str, Any] = {
        "id": "run-1",
        "request_id": "req-1",
        "thread_id": "thread-1",
        "agent_slug": "agent",
        "uid": "user",
        "run_type": "chat",
        "created_by_run_id": None,
        "status": status,
        "input_payload": {},
        "error_type": None,
        "error_message": None,
        "worker_id": None,
        "heartbeat_at": None,
        "lease_expires_at": None,
        "manifest": None,
        "manifest_fingerprint": None,
        "manifest_recorded_at": None,
        "started_at": at(T0, 1),
        "finished_at": at(T0, 100) if status.is_terminal else None,
        "created_at": T0,
        "updated_at": at(T0, 100),
    }
    if status in (RunStatus.RUNNING, RunStatus.CANCEL_REQUESTED):
        values.update(worker_id="w:live", heartbeat_at=at(T0, 50), lease_expires_at=at(T0, 110))
    values.update(changes)
    return AgentRun(**values)


def attempt(
    no: int,
    outcome: AttemptOutcome | str | None,
    *,
    worker_id: str | None = None,
    started: float | None = None,
    finished: float | None = None,
    error_type: str | None = None,
    run_id: str = "run-1",
) -> RunAttempt:
    """Attempt `no`, started at 10*no s; finished 5 s later unless open (outcome None)."""
    start = at(T0, started if started is not None else 10 * no)
    end = None if outcome is None else at(T0, finished if finished is not None else 10 * no + 5)
    return RunAttempt(
        id=no,
        run_id=run_id,
        attempt_no=no,
        worker_id=worker_id or f"w:{no}",
        started_at=start,
        heartbeat_at=start,
        lease_expires_at=start + timedelta(seconds=30),
        finished_at=end,
        outcome=None if outcome is None else AttemptOutcome(outcome),
        error_type=error_type,
        error_message=None if error_type is None else f"{error_type} happened",
        created_at=start,
        updated_at=end or start,
    )


def released(no: int) -> RunAttempt:
    return attempt(no, "retry_released")


def assert_explained(run: AgentRun, attempts: list[RunAttempt], *words: str) -> str:
    explanation = explain_run(run, attempts)
    assert explanation.explained, explanation.text
    assert explanation.text.startswith(f"{run.status}: ") or explanation.text.startswith(LEGACY)
    assert "\n" not in explanation.text
    for word in words:
        assert word in explanation.text
    return explanation.text


def assert_unexplained(run: AgentRun, attempts: list[RunAttempt], *words: str) -> str:
    explanation = explain_run(run, attempts)
    assert not explanation.explained, explanation.text
    assert explanation.text.startswith("unexplained: ")
    assert run.id in explanation.text
    for word in words:
        assert word in explanation.text
    return explanation.text


# -- completed -------------------------------------------------------------------------------


def test_completed_run_ends_in_a_completed_attempt_by_its_last_owner() -> None:
    text = assert_explained(
        make_run("completed"), [released(1), attempt(2, "completed")], "attempt 2 by w:2"
    )
    assert "#1 retry_released" in text


def test_completed_run_whose_last_attempt_failed_is_unexplained() -> None:
    assert_unexplained(
        make_run("completed"), [attempt(1, "failed", error_type="x")], "ended failed"
    )


def test_completed_run_whose_last_attempt_is_released_is_unexplained() -> None:
    assert_unexplained(make_run("completed"), [released(1)], "retry_released")


def test_completed_run_without_attempts_or_start_is_unexplained() -> None:
    assert_unexplained(make_run("completed", started_at=None), [], "no attempt completed it")


# -- failed ----------------------------------------------------------------------------------


def test_failed_run_ends_in_a_failed_attempt_with_the_same_error() -> None:
    run = make_run("failed", error_type="boom", error_message="boom happened")
    assert_explained(run, [attempt(1, "failed", error_type="boom")], "boom")


def test_retries_exhausted_is_explained_by_its_last_failed_attempt() -> None:
    run = make_run("failed", error_type="retries_exhausted")
    history = [released(1), released(2), attempt(3, "failed", error_type="retries_exhausted")]
    assert_explained(run, history, "retries_exhausted", "#2 retry_released")


def test_failed_run_with_a_different_error_than_its_attempt_is_unexplained() -> None:
    run = make_run("failed", error_type="boom")
    assert_unexplained(run, [attempt(1, "failed", error_type="other")], "'other'", "'boom'")


def test_lease_expired_attempt_explains_a_reconciled_failure() -> None:
    run = make_run("failed", error_type=LEASE_ERROR)
    text = assert_explained(
        run, [attempt(1, "lease_expired", error_type=LEASE_ERROR)], "lost its lease"
    )
    assert "at-least-once" in text


def test_lease_expired_attempt_with_another_run_error_is_unexplained() -> None:
    run = make_run("failed", error_type="boom")
    assert_unexplained(run, [attempt(1, "lease_expired", error_type=LEASE_ERROR)], "boom")


def test_failed_run_released_then_reconciled_after_an_ownerless_cancel() -> None:
    run = make_run("failed", error_type=LEASE_ERROR)
    assert_explained(run, [released(1)], "released for retry", "cancel")


def test_failed_run_released_then_failed_while_pending() -> None:
    run = make_run("failed", error_type="operator", error_message="stop it")
    assert_explained(run, [released(1)], "failed while pending", "operator")


def test_failed_before_it_ever_started() -> None:
    run = make_run("failed", started_at=None, error_type="operator")
    assert_explained(run, [], "before any attempt", "operator")


def test_failed_run_ending_in_a_completed_attempt_is_unexplained() -> None:
    run = make_run("failed", error_type="boom")
    assert_unexplained(run, [attempt(1, "completed")], "not completed")


def test_failed_run_ending_in_a_cancelled_attempt_is_unexplained() -> None:
    assert_unexplained(make_run("failed", error_type="x"), [attempt(1, "cancelled")], "cancelled")


# -- cancelled -------------------------------------------------------------------------------


def test_cancelled_run_ends_in_a_cancelled_attempt() -> None:
    assert_explained(make_run("cancelled"), [attempt(1, "cancelled")], "cancel request")


def test_cancelled_before_it_ever_started_is_told_apart_by_started_at() -> None:
    assert_explained(make_run("cancelled", started_at=None), [], "before it ever started")


def test_cancelled_after_a_release_for_retry() -> None:
    assert_explained(make_run("cancelled"), [released(1)], "released for retry")


def test_cancelled_run_ending_in_a_lease_expired_attempt_is_unexplained() -> None:
    history = [attempt(1, "lease_expired", error_type=LEASE_ERROR)]
    assert_unexplained(make_run("cancelled"), history, "lease_expired")


def test_cancelled_run_ending_in_a_completed_attempt_is_unexplained() -> None:
    assert_unexplained(make_run("cancelled"), [attempt(1, "completed")], "completed")


# -- interrupted -----------------------------------------------------------------------------


def test_interrupted_run_ends_in_an_interrupted_attempt() -> None:
    run = make_run("interrupted", error_type="user_left")
    assert_explained(run, [attempt(1, "interrupted", error_type="user_left")], "user_left")


def test_interrupted_run_with_a_mismatched_error_is_unexplained() -> None:
    run = make_run("interrupted", error_type="a")
    assert_unexplained(run, [attempt(1, "interrupted", error_type="b")], "'b'")


def test_interrupted_run_ending_in_a_failed_attempt_is_unexplained() -> None:
    run = make_run("interrupted", error_type="a")
    assert_unexplained(run, [attempt(1, "failed", error_type="a")], "ended failed")


def test_interrupted_run_without_attempts_or_start_is_unexplained() -> None:
    assert_unexplained(make_run("interrupted", started_at=None), [], "no attempt")


# -- pending ---------------------------------------------------------------------------------


def test_pending_run_that_never_started() -> None:
    assert_explained(make_run("pending", started_at=None), [], "first attempt")


def test_pending_run_released_for_retry_waits_for_the_next_attempt() -> None:
    assert_explained(make_run("pending"), [released(1), released(2)], "attempt 3 will follow")


def test_pending_run_whose_last_attempt_failed_is_unexplained() -> None:
    assert_unexplained(make_run("pending"), [attempt(1, "failed", error_type="x")], "failed")


def test_pending_run_with_an_open_attempt_is_unexplained() -> None:
    assert_unexplained(make_run("pending"), [attempt(1, None)], "still open")


def test_pending_run_with_an_owner_is_unexplained() -> None:
    run = make_run("pending", worker_id="w:1", heartbeat_at=at(T0, 1), lease_expires_at=at(T0, 9))
    assert_unexplained(run, [], "has an owner")


# -- running ---------------------------------------------------------------------------------


def test_running_run_is_held_by_its_open_attempt() -> None:
    run = make_run("running", worker_id="w:2")
    assert_explained(run, [released(1), attempt(2, None, worker_id="w:2")], "holds the lease")


def test_every_time_in_an_explanation_is_utc_with_a_z() -> None:
    lease = datetime(2030, 1, 1, 13, 0, 30, 250000, tzinfo=timezone(timedelta(hours=1)))
    run = make_run("running", worker_id="w:2", lease_expires_at=lease)
    text = explain_run(run, [released(1), attempt(2, None, worker_id="w:2")]).text
    assert "until 2030-01-01T12:00:30.250Z" in text and "+00:00" not in text


def test_running_run_whose_open_attempt_has_another_owner_is_unexplained() -> None:
    run = make_run("running", worker_id="w:other")
    assert_unexplained(run, [attempt(1, None)], "belongs to w:1")


def test_running_run_without_an_open_attempt_is_unexplained() -> None:
    run = make_run("running", worker_id="w:1")
    assert_unexplained(run, [released(1)], "no attempt is open")


def test_running_run_without_attempts_or_start_is_unexplained() -> None:
    assert_unexplained(make_run("running", started_at=None), [], "without started_at")


def test_running_run_without_owner_is_unexplained() -> None:
    run = make_run("running", worker_id=None, heartbeat_at=None, lease_expires_at=None)
    assert_unexplained(run, [attempt(1, None)], "no owner")


# -- cancel_requested ------------------------------------------------------------------------


def test_cancel_requested_while_its_owner_still_runs() -> None:
    run = make_run("cancel_requested", worker_id="w:1")
    assert_explained(run, [attempt(1, None)], "has yet to stop")


def test_cancel_requested_after_a_release_waits_for_a_claimer_to_cancel_it() -> None:
    run = make_run("cancel_requested", worker_id=None, heartbeat_at=None, lease_expires_at=None)
    assert_explained(run, [released(1)], "next claimer")


def test_ownerless_cancel_requested_that_never_started_is_unexplained() -> None:
    run = make_run(
        "cancel_requested",
        worker_id=None,
        heartbeat_at=None,
        lease_expires_at=None,
        started_at=None,
    )
    assert_unexplained(run, [], "never started")


def test_ownerless_cancel_requested_after_a_lease_expiry_is_unexplained() -> None:
    run = make_run("cancel_requested", worker_id=None, heartbeat_at=None, lease_expires_at=None)
    assert_unexplained(run, [attempt(1, "lease_expired", error_type=LEASE_ERROR)], "lease_expired")


# -- legacy ----------------------------------------------------------------------------------


@pytest.mark.parametrize("status", list(RunStatus))
def test_a_started_run_without_attempts_is_legacy(status: RunStatus) -> None:
    explanation = explain_run(make_run(status), [])
    assert explanation.explained
    assert explanation.text.startswith(LEGACY)
    assert str(status) in explanation.text


def test_a_legacy_run_claimed_again_is_explained_by_its_new_attempts() -> None:
    """started_at predates attempt 1: the run began before attempts were recorded."""
    run = make_run("completed", started_at=at(T0, -1000))
    assert_explained(run, [attempt(1, "completed")], "attempt 1")


# -- structure -------------------------------------------------------------------------------


def test_gaps_in_attempt_numbers_are_unexplained() -> None:
    history = [released(1), attempt(3, "completed")]
    assert_unexplained(make_run("completed"), history, "[1, 3]")


def test_attempt_numbers_must_start_at_one() -> None:
    assert_unexplained(make_run("completed"), [attempt(2, "completed")], "[2]")


def test_attempts_are_explained_in_attempt_order_whatever_the_input_order() -> None:
    assert_explained(make_run("completed"), [attempt(2, "completed"), released(1)])


def test_an_open_attempt_followed_by_another_means_two_owners() -> None:
    history = [attempt(1, None), attempt(2, "completed")]
    assert_unexplained(make_run("completed"), history, "still open")


def test_overlapping_attempts_are_unexplained() -> None:
    history = [released(1), attempt(2, "completed", started=12)]  # attempt 1 ran 10..15
    assert_unexplained(make_run("completed"), history, "two owners")


def test_a_terminal_outcome_followed_by_another_attempt_is_unexplained() -> None:
    history = [attempt(1, "completed"), attempt(2, "completed")]
    assert_unexplained(make_run("completed"), history, "yet attempt 2 followed")


def test_an_attempt_of_another_run_is_unexplained() -> None:
    assert_unexplained(make_run("completed"), [attempt(1, "completed", run_id="run-2")], "run-2")


def test_an_attempt_finished_before_it_started_is_unexplained() -> None:
    history = [attempt(1, "completed", started=10, finished=5)]
    assert_unexplained(make_run("completed"), history, "before it started")


def test_an_outcome_without_finished_at_is_unexplained() -> None:
    broken = dataclasses.replace(attempt(1, "completed"), finished_at=None)
    assert_unexplained(make_run("completed"), [broken], "only one of")


def test_attempts_without_run_started_at_are_unexplained() -> None:
    run = make_run("completed", started_at=None)
    assert_unexplained(run, [attempt(1, "completed")], "no started_at")


def test_run_started_after_its_first_attempt_is_unexplained() -> None:
    run = make_run("completed", started_at=at(T0, 11))
    assert_unexplained(run, [attempt(1, "completed")], "later than its first attempt")


def test_a_terminal_run_with_an_open_attempt_is_unexplained() -> None:
    assert_unexplained(make_run("failed", error_type="x"), [attempt(1, None)], "still open")


def test_a_terminal_run_without_finished_at_is_unexplained() -> None:
    run = make_run("completed", finished_at=None)
    assert_unexplained(run, [attempt(1, "completed")], "no finished_at")


def test_a_terminal_run_with_an_owner_is_unexplained() -> None:
    run = make_run("completed", worker_id="w:1", heartbeat_at=at(T0, 1), lease_expires_at=at(T0, 2))
    assert_unexplained(run, [attempt(1, "completed")], "still has an owner")


def test_a_live_run_with_finished_at_is_unexplained() -> None:
    run = make_run("running", worker_id="w:1", finished_at=at(T0, 3))
    assert_unexplained(run, [attempt(1, None)], "finished_at")


def test_a_half_set_lease_is_unexplained() -> None:
    run = make_run("running", worker_id="w:1", lease_expires_at=None)
    assert_unexplained(run, [attempt(1, None)], "lease columns")


def test_an_attempt_finished_after_its_run_is_unexplained() -> None:
    run = make_run("completed", finished_at=at(T0, 12))
    assert_unexplained(run, [attempt(1, "completed")], "finished after the run")


def test_every_status_has_a_rule() -> None:
    for status in RunStatus:
        run = make_run(status, started_at=None)
        assert explain_run(run, []).text  # never a KeyError


HOSTILE = "x\x1b[2J\r\nforged: completed\u202eevil\x85\u2028\\"
_BIDI = set("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _one_visible_line(text: str) -> bool:
    return not any(
        unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp") or ch in _BIDI for ch in text
    )


@pytest.mark.parametrize(
    ("run", "attempts"),
    [
        (
            make_run("failed", error_type=HOSTILE[:64], error_message=HOSTILE),
            [
                dataclasses.replace(
                    attempt(1, "failed", worker_id=HOSTILE, error_type=HOSTILE[:64]),
                    error_message=HOSTILE,
                )
            ],
        ),
        (make_run("running", worker_id=HOSTILE), [attempt(1, None, worker_id=HOSTILE)]),
        (make_run("completed", id=HOSTILE), [attempt(1, "completed")]),  # unexplained
        (make_run("failed", started_at=None, error_message=HOSTILE), []),
    ],
    ids=["failed", "running", "unexplained-run-id", "failed-pending"],
)
def test_values_from_users_and_agents_are_escaped_in_the_explanation(
    run: AgentRun, attempts: list[RunAttempt]
) -> None:
    text = explain_run(run, attempts).text
    assert _one_visible_line(text), text
    assert "\\e[2J\\r\\n" in text and "\\u202e" in text
