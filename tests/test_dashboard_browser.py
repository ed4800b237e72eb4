"""The dashboard in a real browser: Debian's chromium driven through Playwright's Python API
(executable_path: nothing is downloaded), against a real uvicorn on a free port. Skipped only
where /usr/bin/chromium (or the playwright package) is missing.

Waits are on page elements (a strict CSP blocks wait_for_function). Every test fails if a
dialog opens, a script error happens or the console reports an error (a CSP violation
included)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRunRepository
from tests.fix_dashboard import TOKEN, Served, finished_run, running_run, serve, stop
from tests.helpers import new_run

pytest.importorskip("starlette")
from agent_runs.dashboard import create_app, render

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
if not Path(CHROMIUM).exists():
    pytest.skip(f"no chromium at {CHROMIUM}", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")

ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


class Watched:
    """A page whose dialogs, script errors and console errors are recorded."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.problems: list[str] = []
        self.refusals: list[str] = []  # the URLs refused as the test expected
        self._refused: set[str] = set()
        page.on("dialog", self._dialog)
        page.on("pageerror", lambda error: self.problems.append(f"page error: {error}"))
        page.on("console", self._console)

    def expect_refusals(self, *urls: str) -> None:
        """Loads of exactly these URLs are refused on purpose (a 400, a 401): the console's
        report of each goes to `refusals`, not to `problems`, whenever it comes (a refused
        page's favicon is asked for after the page, and reported later still)."""
        self._refused.update(urls)

    def _console(self, msg: Any) -> None:
        if msg.type != "error":
            return
        url = (msg.location or {}).get("url", "")
        if msg.text.startswith("Failed to load resource") and url in self._refused:
            self.refusals.append(url)
        else:
            self.problems.append(f"console {msg.type}: {msg.text}")

    def _dialog(self, dialog: Any) -> None:
        self.problems.append(f"dialog: {dialog.message}")
        dialog.dismiss()


def watched_pages(browser: Any) -> Iterator[Any]:
    """An `open_page` fixture's body: opens watched pages in new contexts of `browser` and,
    after the test, closes them and asserts that none saw a problem."""
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
def open_page(browser: Any) -> Iterator[Any]:
    yield from watched_pages(browser)


@pytest.fixture
def server(dashboard_pool: ConnectionPool) -> Iterator[Served]:
    served = serve(create_app(dashboard_pool, allow_cancel=True))
    try:
        yield served
    finally:
        stop(served)


def test_walk_overview_filter_run_tree_and_cancel(
    server: Served, open_page: Any, repo: AgentRunRepository
) -> None:
    planner = running_run(repo, agent_slug="planner", worker="orchestrator")
    child = new_run(repo, agent_slug="researcher", created_by_run_id=planner.id)
    grandchild = running_run(repo, agent_slug="writer", created_by_run_id=child.id)
    finished_run(repo, agent_slug="planner")
    page = open_page().page

    page.goto(server.url + "/")
    page.get_by_role("heading", name="Live now").wait_for()
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Runs").click()
    page.get_by_role("heading", name="Runs", exact=True).wait_for()

    page.get_by_label("running", exact=True).check()
    page.get_by_label("Agent slug").fill("planner")
    page.get_by_role("button", name="Apply filters").click()
    page.wait_for_url("**/runs?status=running&agent_slug=planner**")
    rows = page.locator("#runs-list tbody tr")
    assert rows.count() == 1
    rows.first.get_by_role("link", name=planner.id).click()

    page.get_by_role("heading", name=f"Run {planner.id}").wait_for()
    tree = page.locator("#run-tree")
    tree.get_by_role("link", name=child.id).click()
    page.get_by_role("heading", name=f"Run {child.id}").wait_for()
    assert page.locator("#run-tree").get_by_role("link", name=planner.id).count() >= 1
    page.locator("#run-tree").get_by_role("link", name=planner.id).first.click()
    page.get_by_role("heading", name=f"Run {planner.id}").wait_for()

    page.get_by_role("link", name="Cancel it and its sub-agent runs…").click()
    page.get_by_role("heading", name="Cancel this run and its sub-agent runs?").wait_for()
    unchanged = repo.get_run(planner.id)
    assert unchanged is not None and unchanged.status == "running"
    page.get_by_role("button", name="Yes, cancel the tree").click()
    page.get_by_role("heading", name="Cancel requested").wait_for()
    statuses = [r.status for r in map(repo.get_run, (planner.id, child.id, grandchild.id)) if r]
    assert statuses == ["cancel_requested", "cancelled", "cancel_requested"]


def test_an_open_page_shows_a_run_change_state_without_a_reload(
    server: Served, open_page: Any, repo: AgentRunRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(render, "REFRESH_SECONDS", 1)  # the page tells its script how often
    run = running_run(repo, worker="host-live")
    page = open_page().page
    page.goto(f"{server.url}/runs/{run.id}")
    page.locator("#run-head .status.s-running").wait_for()
    navigations: list[str] = []
    page.on("framenavigated", lambda frame: navigations.append(frame.url))
    assert run.worker_id is not None
    repo.set_terminal_status(run.id, status="completed", worker_id=run.worker_id)
    page.locator("#run-head .status.s-completed").wait_for(timeout=20_000)
    page.locator("#run-attempts .status.s-completed").wait_for()
    assert navigations == []  # swapped in place, not reloaded
    # The run is final now: its page stops refreshing.
    assert "final: no more refresh" in page.locator("#live-state").inner_text()
    page.goto(f"{server.url}/runs?status=pending")
    new = new_run(repo)
    page.locator("#runs-list").get_by_role("link", name=new.id).wait_for(timeout=20_000)


HOSTILE_THREAD = "<script>alert('thread')</script>"
HOSTILE_SLUG = '"><img src=x onerror=alert(1)>'
HOSTILE_MESSAGE = "\u202eevil\x1b[31m <img src=x onerror=alert(2)> javascript:alert(3) \ud800"


def test_hostile_strings_stay_text_in_the_browser(
    server: Served, open_page: Any, repo: AgentRunRepository
) -> None:
    run = finished_run(
        repo,
        status="failed",
        thread_id=HOSTILE_THREAD,
        agent_slug=HOSTILE_SLUG,
        uid="javascript:alert(4)",
        error_type="<b>x</b>",
        error_message=HOSTILE_MESSAGE + "x" * 20_000,
        input_payload={"html": "</pre><script>alert(5)</script>", "big": "y" * 1_000_000},
        worker="w<svg onload=alert(6)>",
    )
    page = open_page().page
    for path in ("/", "/runs", f"/runs/{run.id}", "/workers", f"/cancel/{run.id}"):
        page.goto(server.url + path)
        page.locator("main h1").wait_for()
        assert page.locator("main img").count() == 0
        assert page.locator("main script").count() == 0
        assert page.locator("main b").count() == 0
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 1280, (path, width)  # nothing breaks the layout
    page.goto(f"{server.url}/runs/{run.id}")
    fields = page.locator("dl.fields").inner_text()
    assert HOSTILE_THREAD in fields and HOSTILE_SLUG in fields
    assert "\\u202eevil\\e[31m <img src=x onerror=alert(2)> javascript:alert(3) \ufffd" in fields
    links = page.locator("a").evaluate_all("links => links.map(a => a.href)")
    assert all(href.startswith(server.url) for href in links), links
    assert page.locator("pre.json").inner_text().endswith("more characters]")


def test_login_with_the_token_in_the_browser(
    dashboard_pool: ConnectionPool, open_page: Any, repo: AgentRunRepository
) -> None:
    finished_run(repo)
    served = serve(create_app(dashboard_pool, token=TOKEN))
    try:
        watched = open_page()
        page = watched.page
        watched.expect_refusals(served.url + "/")
        with page.expect_console_message(lambda message: "status of 401" in message.text):
            response = page.goto(served.url + "/")
        assert response is not None and response.status == 401
        assert watched.refusals == [served.url + "/"]  # the 401, reported by the console
        page.get_by_role("link", name="Log in with the dashboard's token").click()
        page.get_by_label("Dashboard token").fill(TOKEN)
        page.get_by_role("button", name="Log in").click()
        page.get_by_role("heading", name="Live now").wait_for()
        cookies = page.context.cookies()
        assert [c["httpOnly"] and c["sameSite"] == "Strict" for c in cookies] == [True]
        assert TOKEN not in str(cookies)
    finally:
        stop(served)


def test_after_the_login_the_browser_is_back_on_the_page_it_asked_for(
    dashboard_pool: ConnectionPool, open_page: Any, repo: AgentRunRepository
) -> None:
    run = finished_run(repo, status="failed", error_type="tool_error")
    served = serve(create_app(dashboard_pool, token=TOKEN))
    try:
        watched = open_page()
        page = watched.page
        wanted = f"{served.url}/runs?status=failed&agent_slug={run.agent_slug}"
        watched.expect_refusals(wanted, f"{served.url}/login")
        refused = {"predicate": lambda message: "status of 401" in message.text}
        with page.expect_console_message(**refused):  # the console's report of the 401
            response = page.goto(wanted)
        assert response is not None and response.status == 401
        page.get_by_role("link", name="Log in with the dashboard's token").click()
        page.get_by_label("Dashboard token").fill("not the token")
        with page.expect_console_message(**refused):
            page.get_by_role("button", name="Log in").click()
        page.get_by_role("alert").wait_for()
        assert watched.refusals == [wanted, f"{served.url}/login"]  # the page, the wrong token
        page.get_by_label("Dashboard token").fill(TOKEN)  # a failed try keeps the way back
        page.get_by_role("button", name="Log in").click()
        page.locator(f'a[href="/runs/{run.id}"]').first.wait_for()
        assert page.url == wanted
    finally:
        stop(served)


_SET_VISIBILITY = """state => {
    Object.defineProperty(document, "visibilityState", {value: state, configurable: true});
    Object.defineProperty(document, "hidden", {value: state === "hidden", configurable: true});
    document.dispatchEvent(new Event("visibilitychange"));
}"""


def test_the_refresh_pauses_while_the_tab_is_hidden(
    server: Served, open_page: Any, repo: AgentRunRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(render, "REFRESH_SECONDS", 1)
    run = running_run(repo, worker="host-hidden")
    page = open_page().page
    page.goto(f"{server.url}/runs/{run.id}")
    page.locator("#run-head .status.s-running").wait_for()
    page.evaluate(_SET_VISIBILITY, "hidden")  # as the browser does when the tab is hidden
    page.get_by_text("live: paused while hidden").wait_for()
    page.wait_for_timeout(600)  # a refresh already in flight when the tab hid has landed
    assert run.worker_id is not None
    repo.set_terminal_status(run.id, status="completed", worker_id=run.worker_id)
    page.wait_for_timeout(3000)  # three refresh periods: none may happen while hidden
    assert page.locator("#run-head .status.s-running").count() == 1
    page.evaluate(_SET_VISIBILITY, "visible")
    page.locator("#run-head .status.s-completed").wait_for(timeout=5000)
