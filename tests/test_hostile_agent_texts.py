"""A hostile agent's texts: a huge error is cut once (its marker counts every cut character), a
bad error_type keeps the agent's own message, and log lines carry hostile run ids and error texts
as visible text, one line each."""

from __future__ import annotations

import logging
import unicodedata
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, create_pool
from agent_runs import validation as check
from agent_runs.logs import logger
from agent_runs.worker import AgentResult, RunContext, Worker
from tests.helpers import new_run

HOSTILE = "evil\r\nFORGED LINE\x1b]0;owned\x07\x1b[2J\u202egnp.exe\u2028end"


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=1, max_size=8) as p:
        yield p


def run_agent(pool: ConnectionPool, agent: Any) -> AgentRun:
    with Worker(pool, agent, name="hardening", lease_seconds=5, heartbeat_seconds=1) as worker:
        ended = worker.run_once()
    assert ended is not None
    return ended


# -- a long error is cut once ---------------------------------------------------------------------


def test_a_huge_error_from_an_agent_is_cut_once_and_the_marker_counts_every_cut_character(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    size = 5_000_000
    cut = f" … [truncated {size - check.MAX_ERROR_MESSAGE_LENGTH} characters]"

    def fails(run: AgentRun, ctx: RunContext) -> AgentResult:
        return AgentResult.failed("too_long", "m" * size)

    def raises(run: AgentRun, ctx: RunContext) -> AgentResult:
        raise RuntimeError("r" * (size - len("RuntimeError: ")))

    for agent, error_type in ((fails, "too_long"), (raises, "agent_error")):
        run = new_run(repo)
        ended = run_agent(pool, agent)
        assert ended.id == run.id
        stored = repo.get_run(run.id)
        assert stored is not None and stored.error_type == error_type
        assert stored.error_message is not None and stored.error_message.endswith(cut)
        assert len(stored.error_message) == check.MAX_ERROR_MESSAGE_LENGTH + len(cut)
        (attempt,) = repo.list_run_attempts(run.id)
        assert attempt.error_message == stored.error_message


def test_error_message_is_idempotent_and_a_cut_message_is_not_cut_again() -> None:
    once = check.error_message("x" * 20_000)
    assert once is not None and once.endswith(" … [truncated 11808 characters]")
    assert check.error_message(once) == once
    assert check.agent_error("kind", once) == ("kind", once)


# -- a bad error_type keeps the agent's message ---------------------------------------------------


def test_a_bad_error_type_keeps_the_agents_own_message(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    def bad_type(run: AgentRun, ctx: RunContext) -> AgentResult:
        return AgentResult.failed("T" * 5_000_000, "the real message")

    run = new_run(repo)
    run_agent(pool, bad_type)
    stored = repo.get_run(run.id)
    assert stored is not None and stored.error_type == check.INVALID_ERROR_TYPE
    assert stored.error_message is not None
    assert stored.error_message.endswith(": the real message")
    assert len(stored.error_message) < 400  # a short prefix of the bad type, not 8 kB of it
    assert "TTTT" in stored.error_message


# -- log lines carry hostile text as visible text -------------------------------------------------


def _assert_one_visible_line(text: str) -> None:
    assert "\n" not in text and "\r" not in text
    for ch in text:
        assert unicodedata.category(ch) not in ("Cc", "Cs", "Zl", "Zp"), repr(text)
        assert ch not in "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069", repr(text)


def test_worker_and_reconciler_log_lines_escape_run_ids_and_error_texts(
    pool: ConnectionPool, repo: AgentRunRepository, caplog: pytest.LogCaptureFixture
) -> None:
    def fails(run: AgentRun, ctx: RunContext) -> AgentResult:
        return AgentResult.failed("hostile", HOSTILE)

    hostile_id = "run\r\n\x1b[31mFAKE\u202e"
    new_run(repo, run_id=hostile_id)
    caplog.set_level(logging.DEBUG, logger="agent_runs")
    run_agent(pool, fails)
    stale = new_run(repo, run_id="stale\n\x1b]0;t\x07")
    long_ago = datetime.now(UTC) - timedelta(hours=1)
    assert repo.mark_running(stale.id, worker_id="gone", lease_seconds=1, now=long_ago).acquired
    with Worker(pool, fails, name="reconciler", lease_seconds=5) as worker:
        converged = worker.maybe_reconcile()
    assert [run.id for run in converged] == [stale.id]
    lines = [record.getMessage() for record in caplog.records]
    assert any("run\\r\\n\\e[31mFAKE\\u202e" in line for line in lines), lines
    assert any("evil\\r\\nFORGED LINE\\e]0;owned\\x07" in line for line in lines), lines
    assert any("stale\\n\\e]0;t\\x07" in line for line in lines), lines
    for line in lines:
        _assert_one_visible_line(line)


def test_a_logged_exception_keeps_its_frames_and_escapes_its_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logger("agent_runs.test")
    caplog.set_level(logging.INFO, logger="agent_runs.test")
    try:
        raise ValueError(HOSTILE)
    except ValueError:
        log.exception("failed for %s", "run\n1")
    (record,) = caplog.records
    assert record.exc_info is None  # the traceback travels as escaped text, not as exc_info
    message = record.getMessage()
    head, *frames = message.split("\n")
    assert head == "failed for run\\n1"
    assert frames[0] == "Traceback (most recent call last):"
    assert any(line.startswith("  File ") and __file__ in line for line in frames)
    assert frames[-1].startswith("ValueError: evil\\r\\nFORGED LINE\\e]0;owned")
    for line in [head, frames[-1]]:
        _assert_one_visible_line(line)
