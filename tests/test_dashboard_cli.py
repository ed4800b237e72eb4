"""`agent-runs dashboard`: refuses a non-loopback host without a token, serves on the given
port (a real process, stopped by its PID), and takes the token only from the environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from agent_runs import AgentRunRepository
from tests.fix_dashboard import TOKEN, finished_run, free_port

pytest.importorskip("starlette")
from agent_runs.cli.dashboard import TOKEN_ENV, is_loopback

httpx = pytest.importorskip("httpx")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "agent_runs", "dashboard", *args],
        capture_output=True,
        text=True,
        env=environment,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "dashboard.example"])
def test_a_non_loopback_host_without_a_token_is_refused(host: str) -> None:
    result = _cli("--dsn", "postgresql://nobody@127.0.0.1:1/none", "--host", host)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and TOKEN_ENV in lines[0] and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--statement-timeout", "5x"],
        ["--port", "0"],
        ["--port", "70000"],
        ["--pool-size", "0"],
    ],
)
def test_bad_options_are_one_line_and_exit_2(args: list[str]) -> None:
    result = _cli("--dsn", "postgresql://nobody@127.0.0.1:1/none", *args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1


def test_loopback_hosts() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.com"]))


@contextmanager
def served(dsn: str, *extra: str, env: dict[str, str] | None = None) -> Iterator[str]:
    port = free_port()
    environment = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    environment.update(env or {})
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent_runs",
            "dashboard",
            "--dsn",
            dsn,
            "--port",
            str(port),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, process.communicate()
            try:
                httpx.get(url + "/static/dashboard.css", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the dashboard did not start"
                time.sleep(0.1)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            _, stderr = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise
    assert process.returncode == 0, stderr
    assert f"agent_runs dashboard on {url}/" in stderr
    assert TOKEN not in stderr


def test_the_command_serves_the_dashboard(dsn: str, repo: AgentRunRepository) -> None:
    run = finished_run(repo)
    with served(dsn) as url:
        assert httpx.get(url + "/healthz").text == "ok\n"
        page = httpx.get(f"{url}/runs/{run.id}")
        assert page.status_code == 200 and run.id in page.text
        assert "Cancel this run" not in page.text  # read only unless --allow-cancel


def test_the_token_comes_from_the_environment(dsn: str, repo: AgentRunRepository) -> None:
    with served(dsn, "--allow-cancel", env={TOKEN_ENV: TOKEN}) as url:
        assert httpx.get(url + "/healthz").status_code == 401
        bearer = {"authorization": f"Bearer {TOKEN}"}
        assert httpx.get(url + "/healthz", headers=bearer).text == "ok\n"
