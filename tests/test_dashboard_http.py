"""The dashboard at HTTP level against the real PostgreSQL: every route, the filters of /runs,
keyset pages, bad parameters (400 naming them), unknown runs (404), a slow query (503, pool
still healthy), documents cut with a link to the whole, and the app mounted under /ops."""

from __future__ import annotations

import json
import re
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRunRepository
from agent_runs.explain import explain_run
from tests.fix_dashboard import assert_secured, finished_run, make_client, running_run
from tests.helpers import new_run

pytest.importorskip("starlette")
from agent_runs.dashboard import create_app


def run_ids(html: str) -> set[str]:
    """The run ids the page links to."""
    return set(re.findall(r'href="/runs/([0-9a-f-]{36})"', html))


def test_every_page_renders(client: Any, repo: AgentRunRepository) -> None:
    parent = finished_run(repo, worker="host-1")
    child = running_run(repo, created_by_run_id=parent.id)
    failed = finished_run(repo, status="failed", error_type="tool_error", error_message="boom")
    pages = {
        "/": ["Live now", "Finished runs per minute", "tool_error", "host-1"],
        "/runs": [parent.id, child.id, failed.id],
        f"/runs/{parent.id}": [parent.id, child.id, "completed"],
        "/workers": ["host-1", "host-2"],
        f"/tree/{child.id}": [parent.id, child.id],
    }
    for path, expected in pages.items():
        response = client.get(path)
        assert response.status_code == 200, path
        assert response.headers["content-type"] == "text/html; charset=utf-8"
        assert_secured(response)
        for text in expected:
            assert text in response.text, (path, text)
    health = client.get("/healthz")
    assert health.status_code == 200 and health.text == "ok\n"
    assert_secured(health)
    head = client.head("/runs")
    assert head.status_code == 200 and head.content == b""


def test_overview_counts_live_and_finished_runs(client: Any, repo: AgentRunRepository) -> None:
    for _ in range(3):
        new_run(repo)
    running_run(repo)
    finished_run(repo, status="failed", error_type="rate_limited", agent_slug="planner")
    html = client.get("/").text
    live = html.split('id="live-now"', 1)[1].split("</section>", 1)[0]
    numbers = re.findall(r'<span class="num big">([0-9,]+)</span>', live)
    assert numbers[:3] == ["3", "1", "0"]  # pending, running, cancel_requested
    agents = html.split('id="agents"', 1)[1].split("</section>", 1)[0]
    assert "planner" in agents and "rate_limited" in agents and "100.0 %" in agents
    assert "<svg" in html and 'class="bar-other"' in html  # the failed run's minute


def test_runs_filters_each_narrow_the_list(client: Any, repo: AgentRunRepository) -> None:
    a = finished_run(repo, agent_slug="alpha", thread_id="t-1", uid="u-1", worker="host-a")
    b = finished_run(repo, status="failed", agent_slug="beta", thread_id="t-2", uid="u-2")
    c = running_run(repo, agent_slug="alpha", thread_id="t-3", uid="u-2", worker="host-c")
    d = new_run(repo, agent_slug="gamma", thread_id="t-4", uid="u-3")
    cases = {
        "status=completed": {a.id},
        "status=failed&status=running": {b.id, c.id},
        "agent_slug=alpha": {a.id, c.id},
        "thread=t-2": {b.id},
        "uid=u-2": {b.id, c.id},
        "worker=host-a": {a.id},
        "worker=host-c&status=running": {c.id},
        "status=pending&agent_slug=gamma": {d.id},
        "since=1h": {a.id, b.id, c.id, d.id},
        "since=2999-01-01T00:00:00Z": set(),
        "stuck=1": set(),
        # A minute, not a second: the running run's heartbeat is as old as this test (load).
        "stuck=1&stuck_after=1m&status=": set(),
        "agent_slug=&thread=&uid=&worker=&since=": {a.id, b.id, c.id, d.id},
    }
    for query, expected in cases.items():
        response = client.get(f"/runs?{query}")
        assert response.status_code == 200, (query, response.text[:500])
        assert run_ids(response.text) == expected, query


def test_scheduled_runs_are_counted_apart_from_pending_and_listed_soonest_first(
    client: Any, repo: AgentRunRepository
) -> None:
    due = new_run(repo)
    later = new_run(repo, available_at=datetime.now(UTC) + timedelta(hours=2))
    soon = new_run(repo, available_at=datetime.now(UTC) + timedelta(hours=1))
    html = client.get("/").text
    live = html.split('id="live-now"', 1)[1].split("</section>", 1)[0]
    numbers = re.findall(r'<span class="num big">([0-9,]+)</span>', live)
    assert numbers[0] == "1" and numbers[3] == "2"  # pending now; scheduled
    assert 'href="/runs?scheduled=1"' in live
    listed = client.get("/runs?scheduled=1").text
    assert run_ids(listed) == {soon.id, later.id} and due.id not in listed
    assert listed.index(soon.id) < listed.index(later.id)
    for bad in ("scheduled=maybe", "scheduled=1&status=failed", "scheduled=1&stuck=1"):
        response = client.get(f"/runs?{bad}")
        assert response.status_code == 400, bad
        assert ("scheduled" if "maybe" in bad else bad.split("&")[1].split("=")[0]) in (
            response.text
        )


def test_stuck_filter_finds_a_lost_lease(
    client: Any, repo: AgentRunRepository, observer: psycopg.Connection[Any]
) -> None:
    lost = running_run(repo)
    running_run(repo)
    observer.execute(
        "UPDATE agent_runs SET lease_expires_at = now() - interval '1 minute',"
        " heartbeat_at = now() - interval '2 minutes' WHERE id = %s",
        (lost.id,),
    )
    assert run_ids(client.get("/runs?stuck=1").text) == {lost.id}
    assert lost.id in client.get("/").text.split('id="stuck"', 1)[1]


def test_keyset_pages_cover_every_run_once(client: Any, repo: AgentRunRepository) -> None:
    created = {new_run(repo).id for _ in range(7)}
    seen: list[str] = []
    link = "/runs?limit=3"
    pages = 0
    while link:
        html = client.get(link).text
        ids = re.findall(r'href="/runs/([0-9a-f-]{36})"', html)
        seen.extend(dict.fromkeys(ids))
        found = re.search(r'rel="next" href="([^"]+)"', html)
        link = found.group(1).replace("&amp;", "&") if found else ""
        pages += 1
        assert pages < 10
    assert pages == 3
    assert len(seen) == 7 and set(seen) == created
    assert "before=" in client.get("/runs?limit=3").text


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("status=bogus", "status"),
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=ten", "limit"),
        ("since=yesterday", "since"),
        ("stuck=maybe", "stuck"),
        ("stuck_after=5x", "stuck_after"),
        ("before=not-a-cursor", "before"),
        ("sort=id", "sort"),
        ("agent_slug=" + "a" * 65, "agent_slug"),
        ("thread=%00", "thread"),
        ("uid=a&uid=b", "uid"),
        ("worker=" + "w" * 129, "worker"),
    ],
)
def test_a_bad_parameter_is_a_400_page_naming_it(client: Any, query: str, name: str) -> None:
    response = client.get(f"/runs?{query}")
    assert response.status_code == 400
    assert_secured(response)
    assert f"Bad parameter: {name}" in response.text or f"{name} must" in response.text


def test_other_pages_refuse_unknown_parameters(client: Any, repo: AgentRunRepository) -> None:
    run = new_run(repo)
    for path in ("/?x=1", f"/runs/{run.id}?debug=1", "/workers?since=forever", "/healthz?a=b"):
        response = client.get(path)
        assert response.status_code == 400, path
        assert_secured(response)


@pytest.mark.parametrize(
    "path",
    [
        "/runs/no-such-run",
        "/runs/" + "x" * 300,
        "/runs/%00",
        "/runs/%ED%A0%80",
        "/tree/no-such-run",
        "/json/payload/no-such-run",
        "/json/secrets/no-such-run",
        "/nowhere",
    ],
)
def test_unknown_runs_and_paths_are_404_pages(client: Any, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 404
    assert_secured(response)
    assert "<h1>Not found</h1>" in response.text


def test_run_page_shows_fields_attempts_explanation_and_links(
    client: Any, repo: AgentRunRepository
) -> None:
    run = new_run(repo, agent_slug="writer", thread_id="th-9", uid="u-9")
    repo.mark_running(run.id, worker_id="host-9:aaa", lease_seconds=60)
    repo.release_lease_for_retry(run.id, worker_id="host-9:aaa")
    repo.mark_running(run.id, worker_id="host-9:bbb", lease_seconds=60)
    done = repo.set_terminal_status(
        run.id, status="failed", worker_id="host-9:bbb", error_type="bad", error_message="why"
    ).run
    assert done is not None
    html = client.get(f"/runs/{run.id}").text
    explanation = explain_run(done, repo.list_run_attempts(run.id)).text
    assert explanation in html
    assert html.count('class="span ') == 2  # one bar per attempt on the time axis
    for link in ('href="/runs?thread=th-9"', 'href="/runs?worker=host-9"', "/json/run/"):
        assert link in html
    assert "<time datetime=" in html and "retry_released" in html


def test_large_documents_are_cut_with_a_link_to_the_whole(
    client: Any, repo: AgentRunRepository
) -> None:
    payload = {"text": "x" * 5_000_000, "items": list(range(1000))}
    run = new_run(repo, input_payload=payload)
    response = client.get(f"/runs/{run.id}")
    assert response.status_code == 200
    assert len(response.content) < 300_000
    assert f'href="/json/payload/{run.id}"' in response.text
    whole = client.get(f"/json/payload/{run.id}")
    assert whole.status_code == 200
    assert whole.headers["content-type"] == "application/json; charset=utf-8"
    assert_secured(whole)
    assert json.loads(whole.content) == payload


def test_a_slow_query_is_a_503_and_the_pool_recovers(
    dashboard_pool: ConnectionPool, dsn: str, repo: AgentRunRepository
) -> None:
    run = new_run(repo)
    app = create_app(dashboard_pool, statement_timeout_seconds=0.3)
    locker = psycopg.connect(dsn)
    try:
        locker.execute("LOCK TABLE agent_runs IN ACCESS EXCLUSIVE MODE")
        with make_client(app) as client:
            for path in ("/", "/runs", f"/runs/{run.id}", "/workers"):
                response = client.get(path)
                assert response.status_code == 503, path
                assert "statement timeout" in response.text
                assert_secured(response)
            locker.rollback()
            assert client.get(f"/runs/{run.id}").status_code == 200
            assert client.get("/").status_code == 200
    finally:
        locker.close()
    stats = dashboard_pool.get_stats()
    assert stats.get("connections_lost", 0) == 0


def test_every_request_reads_in_a_read_only_transaction(
    dashboard_pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    from agent_runs.dashboard import data

    with data.reading(dashboard_pool, 1.0) as reader:
        row = reader.conn.execute(
            "SELECT current_setting('transaction_read_only'), current_setting('statement_timeout')"
        ).fetchone()
        assert row == ("on", "1s")
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            reader.conn.execute("DELETE FROM agent_runs")


def test_methods_other_than_get_change_nothing(client: Any, repo: AgentRunRepository) -> None:
    run = new_run(repo)
    for method in ("PUT", "DELETE", "PATCH", "OPTIONS"):
        response = client.request(method, f"/runs/{run.id}")
        assert response.status_code == 405, method
        assert_secured(response)
    for path in ("/runs", f"/runs/{run.id}", "/", "/healthz"):
        assert client.post(path, headers={"origin": "http://testserver"}).status_code == 405
    refused = client.post(f"/cancel/{run.id}", headers={"origin": "http://testserver"})
    assert refused.status_code == 403
    assert client.get(f"/cancel/{run.id}").status_code == 403
    after = repo.get_run(run.id)
    assert after is not None and after.status == "pending"


def test_mounted_under_a_prefix_in_a_parent_app(
    dashboard_pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route

    run = finished_run(repo)
    parent = Starlette(
        routes=[
            Route("/", lambda request: PlainTextResponse("parent")),
            Mount("/ops", app=create_app(dashboard_pool)),
        ]
    )
    with make_client(parent) as client:
        assert client.get("/").text == "parent"
        overview = client.get("/ops/")
        assert overview.status_code == 200
        assert 'href="/ops/static/dashboard.css"' in overview.text
        assert 'href="/ops/runs"' in overview.text
        runs = client.get("/ops/runs")
        assert f'href="/ops/runs/{run.id}"' in runs.text
        page = client.get(f"/ops/runs/{run.id}")
        assert page.status_code == 200 and run.id in page.text
        for path in ("/ops/static/dashboard.css", "/ops/static/live.js", "/ops/nowhere"):
            response = client.get(path)
            assert_secured(response)
        assert client.get("/ops/static/live.js").status_code == 200
        assert client.get("/ops/healthz").text == "ok\n"


def test_concurrent_requests_share_the_pool(client: Any, repo: AgentRunRepository) -> None:
    run = finished_run(repo)
    codes: list[int] = []

    def fetch() -> None:
        for path in ("/", "/runs", f"/runs/{run.id}", "/workers"):
            codes.append(client.get(path).status_code)

    threads = [threading.Thread(target=fetch) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [200] * 24


def test_text_helpers_make_every_character_visible_and_bound_the_length() -> None:
    from agent_runs.dashboard.page_text import json_text, shown

    assert shown("a\ud800b") == "a\\ud800b"  # a lone surrogate never reaches the encoder
    assert shown("\u202eabc\u2066\x1b[0m\r\n") == "\\u202eabc\\u2066\\e[0m\\r\\n"
    big = shown("x" * 5_000_000)
    assert big.cut and len(big) < 200 and big.endswith("[4,999,880 more characters]")
    assert not shown("short").cut
    document = json_text({"k": "\u202e\u2028\ud800", "n": [1, 2]})
    assert "\\u202e\\u2028\\ud800" in document and "\u202e" not in document
    cut = json_text({"k": "y" * 100_000})
    assert cut.cut and len(cut) < 20_100


def test_an_unexpected_failure_is_a_500_page_without_a_traceback(blank_dsn: str) -> None:
    import agent_runs

    # A database that was never migrated: every query fails (UndefinedTable).
    with (
        agent_runs.create_pool(blank_dsn, min_size=1, max_size=1) as pool,
        make_client(create_app(pool)) as client,
    ):
        for path in ("/", "/runs", "/runs/x", "/workers"):
            response = client.get(path)
            assert response.status_code == 500, path
            assert_secured(response)
            assert "<h1>Internal error</h1>" in response.text
            assert "agent_runs" not in response.text.split("<main", 1)[1]  # no SQL error text


def test_a_closed_pool_is_a_503_page(dsn: str) -> None:
    import agent_runs

    pool = agent_runs.create_pool(dsn, min_size=1, max_size=1)
    app = create_app(pool)
    pool.close()
    with make_client(app) as client:
        for path in ("/", "/runs", "/healthz"):
            response = client.get(path)
            assert response.status_code == 503, path
            assert_secured(response)
            assert "Database unavailable" in response.text


def test_the_finished_totals_are_cached_together_and_the_chart_is_fresh(
    client: Any, repo: AgentRunRepository
) -> None:
    """The last hour's and the last day's counts come from the same moment (the hour never
    shows more than the day), each a link to its runs; the chart is read fresh."""

    def finished_counts(html: str) -> list[str]:
        section = html.split('id="finished"', 1)[1].split("</table>", 1)[0]
        row = section.split("s-completed", 1)[1].split("</tr>", 1)[0]
        return re.findall(
            r'<a href="/runs\?status=completed&amp;finished=1[hd]">([0-9,]+)</a>', row
        )

    def charted(html: str) -> str:
        return html.split('<desc id="chart-desc">', 1)[1].split(" ", 1)[0]

    finished_run(repo)
    first = client.get("/").text
    assert finished_counts(first) == ["1", "1"]  # last 60 min, last day
    assert charted(first) == "1"
    finished_run(repo)
    second = client.get("/").text
    assert finished_counts(second) == ["1", "1"]  # both as of the same moment, 30 s ago
    assert charted(second) == "2"


def test_a_404_names_the_run_id_as_visible_text_escaped_once(client: Any) -> None:
    response = client.get("/runs/a%1Bb%E2%80%AEc%3Cd")
    assert response.status_code == 404
    assert "no run with id a\\eb\\u202ec&lt;d" in response.text
