"""`agent-runs worker --concurrency`: an absurd value is refused in one line; when threads cannot
start, the started ones stop cleanly and it exits 1."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

from agent_runs import validation as check

AGENT_RUNS = [sys.executable, "-m", "agent_runs"]


def test_cli_worker_refuses_an_absurd_concurrency_in_one_line(dsn: str) -> None:
    done = subprocess.run(
        [*AGENT_RUNS, "worker", "--dsn", dsn, "--concurrency", "100000"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1
    assert f"1 to {check.MAX_CONCURRENCY}" in done.stderr


def test_cli_worker_that_cannot_start_a_thread_stops_the_started_ones_and_exits_1(
    dsn: str,
) -> None:
    address_space = 1024 * 1024 * 1024  # enough to start, too little for 1,000 thread stacks

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    done = subprocess.run(
        [*AGENT_RUNS, "worker", "--dsn", dsn, "--concurrency", str(check.MAX_CONCURRENCY)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limited,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("agent-runs: worker: could not start thread"), last
    assert "stopped cleanly" in last
