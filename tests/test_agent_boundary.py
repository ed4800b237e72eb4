"""Whatever an agent returns or raises, its attempt ends with an outcome and an error saying what
happened, and the worker goes on (or, for SystemExit/KeyboardInterrupt, stops after writing)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, RunStatus, create_pool
from agent_runs.errors import InvalidArgument
from agent_runs.worker import AgentResult, RetryableError, RunContext, Worker
from agent_runs.worker.outcome import Ending, decide


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=1, max_size=4) as p:
        yield p


def _create(repo: AgentRunRepository, n: int = 1) -> AgentRun:
    return repo.create_run(thread_id=f"t{n}", agent_slug="a", uid="u", request_id=f"r{n}")


def _run_with(pool: ConnectionPool, agent: Any) -> tuple[Worker, AgentRun | None]:
    with Worker(pool, agent, name="boundary", lease_seconds=5, heartbeat_seconds=1) as worker:
        return worker, worker.run_once()


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def _raise(exc: BaseException) -> Callable[[AgentRun, RunContext], AgentResult]:
    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        raise exc

    return agent


CASES: list[tuple[str, Any, RunStatus, str, str]] = [
    # (case, agent, final status, error_type, text the message must contain)
    ("not a result", lambda r, c: 42, RunStatus.FAILED, "agent_error", "int 42"),
    ("None", lambda r, c: None, RunStatus.FAILED, "agent_error", "None"),
    (
        "status running",
        lambda r, c: AgentResult(RunStatus.RUNNING),
        RunStatus.FAILED,
        "agent_error",
        "status running",
    ),
    (
        "cancelled without a request",
        lambda r, c: AgentResult(RunStatus.CANCELLED),
        RunStatus.FAILED,
        "agent_error",
        "without a cancel request",
    ),
    (
        "garbage status",
        lambda r, c: AgentResult("exploded"),  # type: ignore[arg-type]
        RunStatus.FAILED,
        "agent_error",
        "exploded",
    ),
    (
        "empty error_type",
        lambda r, c: AgentResult.failed("", "boom"),
        RunStatus.FAILED,
        "invalid_error_type",
        "boom",
    ),
    (
        "overlong error_type",
        lambda r, c: AgentResult.failed("x" * 65, "boom"),
        RunStatus.FAILED,
        "invalid_error_type",
        "x" * 65,
    ),
    (
        "NUL in error_type",
        lambda r, c: AgentResult.interrupted("bad\x00type", "why"),
        RunStatus.INTERRUPTED,
        "invalid_error_type",
        "why",
    ),
    (
        "lone surrogate in the message",
        lambda r, c: AgentResult.failed("oops", "path \udc80 broke"),
        RunStatus.FAILED,
        "oops",
        "path \ufffd broke",
    ),
    (
        "unprintable exception",
        _raise(Unprintable()),
        RunStatus.FAILED,
        "agent_error",
        "Unprintable",
    ),
    ("GeneratorExit", _raise(GeneratorExit()), RunStatus.FAILED, "agent_error", "GeneratorExit"),
    ("SystemExit", _raise(SystemExit(3)), RunStatus.INTERRUPTED, "agent_exit", "SystemExit: 3"),
]


@pytest.mark.parametrize("case", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_every_agent_ending_is_recorded_on_the_run_and_its_attempt(
    pool: ConnectionPool, repo: AgentRunRepository, case: tuple[Any, RunStatus, str, str]
) -> None:
    agent, status, error_type, text = case
    run = _create(repo)
    _, ended = _run_with(pool, agent)
    assert ended is not None
    assert (ended.status, ended.error_type) == (status, error_type)
    assert ended.error_message is not None and text in ended.error_message
    (attempt,) = repo.list_run_attempts(run.id)
    assert (attempt.outcome, attempt.error_type) == (status.value, error_type)
    assert attempt.error_message == ended.error_message


def test_a_system_exit_from_the_agent_stops_the_worker_non_zero(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    _create(repo, 1)
    second = _create(repo, 2)
    worker, ended = _run_with(pool, _raise(SystemExit(0)))
    assert ended is not None and ended.status == RunStatus.INTERRUPTED
    assert (worker.stopping, worker.exit_code) == (True, 1)
    assert worker.run_once() is None  # it claims nothing more
    assert repo.get_run(second.id).status == RunStatus.PENDING  # type: ignore[union-attr]


def test_a_keyboard_interrupt_is_recorded_then_raised(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    run = _create(repo)
    agent = _raise(KeyboardInterrupt())
    with (
        Worker(pool, agent, name="boundary", lease_seconds=5) as worker,
        pytest.raises(KeyboardInterrupt),
    ):
        worker.run_once()
    (attempt,) = repo.list_run_attempts(run.id)
    assert (attempt.outcome, attempt.error_type) == ("interrupted", "agent_exit")


def test_the_worker_goes_on_after_an_odd_agent(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    _create(repo, 1)
    _create(repo, 2)
    answers = iter([Unprintable(), None])

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        exc = next(answers)
        if exc is not None:
            raise exc
        return AgentResult.completed()

    with Worker(pool, agent, name="boundary", lease_seconds=5) as worker:
        first, second = worker.run_once(), worker.run_once()
    assert first is not None and second is not None
    assert (first.status, second.status) == (RunStatus.FAILED, RunStatus.COMPLETED)


def test_decide_is_pure_and_follows_the_policy_order() -> None:
    boom = RuntimeError("boom")
    retry = RetryableError("flaky")
    assert decide(Ending(raised=boom), stop_reason="cancel_requested", attempt_no=1, max_tries=3)
    assert decide(Ending(raised=retry), stop_reason=None, attempt_no=1, max_tries=3).releases
    exhausted = decide(Ending(raised=retry), stop_reason=None, attempt_no=3, max_tries=3)
    assert (exhausted.status, exhausted.error_type) == (RunStatus.FAILED, "retries_exhausted")
    completed = Ending(returned=AgentResult.completed())
    assert decide(completed, stop_reason="shutdown", attempt_no=1, max_tries=3).status == (
        RunStatus.COMPLETED
    )
    assert decide(Ending(raised=boom), stop_reason="shutdown", attempt_no=1, max_tries=3).releases


@pytest.mark.parametrize(
    "kwargs",
    [
        {"agent_slugs": "support"},
        {"agent_slugs": []},
        {"agent_slugs": ["x" * 65]},
        {"lease_seconds": 10**400},
        {"lease_seconds": float("nan")},
        {"heartbeat_seconds": 60},
        {"max_tries": 0},
        {"max_tries": True},
        {"poll_seconds": -1},
        {"name": ""},
        {"name": "n" * 96},
        {"name": "a\x00b"},
        {"name": "bad\udc80"},
    ],
)
def test_bad_worker_settings_are_refused_by_name(
    pool: ConnectionPool, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(InvalidArgument, match=next(iter(kwargs))):
        Worker(pool, lambda r, c: AgentResult.completed(), **kwargs)


def test_the_cli_worker_exits_non_zero_when_its_agent_raises_system_exit(
    dsn: str, repo: AgentRunRepository, tmp_path: Path
) -> None:
    (tmp_path / "exiting_agent.py").write_text(
        textwrap.dedent(
            """
            def agent(run, ctx):
                raise SystemExit(0)
            """
        )
    )
    run = _create(repo)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_runs",
            "worker",
            "--dsn",
            dsn,
            "--agent",
            "exiting_agent:agent",
            "--lease-seconds",
            "5",
            "--no-listen",
        ],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    ended = repo.get_run(run.id)
    assert ended is not None
    assert (ended.status, ended.error_type) == (RunStatus.INTERRUPTED, "agent_exit")


def test_a_cancelled_run_keeps_the_error_its_agent_raised(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    run = _create(repo)

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        repo.request_cancel(run.id)
        assert ctx.wait(5.0)  # the heartbeat sees the cancel request
        raise ValueError("stopped while writing order #42")

    with Worker(pool, agent, name="boundary", lease_seconds=3, heartbeat_seconds=0.1) as worker:
        ended = worker.run_once()
    assert ended is not None and ended.status == RunStatus.CANCELLED
    (attempt,) = repo.list_run_attempts(run.id)
    assert (attempt.outcome, attempt.error_type) == ("cancelled", "agent_error")
    assert attempt.error_message == "ValueError: stopped while writing order #42"


def test_a_retry_release_keeps_the_retryable_error_on_the_attempt(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    run = _create(repo)
    ended = _run_with(pool, _raise(RetryableError("upstream 429, retry after 2s")))[1]
    assert ended is not None and ended.status == RunStatus.PENDING
    assert (ended.error_type, ended.error_message) == (None, None)  # the run keeps none
    (attempt,) = repo.list_run_attempts(run.id)
    assert (attempt.outcome, attempt.error_type) == ("retry_released", "retryable_error")
    assert attempt.error_message == "RetryableError: upstream 429, retry after 2s"
