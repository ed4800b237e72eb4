"""Dashboard fixtures (a pytest plugin): a pool on the test's database, the app over it, an
HTTP client, and a real uvicorn server on a free port for the browser tests. Tests that use
them skip when the `dashboard` extra is not installed."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from psycopg_pool import ConnectionPool

import agent_runs

TOKEN = "test-token-0123456789"


@pytest.fixture
def dashboard_pool(dsn: str) -> Iterator[ConnectionPool]:
    pool = agent_runs.create_pool(dsn, min_size=1, max_size=4)
    try:
        yield pool
    finally:
        pool.close()


def make_client(app: Any, *, base_url: str = "http://testserver") -> Any:
    testclient = pytest.importorskip("starlette.testclient")
    return testclient.TestClient(app, base_url=base_url, raise_server_exceptions=False)


@pytest.fixture
def client(dashboard_pool: ConnectionPool) -> Iterator[Any]:
    """The read-only dashboard (no token, no cancel) through Starlette's TestClient."""
    dashboard = pytest.importorskip("agent_runs.dashboard")
    with make_client(dashboard.create_app(dashboard_pool)) as c:
        yield c


@dataclass
class Served:
    """A dashboard served by a real uvicorn in a thread."""

    url: str
    server: Any
    thread: threading.Thread


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def serve(app: Any, port: int | None = None) -> Served:
    uvicorn = pytest.importorskip("uvicorn")
    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise AssertionError("uvicorn did not start")
        time.sleep(0.02)
    return Served(f"http://127.0.0.1:{port}", server, thread)


def stop(served: Served) -> None:
    served.server.should_exit = True
    served.thread.join(timeout=10)


SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
}


def assert_secured(response: Any) -> None:
    """The security headers every response carries, and never a traceback in the body."""
    for name, value in SECURITY_HEADERS.items():
        assert response.headers.get(name) == value, (name, response.status_code)
    assert "Traceback" not in response.text
    assert 'File "' not in response.text


def finished_run(
    repo: agent_runs.AgentRunRepository,
    *,
    status: str = "completed",
    worker: str = "host-1",
    error_type: str | None = None,
    error_message: str | None = None,
    **kwargs: Any,
) -> agent_runs.AgentRun:
    """A run taken through real transitions: claimed by `worker`, then ended with `status`."""
    from tests.helpers import new_run

    run = new_run(repo, **kwargs)
    owner = f"{worker}:{run.id[-6:]}"
    claim = repo.mark_running(run.id, worker_id=owner, lease_seconds=60)
    assert claim.acquired
    result = repo.set_terminal_status(
        run.id,
        status=status,
        worker_id=owner,
        error_type=error_type,
        error_message=error_message,
    )
    assert result.changed and result.run is not None
    return result.run


def running_run(
    repo: agent_runs.AgentRunRepository, *, worker: str = "host-2", **kwargs: Any
) -> agent_runs.AgentRun:
    from tests.helpers import new_run

    run = new_run(repo, **kwargs)
    claim = repo.mark_running(run.id, worker_id=f"{worker}:{run.id[-6:]}", lease_seconds=300)
    assert claim.acquired and claim.run is not None
    return claim.run
