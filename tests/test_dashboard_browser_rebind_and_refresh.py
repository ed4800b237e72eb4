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
from tests.fix_dashboard import Served, finished_run, free_port, running_run, serve, stop
from tests.test_dashboard_browser import ARGS, CHROMIUM, sync_api, watched_pages

from agent_runs.dashboard import create_app, render  # isort: skip
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
    yield from watched_pages(browser)


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
    rebound = f"http://{REBOUND}:{port}"
    # The page and the favicon the browser then asks for are both refused (400).
    watched.expect_refusals(f"{rebound}/runs/{run.id}", f"{rebound}/favicon.ico")
    response = page.goto(f"{rebound}/runs/{run.id}")
    assert response is not None and response.status == 400
    body = page.locator("body").inner_text()
    assert "does not answer to the Host" in body
    assert run.id not in body and "only-for-the-operator" not in body
    for own in (f"http://localhost:{port}", server.url):
        ok = page.goto(f"{own}/runs/{run.id}")
        assert ok is not None and ok.status == 200
        page.get_by_role("heading", name=f"Run {run.id}").wait_for()


TRACEBACK = (
    "Traceback (most recent call last):\n"
    + "".join(
        f'  File "agent.py", line {n}, in step_{n}\n    result = call_tool(args)\n'
        for n in range(60)
    )
    + "ToolError: the search API answered 429"
)


def _retried_then_running(repo: AgentRunRepository, worker: str = "host-read") -> Any:
    """A running run whose first attempt was released for retry with a long traceback."""
    run = running_run(repo, worker=worker)
    assert run.worker_id is not None
    assert repo.release_lease_for_retry(
        run.id, worker_id=run.worker_id, error_type="rate_limited", error_message=TRACEBACK
    )
    claim = repo.mark_running(run.id, worker_id=f"{worker}:again", lease_seconds=300)
    assert claim.acquired and claim.run is not None
    return claim.run


_SELECT_START = """(element, length) => {
    const range = document.createRange();
    range.setStart(element.firstChild, 0);
    range.setEnd(element.firstChild, length);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
    return selection.toString();
}"""


def _next_refresh(page: Any, after: str | None) -> str:
    """Wait (on page elements: the CSP forbids wait_for_function) for a refresh after `after`."""
    for _ in range(100):
        stamp = page.locator("body").get_attribute("data-refreshed")
        if stamp is not None and stamp != after:
            return str(stamp)
        page.wait_for_timeout(100)
    raise AssertionError("no refresh happened")


def test_a_selection_and_a_scrolled_box_survive_the_refresh(
    server: Served, open_page: Any, repo: AgentRunRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(render, "REFRESH_SECONDS", 1)
    run = _retried_then_running(repo)
    page = open_page().page
    page.goto(f"{server.url}/runs/{run.id}")
    box = page.locator("#run-attempts pre.text").first
    assert '\n  File "agent.py", line 3, in step_3\n' in box.inner_text()  # lines kept
    # Select the traceback's first line, as a reader copying it does.
    first_line = "Traceback (most recent call last):"
    assert box.evaluate(_SELECT_START, len(first_line)) == first_line
    stamp = _next_refresh(page, None)
    stamp = _next_refresh(page, stamp)
    assert page.evaluate("window.getSelection().toString()") == first_line
    assert page.locator("body").get_attribute("data-kept") != "0"
    page.evaluate("window.getSelection().removeAllRanges()")
    # Scrolled: the box keeps its place across refreshes.
    box = page.locator("#run-attempts pre.text").first
    box.evaluate("element => { element.scrollTop = 120; }")
    stamp = _next_refresh(page, stamp)
    stamp = _next_refresh(page, stamp)
    assert page.locator("#run-attempts pre.text").first.evaluate("e => e.scrollTop") == 120
    box.evaluate("element => { element.scrollTop = 0; }")
    # Neither: the region is swapped, and a change of state shows.
    assert run.worker_id is not None
    repo.set_terminal_status(run.id, status="completed", worker_id=run.worker_id)
    page.locator("#run-head .status.s-completed").wait_for(timeout=20_000)
    page.get_by_text("final: no more refresh").wait_for()
    assert page.locator("#live-toggle").is_hidden()


def test_a_final_run_is_never_refreshed(
    server: Served, open_page: Any, repo: AgentRunRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(render, "REFRESH_SECONDS", 1)
    run = finished_run(repo, status="failed", error_type="tool_error", error_message=TRACEBACK)
    page = open_page().page
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.goto(f"{server.url}/runs/{run.id}")
    assert page.locator("body").get_attribute("data-refresh") is None
    assert "final" in page.locator("#live-state").inner_text()
    page.wait_for_timeout(2500)
    assert [u for u in requests if "/runs/" in u] == [f"{server.url}/runs/{run.id}"]


def test_pause_is_remembered_for_the_session_and_the_tree_refreshes(
    server: Served, open_page: Any, repo: AgentRunRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(render, "REFRESH_SECONDS", 1)
    root = running_run(repo, agent_slug="planner")
    child = running_run(repo, agent_slug="writer", created_by_run_id=root.id)
    page = open_page().page
    page.goto(f"{server.url}/tree/{root.id}")
    stamp = _next_refresh(page, None)  # the tree refreshes
    page.get_by_role("button", name="Pause").click()
    page.get_by_text("live: paused").wait_for()
    page.goto(f"{server.url}/tree/{root.id}")  # remembered across pages of the session
    page.get_by_role("button", name="Resume").wait_for()
    assert child.worker_id is not None
    repo.set_terminal_status(
        child.id, status="failed", worker_id=child.worker_id, error_type="tool_error"
    )
    page.wait_for_timeout(2500)
    assert page.locator("#tree .status.s-failed").count() == 0
    assert page.locator("body").get_attribute("data-refreshed") is None
    page.get_by_role("button", name="Resume").click()
    page.locator("#tree .status.s-failed").wait_for(timeout=10_000)
    assert page.locator("#tree").get_by_text("tool_error").count() == 1
    assert stamp


def test_the_runs_table_fits_at_1280_with_one_line_rows_and_folds_at_390(
    server: Served, open_page: Any, repo: AgentRunRepository
) -> None:
    live = running_run(repo, agent_slug="x" * 64, thread_id="t" * 64, uid="u" * 64)
    assert live.worker_id is not None
    repo.request_cancel(live.id)  # the widest status: cancel_requested
    for n in range(11):
        finished_run(
            repo,
            status="failed" if n % 2 else "completed",
            agent_slug=f"a-very-long-agent-slug-for-the-research-team-{n:02d}"[:64],
            thread_id=f"support-ticket-thread-with-a-long-name-{n:04d}-" + "t" * 20,
            uid=f"user-with-a-long-identifier-{n}@example.com",
            error_type="tool_error_from_the_search_api" if n % 2 else None,
            worker="worker-with-a-long-identity-name-on-host-17",
        )
    page = open_page().page
    page.goto(f"{server.url}/runs")
    wrap = page.locator("#runs-list .table-wrap")
    assert wrap.evaluate("e => e.scrollWidth <= e.clientWidth"), "a sideways scroll at 1280 px"
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    heights = page.locator("#runs-list tbody tr").evaluate_all(
        "rows => rows.map(r => r.getBoundingClientRect().height)"
    )
    assert len(heights) == 12 and max(heights) < 40, heights  # one line per row
    headers = page.locator("#runs-list thead th").all_inner_texts()
    assert "Duration" in headers and "Finished" in headers and "Error type" in headers
    cells = page.locator("#runs-list tbody td:last-child a").all_inner_texts()
    assert "tool_error_from_the_search_api" in cells  # whole, not cut
    # A phone: the page does not scroll sideways, the filters start folded.
    phone = open_page(width=390, height=844).page
    phone.goto(f"{server.url}/runs")
    assert phone.evaluate("document.documentElement.scrollWidth") <= 390
    assert phone.locator("details.filters-box").evaluate("d => d.open") is False
    assert phone.get_by_role("button", name="Apply filters").is_hidden()
    phone.get_by_label("Go to run").wait_for()


def test_dark_mode_follows_the_system(server: Served, open_page: Any) -> None:
    page = open_page(color_scheme="dark").page
    page.goto(f"{server.url}/")
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(13, 17, 23)", background
    light = open_page(color_scheme="light").page
    light.goto(f"{server.url}/")
    assert light.evaluate("getComputedStyle(document.body).backgroundColor") == (
        "rgb(255, 255, 255)"
    )


def test_from_the_overview_to_the_runs_behind_a_count_and_a_bulk_cancel(
    server: Served, open_page: Any, repo: AgentRunRepository
) -> None:
    failed = [
        finished_run(repo, status="failed", error_type="rate_limited", agent_slug="scout")
        for _ in range(2)
    ]
    finished_run(repo, agent_slug="scout")
    live = [running_run(repo, agent_slug="scout") for _ in range(2)]
    page = open_page().page
    page.goto(f"{server.url}/")
    agents = page.locator("#agents")
    agents.get_by_role("link", name="rate_limited").click()
    page.wait_for_url("**/runs?agent_slug=scout&finished=1d&error_type=rate_limited")
    ids = page.locator("#runs-list td a.run-id .copy").all_inner_texts()
    assert sorted(ids) == sorted(r.id for r in failed)
    # Go to a run by the start of its id.
    page.get_by_label("Go to run").fill(live[0].id[:-4])
    page.get_by_role("button", name="Go", exact=True).click()
    page.get_by_role("heading", name=f"Run {live[0].id}").wait_for()
    # Select the two running runs, cancel them after one confirmation.
    page.goto(f"{server.url}/runs?status=running")
    for run in live:
        row = page.locator("#runs-list tbody tr", has=page.locator(f"text={run.id}"))
        row.get_by_role("checkbox").check()
    page.get_by_role("button", name="Cancel the selected runs…").click()
    page.get_by_role("heading", name="Cancel these 2 runs?").wait_for()
    page.get_by_role("button", name="Yes, cancel these runs").click()
    page.get_by_text("2 of 2 runs changed.").wait_for()
    assert "/done/cancel?" in page.url
    statuses = [r.status for r in (repo.get_run(x.id) for x in live) if r]
    assert statuses == ["cancel_requested", "cancel_requested"]
    page.reload()  # a result page: nothing is sent again
    page.get_by_text("2 of 2 runs changed.").wait_for()
