"""The dashboard's Host allow-list at HTTP level and through `agent-runs dashboard`: checked
before any other work, so that a name rebound to 127.0.0.1 (DNS rebinding) neither reads a page
nor passes the Origin check of a cancel."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRunRepository, InvalidArgument
from tests.fix_dashboard import TOKEN, assert_secured, make_client, running_run
from tests.test_dashboard_cli import _cli, served

pytest.importorskip("starlette")
from agent_runs.dashboard import create_app
from agent_runs.dashboard.hosts import served_hosts

httpx = pytest.importorskip("httpx")

PORT = 8765
OWN = f"http://127.0.0.1:{PORT}"


@pytest.fixture
def hosted(dashboard_pool: ConnectionPool) -> Any:
    """A dashboard with cancel on and no token, as `make dashboard` serves it."""
    hosts = served_hosts("127.0.0.1", PORT, ["dash.example", "proxy.example:8443"])
    app = create_app(dashboard_pool, allow_cancel=True, allowed_hosts=hosts)
    with make_client(app, base_url=OWN) as client:
        yield client


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found
    return found.group(1)


@pytest.mark.parametrize(
    "host",
    [
        f"127.0.0.1:{PORT}",
        f"localhost:{PORT}",
        f"LOCALHOST.:{PORT}",
        f"[::1]:{PORT}",
        "dash.example",
        "dash.example:1234",
        "proxy.example:8443",
    ],
)
def test_the_own_names_are_served(hosted: Any, host: str) -> None:
    response = hosted.get("/", headers={"host": host})
    assert response.status_code == 200, host
    assert_secured(response)


@pytest.mark.parametrize(
    "host",
    [
        f"evil.example:{PORT}",
        "evil.example",
        "localhost:9999",
        "localhost",  # port 80
        f"127.0.0.2:{PORT}",
        "proxy.example:8444",
        f"dash.example.evil.example:{PORT}",
        f"127.0.0.1:{PORT}@evil.example",
        f"[::1]:{PORT}x",
        "",
    ],
)
def test_any_other_host_is_a_400_before_any_other_work(
    hosted: Any, repo: AgentRunRepository, host: str
) -> None:
    run = running_run(repo, input_payload={"secret": "payload-only-the-operator-sees"})
    for method, path in (
        ("GET", "/"),
        ("GET", f"/runs/{run.id}"),
        ("GET", f"/json/payload/{run.id}"),
        ("GET", "/static/dashboard.css"),
        ("GET", "/healthz"),
        ("DELETE", "/runs"),
        ("GET", "/runs?%1B=1"),
    ):
        response = hosted.request(method, path, headers={"host": host})
        assert response.status_code == 400, (host, method, path)
        assert_secured(response)
        assert "payload-only" not in response.text and run.id not in response.text
        assert "Host" in response.text
        if host:
            assert host not in response.text  # nothing of the request is echoed


def test_a_rebound_name_cannot_cancel_even_with_its_own_origin(
    hosted: Any, repo: AgentRunRepository
) -> None:
    """DNS rebinding: evil.example resolves to 127.0.0.1; the browser sends its own name as
    Host and as Origin, so the Origin check alone passes."""
    run = running_run(repo)
    evil = {"host": f"evil.example:{PORT}", "origin": f"http://evil.example:{PORT}"}
    assert hosted.get(f"/cancel/{run.id}", headers={"host": evil["host"]}).status_code == 400
    token = _csrf(hosted.get(f"/cancel/{run.id}").text)
    response = hosted.post(f"/cancel/{run.id}", data={"csrf": token}, headers=evil)
    assert response.status_code == 400
    still = repo.get_run(run.id)
    assert still is not None and still.status == "running"
    # The same form from the dashboard's own origin goes through (303 or 200).
    done = hosted.post(
        f"/cancel/{run.id}", data={"csrf": token}, headers={"origin": OWN}, follow_redirects=True
    )
    assert done.status_code == 200
    after = repo.get_run(run.id)
    assert after is not None and after.status == "cancel_requested"


def test_the_host_check_comes_before_the_token(dashboard_pool: ConnectionPool) -> None:
    app = create_app(dashboard_pool, token=TOKEN, allowed_hosts=[f"127.0.0.1:{PORT}"])
    with make_client(app, base_url=OWN) as client:
        assert client.get("/").status_code == 401
        bearer = {"authorization": f"Bearer {TOKEN}"}
        assert client.get("/", headers=bearer).status_code == 200
        wrong = client.get("/", headers={**bearer, "host": "evil.example"})
        assert wrong.status_code == 400 and "www-authenticate" not in wrong.headers


def test_without_allowed_hosts_a_mounted_app_checks_no_host(dashboard_pool: ConnectionPool) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    parent = Starlette(routes=[Mount("/ops", app=create_app(dashboard_pool))])
    with make_client(parent, base_url="https://apps.example.org") as client:
        assert client.get("/ops/").status_code == 200
        assert client.get("/ops/", headers={"host": "other.example"}).status_code == 200


@pytest.mark.parametrize(
    "hosts",
    [
        "localhost",
        [],
        [""],
        ["a b"],
        ["evil.example/x"],
        ["user@evil.example"],
        ["::1"],
        ["[not-v6]"],
        ["host:0"],
        ["host:65536"],
        ["host:x"],
        ["h\u00e9te"],
        [None],
        ["x" * 300],
        5,
    ],
)
def test_create_app_refuses_bad_allowed_hosts(dashboard_pool: ConnectionPool, hosts: Any) -> None:
    with pytest.raises(InvalidArgument, match="allowed_hosts"):
        create_app(dashboard_pool, allowed_hosts=hosts)


def test_the_command_answers_only_its_names(dsn: str) -> None:
    with served(dsn, "--allowed-host", "dash.example") as url:
        port = url.rsplit(":", 1)[1]
        assert httpx.get(url + "/healthz").text == "ok\n"
        for host in (f"localhost:{port}", f"[::1]:{port}", "dash.example", f"dash.example:{port}"):
            assert httpx.get(url + "/healthz", headers={"host": host}).status_code == 200, host
        for host in (f"evil.example:{port}", f"localhost:{int(port) + 1}"):
            assert httpx.get(url + "/healthz", headers={"host": host}).status_code == 400, host


@pytest.mark.parametrize("bad", ["a b", "evil/x", "::1", "h:0"])
def test_a_bad_allowed_host_is_one_line_and_exit_2(bad: str) -> None:
    result = _cli("--dsn", "postgresql://nobody@127.0.0.1:1/none", "--allowed-host", bad)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "--allowed-host" in result.stderr and "Traceback" not in result.stderr


def _startup(dsn: str, *extra: str, env: dict[str, str] | None = None) -> list[str]:
    """What `agent-runs dashboard` prints as it starts (then it is stopped by its PID)."""
    import os
    import signal
    import subprocess
    import sys

    from agent_runs.cli.dashboard import TOKEN_ENV
    from tests.fix_dashboard import free_port

    environment = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    environment.update(env or {})
    args = ["--dsn", dsn, "--port", str(free_port()), *extra]
    process = subprocess.Popen(
        [sys.executable, "-m", "agent_runs", "dashboard", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
    )
    try:
        assert process.stderr is not None
        lines = [process.stderr.readline().rstrip("\n")]
        while not lines[-1].startswith("  answers to Host"):
            lines.append(process.stderr.readline().rstrip("\n"))
            assert len(lines) < 20 and process.poll() is None, lines
        if "--allow-cancel" in extra and TOKEN_ENV not in (env or {}):
            lines.append(process.stderr.readline().rstrip("\n"))
        return lines
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=15)


def test_start_up_says_what_is_served(dsn: str) -> None:
    secret = "pw-that-must-not-show"
    parts = urlsplit(dsn)  # the machine's or the embedded server's URL, whatever its host part
    host = parts.netloc.rsplit("@", 1)[-1]
    with_password = urlunsplit(parts._replace(netloc=f"{parts.username}:{secret}@{host}"))
    assert secret in with_password
    lines = _startup(with_password, "--allow-cancel", "--allowed-host", "dash.example")
    text = "\n".join(lines)
    assert secret not in text
    assert lines[0].startswith("agent_runs dashboard on http://127.0.0.1:")
    assert "  database: postgresql://postgres:***@" in text
    assert "actions: on" in text and "dash.example" in text
    assert lines[-1].startswith("  warning: actions are on without a token")
    quiet = "\n".join(_startup(dsn, env={"AGENT_RUNS_DASHBOARD_TOKEN": TOKEN}))
    assert "actions: off" in quiet and "warning" not in quiet and TOKEN not in quiet
