"""Text as written, summarized where long: a 119-attempt history reads as one short line in the
CLI and on the run page alike (the explanation is agent_runs.explain's, shared by both)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from agent_runs import AgentRunRepository
from agent_runs.explain import explain_run, summarize_attempts
from tests.helpers import new_run

pytest.importorskip("starlette")

SUMMARY = "#1–#118 retry_released (rate_limited)"


def _long_history(repo: AgentRunRepository, observer: psycopg.Connection[Any]) -> str:
    """A run completed by attempt 119 after 118 rate-limited attempts released for retry."""
    run = new_run(repo)
    t0 = datetime.now(UTC) - timedelta(hours=1)
    observer.execute(
        """
        WITH t AS (SELECT %(t0)s::timestamptz AS t0)
        INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at, heartbeat_at,
                                        finished_at, outcome, error_type, error_message)
        SELECT %(id)s, n, 'host-1:' || n, t0 + n * interval '10 seconds',
               t0 + n * interval '10 seconds' + interval '1 second',
               t0 + n * interval '10 seconds' + interval '2 seconds',
               CASE WHEN n < 119 THEN 'retry_released' ELSE 'completed' END,
               CASE WHEN n < 119 THEN 'rate_limited' END,
               CASE WHEN n < 119 THEN 'HTTP 429' END
        FROM t, generate_series(1, 119) AS n
        """,
        {"id": run.id, "t0": t0},
    )
    observer.execute(
        """
        UPDATE agent_runs SET status = 'completed',
               started_at = %(t0)s::timestamptz + interval '10 seconds',
               finished_at = %(t0)s::timestamptz + 119 * interval '10 seconds'
                             + interval '2 seconds'
        WHERE id = %(id)s
        """,
        {"id": run.id, "t0": t0},
    )
    return run.id


def test_a_long_history_is_summarized_in_the_cli_and_the_browser(
    client: Any, repo: AgentRunRepository, observer: psycopg.Connection[Any], dsn: str
) -> None:
    run_id = _long_history(repo, observer)
    run = repo.get_run(run_id)
    assert run is not None
    explanation = explain_run(run, repo.list_run_attempts(run_id))
    assert explanation.explained, explanation.text
    assert f"(earlier: {SUMMARY})" in explanation.text
    assert "#2 retry_released" not in explanation.text
    page = client.get(f"/runs/{run_id}").text
    assert f"(earlier: {SUMMARY})" in page
    assert "more characters]" not in page.split('class="explanation', 1)[1].split("</span>")[0]
    cli = subprocess.run(
        [sys.executable, "-m", "agent_runs", "attempts", run_id, "--dsn", dsn],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=60,
        check=True,
    )
    assert f"(earlier: {SUMMARY})" in cli.stdout


def test_short_runs_of_alike_attempts_stay_listed(
    repo: AgentRunRepository, observer: psycopg.Connection[Any]
) -> None:
    run_id = _long_history(repo, observer)
    attempts = repo.list_run_attempts(run_id)
    assert summarize_attempts(attempts[:2]) == "#1 retry_released, #2 retry_released"
    assert summarize_attempts(attempts[115:]) == (
        "#116–#118 retry_released (rate_limited), #119 completed"
    )
    assert summarize_attempts([]) == ""
