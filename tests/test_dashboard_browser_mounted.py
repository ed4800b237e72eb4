"""The dashboard mounted under /ops inside a parent Starlette app, with a token and cancel on,
in Chromium: log in, every link, form action, static file and the live refresh work under the
prefix, and cancel goes through its confirmation page."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRunRepository
from tests.fix_dashboard import TOKEN, Served, running_run, serve, stop
from tests.helpers import new_run

pytest.importorskip("starlette")
from agent_runs.dashboard import create_app, render

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
if not Path(CHROMIUM).exists():
    pytest.skip(f"no chromium at {CHROMIUM}", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")


@pytest.fixture
def mounted(dashboard_pool: ConnectionPool) -> Iterator[Served]:
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route

    dashboard = create_app(dashboard_pool, allow_cancel=True, token=TOKEN)
    parent = Starlette(
        routes=[
            Route("/", lambda request: PlainTextResponse("parent")),
            Mount("/ops", app=dashboard),
        ]
    )
    served = serve(parent)
    try:
        yield served
    finally:
        stop(served)


def test_under_ops_login_links_static_refresh_and_cancel(
    mounted: Served, repo: AgentRunRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(render, "REFRESH_SECONDS", 1)
    live = running_run(repo, agent_slug="mounted-agent", worker="ops-host")
    pending = new_run(repo, agent_slug="mounted-agent")
    ops = mounted.url + "/ops"
    problems: list[str] = []
    requested: list[tuple[str, int]] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(15_000)

            def dialog(d: Any) -> None:
                problems.append(d.message)
                d.dismiss()

            page.on("dialog", dialog)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on("response", lambda r: requested.append((r.url, r.status)))
            page.goto(ops + "/login")
            page.get_by_label("Dashboard token").fill(TOKEN)
            page.get_by_role("button", name="Log in").click()
            page.get_by_role("heading", name="Live now").wait_for()
            assert page.url == ops + "/"
            # The style sheet applies (its own rules, loaded from /ops/static).
            display = page.locator("a.skip").evaluate("e => getComputedStyle(e).position")
            assert display == "absolute"
            page.get_by_role("navigation", name="Main").get_by_role("link", name="Runs").click()
            page.get_by_label("Agent slug").fill("mounted-agent")
            page.get_by_role("button", name="Apply filters").click()
            page.wait_for_url(ops + "/runs?agent_slug=mounted-agent**")
            page.locator("#runs-list").get_by_role("link", name=pending.id).click()
            page.get_by_role("heading", name=f"Run {pending.id}").wait_for()
            page.get_by_role("link", name="Cancel this run…").click()
            page.get_by_role("button", name="Yes, cancel the run").click()
            page.get_by_role("heading", name="Cancel requested").wait_for()
            after = repo.get_run(pending.id)
            assert after is not None and after.status == "cancelled"
            page.get_by_role("link", name="Back to the run").click()
            page.locator("#run-head .status.s-cancelled").wait_for()
            # The live refresh, under the prefix: a change in the database, no reload.
            page.goto(f"{ops}/runs/{live.id}")
            page.locator("#run-head .status.s-running").wait_for()
            assert live.worker_id is not None
            repo.set_terminal_status(live.id, status="completed", worker_id=live.worker_id)
            page.locator("#run-head .status.s-completed").wait_for(timeout=20_000)
            page.get_by_role("navigation", name="Main").get_by_role("link", name="Workers").click()
            page.get_by_role("heading", name="Worker identities").wait_for()
            page.get_by_role("button", name="Log out").click()
            page.get_by_role("heading", name="Log in").wait_for()
            last = page.goto(ops + "/")
            assert last is not None and last.status == 401
        finally:
            browser.close()
    assert problems == []
    assert [(u, s) for u, s in requested if "/static/" in u and s != 200] == []
    assert all(u.startswith(ops) or u == mounted.url + "/ops" for u, _ in requested), requested
