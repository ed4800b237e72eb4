"""Every user or agent field hostile at once, every page loaded in Chromium: nothing runs,
nothing opens a dialog or reports a console error, nothing leaves its box, every page stays
under PAGE_BYTES, the text shows escaped as the CLI shows it, and every link we build stays
on the dashboard with the run id percent-encoded."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository
from agent_runs.display import escape
from tests.fix_dashboard import Served, serve, stop

pytest.importorskip("starlette")
from agent_runs.dashboard import create_app
from agent_runs.dashboard.render import run_segment

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
if not Path(CHROMIUM).exists():
    pytest.skip(f"no chromium at {CHROMIUM}", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")

# The bound we state for any HTML page, whatever the database holds (README).
PAGE_BYTES: Final = 1_000_000
BIG: Final = 5 * 1024 * 1024
HOSTILE: Final = (
    "<script>alert(1)</script>",
    '"><img src=x onerror=alert(1)>',
    "javascript:alert(1)",
    "{{7*7}}${7*7}",
    "\u202eevil\u2066x\u2069 bidi",
    "c0\x01\x07\x1b[31mred\x1b[0m c1\x85\x9b",
    "cr\r\nlf\u2028ls\u2029ps",
    "'onmouseover=alert(1) x='",
)
# Run ids a user may choose: a slash, a query, a fragment, a scheme, markup.
RUN_IDS: Final = (
    "<script>alert(1)</script>",
    '"><img src=x onerror=alert(1)>',
    "javascript:alert(1)",
    "a/b/../c",
    "x?y=1#z&status=bogus",
    "%2F%00\u202e",
    "{{7*7}}",
    "cr\r\nlf\u2028",
    "..",
    ".",
)


def hostile_run(repo: AgentRunRepository, index: int, parent: str | None) -> AgentRun:
    h = HOSTILE[index % len(HOSTILE)]
    big = BIG if index < 2 else 50_000  # two runs carry 5 MB strings: enough, and fast
    run = repo.create_run(
        run_id=RUN_IDS[index],
        thread_id=h[:60] + str(index),
        agent_slug=h[:64],
        uid=h[:64],
        request_id=f"{h[:50]}{index}",
        created_by_run_id=parent,
        input_payload={h: h, "nested": {h: [h, "<b>bold</b>"]}, "big": "y" * big},
    )
    worker = f"{h[:80]}:{index}"
    assert repo.mark_running(run.id, worker_id=worker, lease_seconds=300).acquired
    repo.record_run_manifest(
        run.id, manifest={h: h, "big": "z" * big}, fingerprint="ab" * 32, worker_id=worker
    )
    if index % 2:
        return run
    result = repo.set_terminal_status(
        run.id,
        status="failed",
        worker_id=worker,
        error_type=h[:64],
        error_message=h + "m" * big,
    )
    assert result.run is not None
    return result.run


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--no-first-run"]
        )
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def served(dashboard_pool: ConnectionPool) -> Iterator[Served]:
    server = serve(create_app(dashboard_pool, allow_cancel=True))
    try:
        yield server
    finally:
        stop(server)


def pages(runs: list[AgentRun]) -> list[str]:
    paths = ["/", "/runs", "/workers", "/workers?since=7d", "/runs?stuck=1"]
    for run in runs:
        rid = run_segment(run.id)
        paths += [f"/runs/{rid}", f"/tree/{rid}", f"/cancel/{rid}", f"/cancel-tree/{rid}"]
        for name, value in (
            ("thread", run.thread_id),
            ("agent_slug", run.agent_slug),
            ("uid", run.uid),
            ("worker", run.worker_id or ""),
        ):
            paths.append(f"/runs?{name}={quote(value, safe='')}")
    for h in ("".join(HOSTILE), "x" * 5000):
        q = quote(h, safe="")
        paths += [
            f"/runs/{q}",
            f"/runs/{q}%2F..%2F%00",
            f"/tree/{q}",
            f"/json/{q}/{q}",
            f"/runs?status={q}",
            f"/runs?limit={q}",
            f"/runs?before={q}",
            f"/runs?since={q}",
            f"/runs?{q}={q}",
            f"/workers?since={q}",
            f"/nowhere/{q}",
        ]
    return paths


def test_every_page_with_every_field_hostile(
    served: Served, browser: Any, repo: AgentRunRepository
) -> None:
    runs: list[AgentRun] = []
    for index in range(len(RUN_IDS)):
        runs.append(hostile_run(repo, index, runs[-1].id if runs else None))
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(15_000)
    problems: list[str] = []

    def dialog(d: Any) -> None:
        problems.append(f"dialog {d.message}")
        d.dismiss()

    page.on("dialog", dialog)
    page.on("pageerror", lambda e: problems.append(f"page error {e}"))
    console: list[str] = []  # every console error, the 400/404 pages' own included
    page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
    try:
        for path in pages(runs):
            response = page.goto(served.url + path)
            assert response is not None, path
            assert response.status in (200, 400, 404), (path, response.status)
            assert len(response.body()) < PAGE_BYTES, path
            page.locator("main h1").wait_for()
            for tag in ("img", "script", "b", "svg image", "iframe", "[onerror]", "[style]"):
                assert page.locator(f"main {tag}").count() == 0, (path, tag)
            if response.status == 200:
                assert console == [], (path, console)
            console.clear()
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 1280, (path, width)
            hrefs = page.locator("a[href], form[action], link[href], script[src]").evaluate_all(
                "els => els.map(e => e.href || e.action || e.src)"
            )
            assert all(h.startswith(served.url + "/") for h in hrefs), (path, hrefs)
        assert problems == []
        for run in runs:  # the whole documents, as the browser shows JSON
            for kind in ("payload", "manifest", "run"):
                response = page.goto(f"{served.url}/json/{kind}/{run_segment(run.id)}")
                assert response is not None and response.status == 200
                assert response.headers["content-type"] == "application/json; charset=utf-8"
                assert page.locator("script, img").count() == 0
        assert console == [] and problems == []
        for run in runs:
            page.goto(f"{served.url}/runs/{run_segment(run.id)}")
            page.locator("main h1").wait_for()
            assert page.title().startswith("Run "), (run.id, page.title(), page.url)
            assert page.locator("h1 .mono").inner_text() == escape(run.id)
            fields = page.locator("dl.fields").inner_text()
            for value in (run.thread_id, run.agent_slug, run.uid):
                assert escape(value) in fields, value
            documents = page.locator("pre.json").all_inner_texts()
            assert all(d.endswith("more characters]") for d in documents)
            # Each run link of the runs list opens that run's page.
        page.goto(served.url + "/runs?limit=100")
        links = page.locator("#runs-list td a.mono")
        assert links.count() == len(runs)
        for i in range(links.count()):
            # A long id is shown short; its whole value is the (copyable) text the link holds.
            shown = links.nth(i).evaluate("a => (a.querySelector('.copy') || a).textContent")
            links.nth(i).click()
            assert page.locator("h1 .mono").inner_text() == shown
            page.go_back()
        assert problems == []
    finally:
        context.close()
