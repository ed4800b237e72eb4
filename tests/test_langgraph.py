"""Durable LangGraph agents with the real langgraph and langgraph-checkpoint-postgres: outputs,
checkpoint metadata, tool calls with a fake chat model, interrupt then resume, cancel between
steps, resume after a retry and after a worker process killed mid-graph (each completed step's
side effect done once), sub-agents from a node, and 200 runs over 4 processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, RunStatus, create_pool
from agent_runs.explain import explain_run
from agent_runs.langgraph import setup, thread_key
from agent_runs.worker import Worker
from tests import langgraph_agents
from tests.helpers import new_run, wait_until

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 60.0


@pytest.fixture
def lg_dsn(dsn: str) -> str:
    setup(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(langgraph_agents.SIDE_EFFECTS_DDL)
    return dsn


@pytest.fixture
def pool(lg_dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(lg_dsn, min_size=1, max_size=10) as p:
        yield p
    langgraph_agents.close()


def _worker(pool: ConnectionPool, **kwargs: Any) -> Worker:
    kwargs.setdefault("lease_seconds", 10)
    kwargs.setdefault("poll_seconds", 0.05)
    return Worker(pool, langgraph_agents.agent, name="lg", **kwargs)


def _run_once(pool: ConnectionPool, repo: AgentRunRepository, run: AgentRun) -> AgentRun:
    worker = _worker(pool)
    try:
        assert worker.run_once() is not None
    finally:
        worker.close()
    ended = repo.get_run(run.id)
    assert ended is not None
    return ended


def _side_effects(conn: psycopg.Connection[Any], run_id: str) -> Counter[str]:
    rows = conn.execute("SELECT step FROM lg_side_effects WHERE run_id = %s", (run_id,))
    return Counter(step for (step,) in rows.fetchall())


def test_a_graph_completes_with_its_final_state_and_checkpoints_name_the_run(
    pool: ConnectionPool, repo: AgentRunRepository, observer: psycopg.Connection[Any]
) -> None:
    run = new_run(repo, agent_slug="lg-steps", uid="u/1", thread_id="t 1", input_payload={})
    ended = _run_once(pool, repo, run)
    assert (ended.status, ended.output["steps"]) == (
        RunStatus.COMPLETED,
        list(langgraph_agents.STEPS),
    )
    rows = observer.execute("SELECT thread_id, metadata FROM checkpoints").fetchall()
    assert {thread for thread, _ in rows} == {"agent_runs/u%2F1/lg-steps/t%201"}
    assert thread_key("u/1", "lg-steps", "t 1") == "agent_runs/u%2F1/lg-steps/t%201"
    assert {(m["agent_runs_run_id"], m["agent_runs_attempt"]) for _, m in rows} == {(run.id, 1)}
    assert len(rows) == len(langgraph_agents.STEPS) + 2  # the input, each step, the start
    assert _side_effects(observer, run.id) == Counter(langgraph_agents.STEPS)


def test_a_tool_calling_agent_on_a_fake_chat_model_returns_its_messages_as_dicts(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    question = {"messages": [{"role": "user", "content": "what is 6 x 7?"}]}
    run = new_run(repo, agent_slug="lg-tools", input_payload=question)
    ended = _run_once(pool, repo, run)
    assert ended.status == RunStatus.COMPLETED, ended.error_message
    messages = ended.output["messages"]
    assert [m["type"] for m in messages] == ["human", "ai", "tool", "ai"]
    assert messages[1]["data"]["tool_calls"][0]["name"] == "multiply"
    assert messages[2]["data"]["content"] == "42"
    assert messages[3]["data"]["content"] == "6 x 7 = 42"


def test_an_interrupt_ends_the_run_interrupted_and_a_resume_run_continues_it(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    asked = new_run(repo, agent_slug="lg-ask", input_payload={"question": "colour?"})
    ended = _run_once(pool, repo, asked)
    assert (ended.status, ended.error_type) == (RunStatus.INTERRUPTED, "human_input_required")
    [pending] = ended.output
    assert pending["value"] == {"question": "colour?"} and pending["id"]
    resumed = new_run(
        repo,
        agent_slug="lg-ask",
        thread_id=asked.thread_id,
        run_type="resume",
        input_payload={"resume": {pending["id"]: "blue"}},
    )
    done = _run_once(pool, repo, resumed)
    assert done.status == RunStatus.COMPLETED, done.error_message
    assert done.output == {"question": "colour?", "answer": "the answer is blue"}


def test_a_cancel_mid_graph_ends_the_run_before_any_further_step(
    pool: ConnectionPool, repo: AgentRunRepository, observer: psycopg.Connection[Any]
) -> None:
    run = new_run(repo, agent_slug="lg-steps", input_payload={"delay": 0.4})
    stop = threading.Event()
    worker = _worker(pool, heartbeat_seconds=0.1)
    thread = threading.Thread(target=worker.run_forever, args=(stop,))
    thread.start()
    try:
        wait_until(lambda: _side_effects(observer, run.id)["s2"] == 1, timeout=TIMEOUT)
        repo.request_cancel(run.id)
        wait_until(lambda: repo.get_run(run.id).is_terminal, timeout=TIMEOUT)  # type: ignore[union-attr]
        seen = _side_effects(observer, run.id)
        time.sleep(1.0)  # a step started after the cancel would record its side effect by now
        assert _side_effects(observer, run.id) == seen
    finally:
        stop.set()
        thread.join(15)
        worker.close()
    assert repo.get_run(run.id).status == RunStatus.CANCELLED  # type: ignore[union-attr]
    assert seen["s4"] == 0 and seen["s5"] == 0 and seen["s1"] == 1


def test_a_retried_attempt_resumes_from_the_last_checkpoint_and_says_so(
    pool: ConnectionPool, repo: AgentRunRepository, observer: psycopg.Connection[Any]
) -> None:
    run = new_run(repo, agent_slug="lg-steps", input_payload={"retry_at": "s3"})
    worker = _worker(pool)
    try:
        worker.run_once()  # s1, s2 checkpointed; s3 raises RetryableError
        worker.run_once()
    finally:
        worker.close()
    ended = repo.get_run(run.id)
    assert ended is not None and ended.status == RunStatus.COMPLETED
    assert _side_effects(observer, run.id) == Counter(langgraph_agents.STEPS)
    first, second = repo.list_run_attempts(run.id)
    assert (first.outcome, first.resumed_from) == ("retry_released", None)
    assert second.resumed_from is not None and second.resumed_step == 2
    text = explain_run(ended, [first, second]).text
    assert "attempt 2 resumed at step 2 after attempt 1 was released for retry" in text


class _Processes:
    """`agent-runs worker` processes on the langgraph test agents; killed at exit."""

    def __init__(self, dsn: str, tmp: Path) -> None:
        self.dsn, self.tmp = dsn, tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *extra: str) -> subprocess.Popen[bytes]:
        log = tempfile.NamedTemporaryFile(dir=self.tmp, suffix=".log", delete=False)  # noqa: SIM115
        args = ["worker", "--agent", "tests.langgraph_agents:agent", "--name", name]
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent_runs", *args, *extra, "--dsn", self.dsn],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def processes(lg_dsn: str, tmp_path: Path) -> Iterator[_Processes]:
    procs = _Processes(lg_dsn, tmp_path)
    yield procs
    procs.close()


def test_a_worker_process_killed_mid_graph_is_resumed_by_another_with_each_step_done_once(
    processes: _Processes, repo: AgentRunRepository, observer: psycopg.Connection[Any]
) -> None:
    run = new_run(repo, agent_slug="lg-steps", input_payload={"hold_at": "s3"})
    doomed = processes.start("doomed", "--lease-seconds", "2")
    wait_until(lambda: _side_effects(observer, run.id)["s3:entered"] == 1, timeout=TIMEOUT)
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(10)
    assert _side_effects(observer, run.id) == Counter({"s1": 1, "s2": 1, "s3:entered": 1})
    repo.set_policy("lg-steps", max_lost_leases=1)  # executing it again is acceptable: it resumes
    processes.start("rescuer", "--lease-seconds", "2")
    wait_until(lambda: repo.get_run(run.id).is_terminal, timeout=TIMEOUT)  # type: ignore[union-attr]
    ended = repo.get_run(run.id)
    assert ended is not None
    assert ended.status == RunStatus.COMPLETED, ended.error_message
    assert _side_effects(observer, run.id) == Counter([*langgraph_agents.STEPS, "s3:entered"])
    attempts = repo.list_run_attempts(run.id)
    assert [a.outcome for a in attempts][-2:] == ["lease_expired", "completed"]
    assert attempts[-1].resumed_step == 2
    assert "resumed at step 2 after attempt" in explain_run(ended, attempts).text


def test_a_graph_node_starts_sub_agents_and_waits_for_them(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    parent = new_run(repo, agent_slug="lg-delegate", input_payload={"children": 2})
    stop = threading.Event()
    worker = _worker(pool)
    threads = [threading.Thread(target=worker.run_forever, args=(stop,)) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: repo.get_run(parent.id).is_terminal, timeout=TIMEOUT)  # type: ignore[union-attr]
    finally:
        stop.set()
        for thread in threads:
            thread.join(15)
        worker.close()
    ended = repo.get_run(parent.id)
    assert ended is not None and (ended.status, ended.output) == (RunStatus.COMPLETED, 4)
    children = [r for r in repo.list_runs(agent_slug="lg-steps") if r.created_by_run_id]
    assert len(children) == 2 and {c.run_type for c in children} == {"subagent"}


def test_two_hundred_graph_runs_over_four_worker_processes(
    processes: _Processes, repo: AgentRunRepository, observer: psycopg.Connection[Any]
) -> None:
    runs = repo.create_runs(
        [
            {
                "thread_id": f"t-{i}",
                "agent_slug": "lg-steps",
                "uid": f"u-{i % 7}",
                "request_id": f"r-{i}",
                "input_payload": {"steps_wanted": 2},
            }
            for i in range(200)
        ]
    )
    for i in range(4):
        processes.start(f"p{i}", "--concurrency", "2", "--lease-seconds", "10")

    def finished() -> bool:
        row = observer.execute(
            "SELECT count(*) FROM agent_runs WHERE status = 'completed'"
        ).fetchone()
        return row is not None and row[0] == len(runs)

    wait_until(finished, timeout=120)
    rows = observer.execute(
        "SELECT step, count(*) FROM lg_side_effects GROUP BY step ORDER BY step"
    ).fetchall()
    assert rows == [("s1", 200), ("s2", 200)]
    workers = observer.execute(
        "SELECT count(DISTINCT split_part(worker_id, ':', 1)) FROM agent_run_attempts"
    ).fetchone()
    assert workers is not None and workers[0] >= 2
    sample = repo.get_run(runs[0].id)
    assert sample is not None and sample.output == {"steps": ["s1", "s2"], "steps_wanted": 2}


def test_the_core_never_imports_langgraph() -> None:
    code = (
        "import sys, agent_runs, agent_runs.worker, agent_runs.aio, agent_runs.cli.main;"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in"
        " ('langgraph', 'langchain_core'));"
        "print(loaded); sys.exit(1 if loaded else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_migrate_langgraph_creates_the_checkpoint_tables(
    blank_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from agent_runs.cli import main

    assert main(["migrate", "--langgraph", "--dsn", blank_dsn]) == 0
    assert "langgraph checkpoints: up to date" in capsys.readouterr().out
    with psycopg.connect(blank_dsn) as conn:
        found = conn.execute(
            "SELECT to_regclass('checkpoints') IS NOT NULL, to_regclass('agent_runs') IS NOT NULL"
        ).fetchone()
    assert found == (True, True)
    assert main(["migrate", "--langgraph", "--dsn", blank_dsn]) == 0  # again: a no-op


def test_the_langgraph_demo_shows_a_crash_and_a_resume(lg_dsn: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agent_runs", "demo", "--langgraph", "--dsn", lg_dsn],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "died (exit code 137) mid-graph" in done.stdout
    assert "attempt 2 resumed at step 2 after attempt 1 lost its lease" in done.stdout
    assert "done: each step ran once" in done.stdout


def test_thread_keys_are_one_to_one() -> None:
    keys = {
        thread_key("a/b", "c", "d"),
        thread_key("a", "b/c", "d"),
        thread_key("a", "b", "c/d"),
        thread_key("a%2Fb", "c", "d"),
        thread_key("a", "b", "c d"),
        thread_key("a", "b", "c+d"),
    }
    assert len(keys) == 6
    assert thread_key("ü", "s", "t") == "agent_runs/%C3%BC/s/t"
