"""End to end: real `agent-runs worker` processes on real PostgreSQL; facts read back from it."""

from __future__ import annotations

import functools
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest

from agent_runs import AgentRun, AgentRunRepository, RunAttempt, RunStatus
from agent_runs.explain import explain_run
from agent_runs.worker import AgentResult, RunContext
from tests.helpers import enqueue as enqueue_run

pytestmark = pytest.mark.e2e

LEASE = "2"  # seconds: short, so that crashes and hangs converge quickly
TIMEOUT = 30.0
ROOT = (
    Path(__file__).resolve().parents[1]
)  # bounded waits: a generous ceiling, never an assertion of speed


class Proc:
    """A child process with its combined output in a temporary file."""

    def __init__(self, args: list[str], log: IO[bytes]) -> None:
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agent_runs", *args],
            cwd=ROOT,  # so that `--agent tests.test_e2e:...` imports
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def wait(self, timeout: float = TIMEOUT) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process did not exit; output:\n{self.output()}") from None


class Spawner:
    """Starts `python -m agent_runs ...` processes against the test database; kills them all."""

    def __init__(self, dsn: str, tmp: Path) -> None:
        self.dsn = dsn
        self.tmp = tmp
        self.procs: list[Proc] = []

    def __call__(self, *args: str) -> Proc:
        log = tempfile.NamedTemporaryFile(dir=self.tmp, suffix=".log", delete=False)  # noqa: SIM115
        proc = Proc([*args, "--dsn", self.dsn], log)
        self.procs.append(proc)
        return proc

    def worker(self, *extra: str, name: str = "e2e") -> Proc:
        return self(
            "worker",
            "--name",
            name,
            "--lease-seconds",
            LEASE,
            "--poll-seconds",
            "0.1",
            "--log-level",
            "DEBUG",
            *extra,
        )

    def reconciler(self) -> Proc:
        return self("reconcile", "--every", "0.3")

    def close(self) -> None:
        for proc in self.procs:
            if proc.process.poll() is None:
                proc.process.kill()
            proc.process.wait()
            proc.log.close()


@pytest.fixture
def spawn(dsn: str, tmp_path: Path) -> Iterator[Spawner]:
    spawner = Spawner(dsn, tmp_path)
    try:
        yield spawner
    finally:
        spawner.close()


@pytest.fixture
def enqueue(repo: AgentRunRepository) -> Callable[[list[str]], AgentRun]:
    return functools.partial(enqueue_run, repo, agent_slug="scripted")


def wait_for(
    repo: AgentRunRepository,
    run_id: str,
    predicate: Callable[[AgentRun], bool],
    *,
    procs: tuple[Proc, ...] = (),
) -> AgentRun:
    deadline = time.monotonic() + TIMEOUT
    while True:
        run = repo.get_run(run_id)
        assert run is not None
        if predicate(run):
            return run
        if time.monotonic() > deadline:
            logs = "\n".join(p.output() for p in procs)
            raise AssertionError(f"run {run_id} stuck in {run.status}; worker output:\n{logs}")
        time.sleep(0.05)


def terminal(run: AgentRun) -> bool:
    return run.is_terminal


def history(repo: AgentRunRepository, run: AgentRun) -> list[RunAttempt]:
    attempts = repo.list_run_attempts(run.id)
    explanation = explain_run(run, attempts)
    assert explanation.explained, explanation.text
    return attempts


def stop(proc: Proc) -> int:
    proc.process.send_signal(signal.SIGTERM)
    return proc.wait()


def test_a_successful_run_has_one_completed_attempt(
    spawn: Spawner, repo: AgentRunRepository, enqueue: Callable[[list[str]], AgentRun]
) -> None:
    run = enqueue(["ok"])
    worker = spawn.worker()
    ended = wait_for(repo, run.id, terminal, procs=(worker,))
    assert ended.status == RunStatus.COMPLETED
    (attempt,) = history(repo, ended)
    assert (attempt.attempt_no, attempt.outcome) == (1, "completed")
    assert attempt.worker_id.startswith("e2e:")
    assert stop(worker) == 0


def test_retry_then_ok_has_two_attempts_with_different_owner_tokens(
    spawn: Spawner, repo: AgentRunRepository, enqueue: Callable[[list[str]], AgentRun]
) -> None:
    run = enqueue(["retry", "ok"])
    worker = spawn.worker()
    ended = wait_for(repo, run.id, terminal, procs=(worker,))
    assert ended.status == RunStatus.COMPLETED
    attempts = history(repo, ended)
    assert [(a.attempt_no, a.outcome) for a in attempts] == [
        (1, "retry_released"),
        (2, "completed"),
    ]
    assert attempts[0].worker_id != attempts[1].worker_id
    assert stop(worker) == 0


def test_retry_forever_is_exhausted_after_max_tries(
    spawn: Spawner, repo: AgentRunRepository, enqueue: Callable[[list[str]], AgentRun]
) -> None:
    run = enqueue(["retry"])
    worker = spawn.worker("--max-tries", "3")
    ended = wait_for(repo, run.id, terminal, procs=(worker,))
    assert (ended.status, ended.error_type) == (RunStatus.FAILED, "retries_exhausted")
    attempts = history(repo, ended)
    assert [a.outcome for a in attempts] == ["retry_released", "retry_released", "failed"]
    assert attempts[-1].error_type == "retries_exhausted"
    assert stop(worker) == 0


def test_a_crashed_worker_s_run_is_converged_by_the_reconciler(
    spawn: Spawner, repo: AgentRunRepository, enqueue: Callable[[list[str]], AgentRun]
) -> None:
    run = enqueue(["crash"])
    worker = spawn.worker()
    assert worker.wait() == 137  # the worker process really died mid-run
    assert repo.get_run(run.id) is not None
    running = repo.get_run(run.id)
    assert running is not None and running.status == RunStatus.RUNNING
    reconciler = spawn.reconciler()
    ended = wait_for(repo, run.id, terminal, procs=(worker, reconciler))
    assert (ended.status, ended.error_type) == (RunStatus.FAILED, "worker_lease_expired")
    assert "at-least-once" in (ended.error_message or "")
    (attempt,) = history(repo, ended)
    assert (attempt.outcome, attempt.error_type) == ("lease_expired", "worker_lease_expired")
    assert stop(reconciler) == 0


def test_wait_cancel_with_a_cancel_request_ends_cancelled(
    spawn: Spawner, repo: AgentRunRepository, enqueue: Callable[[list[str]], AgentRun]
) -> None:
    run = enqueue(["wait_cancel"])
    worker = spawn.worker()
    wait_for(repo, run.id, lambda r: r.status == RunStatus.RUNNING, procs=(worker,))
    repo.request_cancel(run.id)
    ended = wait_for(repo, run.id, terminal, procs=(worker,))
    assert ended.status == RunStatus.CANCELLED
    (attempt,) = history(repo, ended)
    assert attempt.outcome == "cancelled"
    assert stop(worker) == 0


def test_a_hung_run_loses_its_lease_and_its_late_completion_is_refused(
    spawn: Spawner, repo: AgentRunRepository, enqueue: Callable[[list[str]], AgentRun]
) -> None:
    run = enqueue(["hang"])
    worker = spawn.worker()
    reconciler = spawn.reconciler()
    ended = wait_for(repo, run.id, terminal, procs=(worker, reconciler))
    assert (ended.status, ended.error_type) == (RunStatus.FAILED, "worker_lease_expired")
    # The agent wakes up after 1.5 leases and returns completed: the repository refuses it.
    deadline = time.monotonic() + TIMEOUT
    while "refused completed" not in worker.output():
        assert time.monotonic() < deadline, worker.output()
        time.sleep(0.05)
    final = repo.get_run(run.id)
    assert final == ended  # nothing was written after the reconciler
    (attempt,) = history(repo, ended)
    assert attempt.outcome == "lease_expired"
    assert worker.process.poll() is None  # and the worker lives on
    assert stop(worker) == 0
    assert stop(reconciler) == 0


def test_sigterm_mid_run_exits_0_and_the_run_is_released_for_another_worker(
    spawn: Spawner, repo: AgentRunRepository, enqueue: Callable[[list[str]], AgentRun]
) -> None:
    run = enqueue(["sleep:60", "ok"])
    first = spawn.worker(name="first")
    wait_for(repo, run.id, lambda r: r.status == RunStatus.RUNNING, procs=(first,))
    assert stop(first) == 0
    released = repo.get_run(run.id)
    assert released is not None and released.status == RunStatus.PENDING
    assert [a.outcome for a in repo.list_run_attempts(run.id)] == ["retry_released"]

    second = spawn.worker(name="second")
    ended = wait_for(repo, run.id, terminal, procs=(second,))
    assert ended.status == RunStatus.COMPLETED
    attempts = history(repo, ended)
    assert [(a.outcome, a.worker_id.split(":")[0]) for a in attempts] == [
        ("retry_released", "first"),
        ("completed", "second"),
    ]
    assert stop(second) == 0


def test_sigterm_with_an_agent_that_ignores_it_still_exits_0_after_one_lease(
    spawn: Spawner, repo: AgentRunRepository, enqueue: Callable[[list[str]], AgentRun]
) -> None:
    run = enqueue(["ok"])
    worker = spawn.worker("--agent", "tests.test_e2e:deaf_agent")
    wait_for(repo, run.id, lambda r: r.status == RunStatus.RUNNING, procs=(worker,))
    # RUNNING is set by the claim; a SIGTERM before the agent starts releases the run instead.
    deadline = time.monotonic() + TIMEOUT
    while "started (agent slug" not in worker.output():
        assert time.monotonic() < deadline, worker.output()
        time.sleep(0.05)
    assert stop(worker) == 0
    output = worker.output()
    assert "ignored the stop request" in output, output
    reconciler = spawn.reconciler()  # the abandoned run converges like a crash
    ended = wait_for(repo, run.id, terminal, procs=(worker, reconciler))
    assert (ended.status, ended.error_type) == (RunStatus.FAILED, "worker_lease_expired")


def test_concurrency_runs_several_runs_at_once_in_one_process(
    spawn: Spawner, repo: AgentRunRepository, enqueue: Callable[[list[str]], AgentRun]
) -> None:
    runs = [enqueue(["wait_cancel"]) for _ in range(3)]
    worker = spawn.worker("--concurrency", "3")
    for run in runs:  # all three are held at the same time by the one process
        wait_for(repo, run.id, lambda r: r.status == RunStatus.RUNNING, procs=(worker,))
    for run in runs:
        repo.request_cancel(run.id)
    for run in runs:
        ended = wait_for(repo, run.id, terminal, procs=(worker,))
        assert ended.status == RunStatus.CANCELLED
    owners = {repo.list_run_attempts(run.id)[0].worker_id for run in runs}
    assert len(owners) == 3  # one owner token per claim
    assert stop(worker) == 0


def test_a_worker_started_before_its_database_is_reachable_keeps_retrying(
    tmp_path: Path,
) -> None:
    log = (tmp_path / "w.log").open("wb")
    proc = Proc(
        [
            "worker",
            "--dsn",
            "postgresql://nobody@127.0.0.1:1/none",
            "--lease-seconds",
            "1",
            "--poll-seconds",
            "0.1",
        ],
        log,
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        while "database unavailable" not in proc.output():
            assert proc.process.poll() is None, proc.output()
            assert time.monotonic() < deadline, proc.output()
            time.sleep(0.1)
        assert proc.process.poll() is None
        proc.process.send_signal(signal.SIGTERM)
        assert proc.wait() == 0
    finally:
        if proc.process.poll() is None:
            proc.process.kill()
            proc.process.wait()
        log.close()


def deaf_agent(run: AgentRun, ctx: RunContext) -> AgentResult:
    """An agent that never looks at should_stop (used through --agent tests.test_e2e:...)."""
    time.sleep(120)
    return AgentResult.completed()
