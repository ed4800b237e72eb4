"""A run's result: written by the transition that completes it, returned by every reader of the
run, refused by name when it is not JSON, never read by listings; and an attempt's resume point,
written once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from agent_runs import (
    AgentRun,
    AgentRunRepository,
    Finish,
    InvalidArgument,
    RunStatus,
    aio,
    create_pool,
    wait_for_run,
)
from agent_runs.cli import main
from agent_runs.validation import MAX_OUTPUT_BYTES
from agent_runs.worker import AgentResult, RunContext, Worker
from tests.helpers import OWNER, new_run, read_state

RESULT = {"answer": "42", "messages": [{"type": "ai", "content": "ok ✓"}], "n": 1.5}


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=1, max_size=4) as p:
        yield p


def _running(repo: AgentRunRepository) -> AgentRun:
    run = new_run(repo)
    assert repo.mark_running(run.id, worker_id=OWNER, lease_seconds=60).acquired
    return run


@pytest.mark.parametrize("output", [RESULT, [1, "two", None], "text", 7, True])
def test_set_terminal_status_stores_any_json_value_and_readers_return_it(
    dsn: str, repo: AgentRunRepository, output: Any
) -> None:
    run = _running(repo)
    ended = repo.set_terminal_status(run.id, status="completed", worker_id=OWNER, output=output)
    assert ended.changed and ended.run is not None and ended.run.output == output
    got = repo.get_run(run.id)
    assert got is not None and got.output == output
    assert wait_for_run(repo.conn, run.id, timeout_seconds=5).output == output

    async def waited() -> AgentRun:
        async with await aio.connect(dsn) as aconn:
            arepo = aio.AsyncAgentRunRepository(aconn)
            again = await arepo.get_run(run.id)
            assert again is not None and again.output == output
            return await aio.wait_for_run(aconn, run.id, timeout_seconds=5)

    assert asyncio.run(waited()).output == output


@pytest.mark.parametrize(
    ("output", "reason"),
    [
        (float("nan"), "strict JSON"),
        ({"k": "a\x00b"}, "NUL"),
        ({1: "int key"}, "not a string"),
        ({"s": "\udc80"}, "lone surrogate"),
        ({"x": object()}, "not JSON"),
        ("x" * MAX_OUTPUT_BYTES, "at most 1,048,576 bytes"),
    ],
)
def test_a_bad_output_is_refused_by_name_before_any_sql(
    observer: psycopg.Connection[Any], repo: AgentRunRepository, output: Any, reason: str
) -> None:
    run = _running(repo)
    before = read_state(observer, run.id)
    with pytest.raises(InvalidArgument, match="output") as refused:
        repo.set_terminal_status(run.id, status="completed", worker_id=OWNER, output=output)
    assert reason in str(refused.value)
    with pytest.raises(InvalidArgument, match="finishes output"):
        repo.finish_runs([Finish(run.id, OWNER, "completed", None, None, output)])
    assert read_state(observer, run.id) == before


def test_the_size_limit_counts_utf8_bytes_of_the_json_text(repo: AgentRunRepository) -> None:
    run = _running(repo)
    fits = "é" * ((MAX_OUTPUT_BYTES - 2) // 2)  # two bytes each, plus the two quotes
    with pytest.raises(InvalidArgument, match="bytes of JSON text"):
        repo.set_terminal_status(run.id, status="completed", worker_id=OWNER, output=fits + "é")
    ended = repo.set_terminal_status(run.id, status="completed", worker_id=OWNER, output=fits)
    assert ended.changed and ended.run is not None and ended.run.output == fits


def test_finish_runs_and_finish_runs_and_claim_write_each_runs_output(
    repo: AgentRunRepository,
) -> None:
    first, second = _running(repo), _running(repo)
    finished = repo.finish_runs(
        [
            Finish(first.id, OWNER, "completed", output={"from": "finish_runs"}),
            Finish(second.id, OWNER, "interrupted", "human_input_required", "waits", [1]),
        ]
    )
    assert set(finished) == {first.id, second.id}
    assert [repo.get_run(r.id).output for r in (first, second)] == [  # type: ignore[union-attr]
        {"from": "finish_runs"},
        [1],
    ]
    third = _running(repo)
    done, _ = repo.finish_runs_and_claim(
        [Finish(third.id, OWNER, "completed", output="claimed next")],
        worker_ids=["w-next:1"],
        lease_seconds=60,
    )
    assert third.id in done
    assert repo.get_run(third.id).output == "claimed next"  # type: ignore[union-attr]


def test_listings_never_read_the_output(repo: AgentRunRepository) -> None:
    run = _running(repo)
    repo.set_terminal_status(run.id, status="completed", worker_id=OWNER, output=RESULT)
    [listed] = repo.list_runs(thread_id=run.thread_id)
    assert listed.id == run.id and listed.output is None
    [summary] = repo.list_run_summaries(thread_id=run.thread_id)
    assert summary.run.output is None
    assert repo.list_run_listings(thread_id=run.thread_id)[0].id == run.id


def _run_agent(pool: ConnectionPool, repo: AgentRunRepository, result: AgentResult) -> AgentRun:
    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        return result

    run = new_run(repo)
    worker = Worker(pool, agent, name="results", lease_seconds=30, poll_seconds=0.05)
    ended = worker.run_once()
    assert ended is not None and ended.id == run.id
    worker.close()
    stored = repo.get_run(run.id)
    assert stored is not None
    return stored


def test_an_agents_output_is_stored_with_its_completed_run(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    stored = _run_agent(pool, repo, AgentResult.completed(output=RESULT))
    assert (stored.status, stored.output) == (RunStatus.COMPLETED, RESULT)
    waiting = _run_agent(
        pool, repo, AgentResult.interrupted("human_input_required", "asks", output=[{"id": "x"}])
    )
    assert (waiting.status, waiting.error_type, waiting.output) == (
        RunStatus.INTERRUPTED,
        "human_input_required",
        [{"id": "x"}],
    )


def test_an_agents_bad_output_fails_the_run_invalid_output_and_closes_its_attempt(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    stored = _run_agent(pool, repo, AgentResult.completed(output={"score": float("inf")}))
    assert (stored.status, stored.error_type, stored.output) == (
        RunStatus.FAILED,
        "invalid_output",
        None,
    )
    assert stored.error_message is not None and "strict JSON" in stored.error_message
    [attempt] = repo.list_run_attempts(stored.id)
    assert (attempt.outcome, attempt.error_type) == ("failed", "invalid_output")
    assert attempt.error_message == stored.error_message


def test_attempts_and_wait_json_carry_the_output(
    repo: AgentRunRepository, dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _running(repo)
    repo.set_terminal_status(run.id, status="completed", worker_id=OWNER, output=RESULT)
    for argv in (["attempts", run.id, "--json"], ["wait", run.id, "--json", "--timeout", "5"]):
        assert main([*argv, "--dsn", dsn]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["run"]["output"] == RESULT
        assert data["attempts"][0]["resumed_from"] is None


# -- where an attempt resumed -------------------------------------------------------------------


def test_the_resume_point_is_written_once_by_the_live_owner_and_then_kept(
    observer: psycopg.Connection[Any], repo: AgentRunRepository
) -> None:
    run = _running(repo)
    assert not repo.record_resumed_from(run.id, worker_id="w:other", checkpoint_id="c1", step=3)
    assert repo.record_resumed_from(run.id, worker_id=OWNER, checkpoint_id="c1", step=3)
    assert not repo.record_resumed_from(run.id, worker_id=OWNER, checkpoint_id="c2", step=4)
    [attempt] = repo.list_run_attempts(run.id)
    assert (attempt.resumed_from, attempt.resumed_step) == ("c1", 3)
    with pytest.raises(psycopg.errors.RestrictViolation, match="resumed from checkpoint c1"):
        observer.execute(
            "UPDATE agent_run_attempts SET resumed_from = 'c9' WHERE id = %s", (attempt.id,)
        )
    repo.set_terminal_status(run.id, status="completed", worker_id=OWNER)
    with pytest.raises(psycopg.errors.RestrictViolation):
        observer.execute(
            "UPDATE agent_run_attempts SET resumed_from = NULL, resumed_step = NULL WHERE id = %s",
            (attempt.id,),
        )
    fresh = _running(repo)
    [open_attempt] = repo.list_run_attempts(fresh.id)
    repo.set_terminal_status(fresh.id, status="completed", worker_id=OWNER)
    with pytest.raises(psycopg.errors.RestrictViolation):  # finished: immutable, set or not
        observer.execute(
            "UPDATE agent_run_attempts SET resumed_from = 'late', resumed_step = 1 WHERE id = %s",
            (open_attempt.id,),
        )


def test_a_bad_resume_point_is_refused_by_name(repo: AgentRunRepository) -> None:
    run = _running(repo)
    with pytest.raises(InvalidArgument, match="checkpoint_id"):
        repo.record_resumed_from(run.id, worker_id=OWNER, checkpoint_id="", step=1)
    with pytest.raises(InvalidArgument, match="step"):
        repo.record_resumed_from(run.id, worker_id=OWNER, checkpoint_id="c", step=2**40)


def test_the_run_page_shows_the_output_as_text_and_serves_it_whole(
    repo: AgentRunRepository, client: Any
) -> None:
    run = _running(repo)
    hostile = {"html": "<script>alert(1)</script>", "answer": 42}
    repo.set_terminal_status(run.id, status="completed", worker_id=OWNER, output=hostile)
    page = client.get(f"/runs/{run.id}")
    assert page.status_code == 200
    assert "<h3>Output</h3>" in page.text and "<script>alert(1)" not in page.text
    assert "&lt;script&gt;" in page.text
    whole = client.get(f"/json/output/{run.id}")
    assert whole.status_code == 200 and whole.json() == hostile
