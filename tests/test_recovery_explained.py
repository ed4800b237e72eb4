"""Every recovery decision is explained from the facts (the explanation `agent-runs attempts`
prints), and the CLI sets policies, requeues and lists scheduled runs."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from agent_runs import AgentRunRepository
from agent_runs.cli.main import main
from agent_runs.explain import explain_run
from tests.fix_telemetry import Otel
from tests.helpers import new_run


def _explained(repo: AgentRunRepository, run_id: str) -> str:
    run = repo.get_run(run_id)
    assert run is not None
    explanation = explain_run(
        run,
        repo.list_run_attempts(run_id),
        repo.list_run_requeues(run_id),
        repo.get_policy(run.agent_slug),
    )
    assert explanation.explained, explanation.text
    return explanation.text


def test_a_scheduled_retry_is_explained(repo: AgentRunRepository, t0: datetime) -> None:
    repo.set_policy("agent", max_attempts=5, backoff_seconds=30, backoff_jitter=0)
    run = new_run(repo)
    for n in (1, 2):
        now = t0 + timedelta(minutes=n)
        assert repo.claim_next(worker_id="w:1", lease_seconds=30, now=now) is not None
        repo.retry_or_fail(
            run.id, worker_id="w:1", error_type="rate_limited", error_message="429", now=now
        )
    when = (t0 + timedelta(minutes=2, seconds=60)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert _explained(repo, run.id).startswith(
        f"pending: attempt 2 failed (rate_limited: 429); attempt 3 of 5 not before {when}"
    )


def test_a_poison_run_is_explained(repo: AgentRunRepository, t0: datetime) -> None:
    repo.set_policy("agent", max_lost_leases=2, max_attempts=10)
    run = new_run(repo)
    now = t0
    for _ in range(3):
        repo.claim_next(worker_id="w:1", lease_seconds=30, now=now)
        now += timedelta(seconds=31)
        repo.reconcile_expired_leases(now=now)
    assert _explained(repo, run.id).startswith(
        "failed: lost its lease 3 times (attempts 1–3); the policy allows 2 (lost_leases_exhausted)"
    )


def test_a_requeue_is_explained(repo: AgentRunRepository, t0: datetime) -> None:
    repo.set_policy("agent", max_attempts=1)
    run = new_run(repo)
    repo.claim_next(worker_id="w:1", lease_seconds=30, now=t0)
    repo.retry_or_fail(run.id, worker_id="w:1", error_type="rate_limited", now=t0)
    repo.requeue_run(run.id, reason="quota raised", now=t0 + timedelta(seconds=5))
    text = _explained(repo, run.id)
    assert "requeued at" in text
    assert "(was failed: retries_exhausted; reason: quota raised)" in text
    repo.claim_next(worker_id="w:2", lease_seconds=30, now=t0 + timedelta(seconds=6))
    repo.set_terminal_status(
        run.id, status="completed", worker_id="w:2", now=t0 + timedelta(seconds=7)
    )
    assert _explained(repo, run.id).startswith("completed: attempt 2")


def test_the_cli_sets_policies_requeues_and_lists_scheduled_runs(
    dsn: str, repo: AgentRunRepository, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["policy", "set", "agent", "--backoff", "90s", "--deadline", "2h", "--dsn", dsn]) == 0
    )
    policy = repo.get_policy("agent")
    assert (policy.backoff_seconds, policy.deadline_seconds) == (90, 7200)
    assert main(["policy", "set", "agent", "--deadline", "none", "--dsn", dsn]) == 0
    assert repo.get_policy("agent").deadline_seconds is None
    assert main(["policy", "set", "agent", "--jitter", "2", "--dsn", dsn]) == 2
    assert "backoff_jitter" in capsys.readouterr().err
    assert main(["policy", "show", "agent", "--json", "--dsn", dsn]) == 0
    assert json.loads(capsys.readouterr().out)["backoff_seconds"] == 90
    code = main(["enqueue", "--thread", "t", "--agent-slug", "agent", "--uid", "u",
                 "--delay", "1h", "--priority", "3", "--dsn", dsn])  # fmt: skip
    assert code == 0
    run_id = capsys.readouterr().out.strip()
    assert main(["runs", "--scheduled", "--json", "--dsn", dsn]) == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)] == [run_id]
    assert main(["enqueue", "--thread", "t2", "--agent-slug", "a", "--uid", "u",
                 "--priority", "10", "--dsn", dsn]) == 2  # fmt: skip
    assert "priority" in capsys.readouterr().err
    repo.set_terminal_status(run_id, status="cancelled")
    assert main(["requeue", run_id, "--reason", "try again", "--dsn", dsn]) == 0
    assert repo.list_run_requeues(run_id)[0].reason == "try again"
    assert main(["attempts", run_id, "--json", "--dsn", dsn]) == 0
    document = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert document["requeues"][0]["previous_status"] == "cancelled"


def test_retries_scheduled_and_runs_exhausted_are_counted(
    conn: psycopg.Connection[Any], otel: Otel, t0: datetime
) -> None:
    repo = AgentRunRepository(conn, telemetry=otel.telemetry())
    repo.set_policy("a", max_attempts=2, max_lost_leases=1)
    failing, lost = new_run(repo, agent_slug="a"), new_run(repo, agent_slug="a")
    for n in (1, 2):
        now = t0 + timedelta(minutes=n)
        repo.claim_next_attempts(worker_ids=["w:1", "w:2"], lease_seconds=30, now=now)
        repo.retry_or_fail(failing.id, worker_id=_owner(repo, failing.id), error_type="x", now=now)
        repo.reconcile_expired_leases(now=now + timedelta(seconds=31))
    slug = {"messaging.destination.name": "a"}
    assert otel.total("agent_runs.retry.scheduled", reason="failure", **slug) == 1
    assert otel.total("agent_runs.retry.scheduled", reason="lost_lease", **slug) == 1
    assert otel.total("agent_runs.run.exhausted", **{"error.type": "retries_exhausted"}) == 1
    assert otel.total("agent_runs.run.exhausted", **{"error.type": "lost_leases_exhausted"}) == 1
    assert repo.get_run(lost.id).error_type == "lost_leases_exhausted"  # type: ignore[union-attr]


def _owner(repo: AgentRunRepository, run_id: str) -> str:
    run = repo.get_run(run_id)
    assert run is not None and run.worker_id is not None
    return run.worker_id
