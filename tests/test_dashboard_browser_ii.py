"""The dashboard in Chromium against a hostile network and a reader at work: a name rebound
to 127.0.0.1 gets nothing (Host allow-list), and the page never moves under its reader.

Chromium's --host-resolver-rules maps rebind.example to 127.0.0.1, as DNS rebinding does: the
browser then sends `Host: rebind.example:PORT` and treats the dashboard as that site's own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRunRepository
from tests.fix_dashboard import Served, free_port, running_run, serve, stop
from tests.test_dashboard_browser import ARGS, CHROMIUM, Watched, sync_api

from agent_runs.dashboard import create_app  # isort: skip
from agent_runs.dashboard.hosts import served_hosts  # isort: skip

REBOUND = "rebind.example"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        rules = f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1"
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=[*ARGS, rules])
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def open_page(browser: Any) -> Iterator[Any]:
    contexts: list[Any] = []
    watched: list[Watched] = []

    def opener(width: int = 1280, height: int = 900, **kwargs: Any) -> Watched:
        context = browser.new_context(viewport={"width": width, "height": height}, **kwargs)
        contexts.append(context)
        page = Watched(context.new_page())
        page.page.set_default_timeout(15_000)
        watched.append(page)
        return page

    yield opener
    for context in contexts:
        context.close()
    for page in watched:
        assert page.problems == []


@pytest.fixture
def server(dashboard_pool: ConnectionPool) -> Iterator[Served]:
    port = free_port()
    app = create_app(
        dashboard_pool, allow_cancel=True, allowed_hosts=served_hosts("127.0.0.1", port)
    )
    served = serve(app, port)
    try:
        yield served
    finally:
        stop(served)


def test_a_rebound_name_gets_nothing(
    server: Served, open_page: Any, repo: AgentRunRepository
) -> None:
    run = running_run(repo, input_payload={"secret": "only-for-the-operator"})
    port = server.url.rsplit(":", 1)[1]
    watched = open_page()
    page = watched.page
    response = page.goto(f"http://{REBOUND}:{port}/runs/{run.id}")
    assert response is not None and response.status == 400
    body = page.locator("body").inner_text()
    assert "does not answer to the Host" in body
    assert run.id not in body and "only-for-the-operator" not in body
    assert [p for p in watched.problems if "status of 400" not in p] == []
    watched.problems.clear()  # the 400 itself, reported by the console
    for own in (f"http://localhost:{port}", server.url):
        ok = page.goto(f"{own}/runs/{run.id}")
        assert ok is not None and ok.status == 200
        page.get_by_role("heading", name=f"Run {run.id}").wait_for()
