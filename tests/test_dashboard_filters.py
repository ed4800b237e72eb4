"""From a symptom to its runs at HTTP level: /runs by the run's error type and by finish window,
status tabs with counts, the go-to-run box, and the overview's counts as links to exactly the
runs behind them."""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest

from agent_runs import AgentRunRepository
from tests.fix_dashboard import assert_secured, finished_run, running_run
from tests.helpers import new_run

pytest.importorskip("starlette")


def _listed(html: str) -> set[str]:
    """The run ids of the runs table (the whole ids a short id holds)."""
    table = html.split('id="runs-list"', 1)[1]
    return set(re.findall(r'<a class="run-id mono" href="/runs/([^"]+)"', table))


def test_error_type_lists_the_runs_that_ended_with_it(
    client: Any, repo: AgentRunRepository
) -> None:
    limited = [
        finished_run(repo, status="failed", error_type="rate_limited", agent_slug="a")
        for _ in range(3)
    ]
    other = finished_run(repo, status="failed", error_type="tool_error", agent_slug="a")
    other_agent = finished_run(repo, status="failed", error_type="rate_limited", agent_slug="b")
    ok = finished_run(repo, agent_slug="a")
    pending = new_run(repo, agent_slug="a")
    response = client.get("/runs?error_type=rate_limited")
    assert response.status_code == 200
    assert_secured(response)
    assert _listed(response.text) == {r.id for r in [*limited, other_agent]}
    assert "whose error type is <strong>rate_limited</strong>" in response.text
    both = client.get("/runs?error_type=rate_limited&agent_slug=a").text
    assert _listed(both) == {r.id for r in limited}
    finished = client.get("/runs?finished=1h&agent_slug=a").text
    assert _listed(finished) == {r.id for r in [*limited, other, ok]}
    assert pending.id not in finished
    # Pages by finish time cover each run once.
    seen: list[str] = []
    link = "/runs?error_type=rate_limited&limit=2"
    while link:
        html = client.get(link).text
        seen += sorted(_listed(html))
        found = re.search(r'<a rel="next" href="([^"]+)"', html)
        link = found.group(1).replace("&amp;", "&") if found else ""
    assert sorted(seen) == sorted(r.id for r in [*limited, other_agent])


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("error_type=x&worker=host-1", "worker"),
        ("error_type=x&stuck=1", "stuck"),
        ("finished=1h&since=2h", "since"),
        ("finished=forever", "finished"),
        ("finished=1h&before=nonsense", "before"),
        ("error_type=" + "e" * 65, "error_type"),
    ],
)
def test_bad_finish_filters_are_a_400_naming_them(client: Any, query: str, name: str) -> None:
    response = client.get(f"/runs?{query}")
    assert response.status_code == 400
    assert f"Bad parameter: {name}" in response.text


def test_status_tabs_show_bounded_counts(client: Any, repo: AgentRunRepository) -> None:
    for _ in range(2):
        new_run(repo)
    running_run(repo)
    finished_run(repo, status="failed", error_type="boom")
    html = client.get("/runs").text
    tabs = html.split('class="tabs"', 1)[1].split("</nav>", 1)[0]
    counts = dict(
        re.findall(r'href="/runs\?status=(\w+)[^"]*">\w+ <span class="count"[^>]*>(\d+)', tabs)
    )
    assert counts["pending"] == "2" and counts["running"] == "1" and counts["failed"] == "1"
    assert 'href="/runs?status=failed&amp;finished=1d"' in tabs
    current = client.get("/runs?status=failed&finished=1d").text
    assert 'aria-current="page">failed' in current


def test_go_to_a_run_by_id_or_prefix(
    client: Any, repo: AgentRunRepository, observer: psycopg.Connection[Any]
) -> None:
    run = new_run(repo)
    exact = client.get(f"/find?run={run.id}", follow_redirects=False)
    assert exact.status_code == 303 and exact.headers["location"] == f"/runs/{run.id}"
    unique = client.get(f"/find?run={run.id[:-3]}", follow_redirects=False)
    assert unique.status_code == 303 and unique.headers["location"] == f"/runs/{run.id}"
    observer.execute(
        "INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid)"
        " SELECT 'twin-' || i, 'twin-req-' || i, 'twin-thread-' || i, 'a', 'u'"
        " FROM generate_series(1, 3) AS i"
    )
    listed = client.get("/find?run=twin-")
    assert listed.status_code == 200
    assert all(f"twin-{n}" in listed.text for n in (1, 2, 3))
    missing = client.get("/find?run=zz-no-such-run")
    assert missing.status_code == 404 and "no run has an id" in missing.text
    assert client.get("/find?run=").status_code == 400
    assert client.get("/find?run=" + "x" * 65).status_code == 400
    assert client.get("/find?id=1").status_code == 400


def test_the_overviews_counts_link_to_exactly_their_runs(
    client: Any, repo: AgentRunRepository
) -> None:
    failed = [finished_run(repo, status="failed", error_type="rate_limited", agent_slug="x")]
    failed.append(finished_run(repo, status="failed", error_type="rate_limited", agent_slug="x"))
    completed = finished_run(repo, agent_slug="x")
    finished_run(repo, status="failed", error_type="tool_error", agent_slug="y")
    html = client.get("/").text
    agents = html.split('id="agents"', 1)[1].split("</section>", 1)[0]
    row = agents.split('href="/runs?agent_slug=x"', 1)[1].split("</tr>", 1)[0]
    links = dict(
        (text, href.replace("&amp;", "&"))
        for href, text in re.findall(r'<a href="(/runs\?[^"]+)">([^<]+)</a>', row)
    )
    assert _listed(client.get(links["3"]).text) == {*(r.id for r in failed), completed.id}
    failed_link = next(h for t, h in links.items() if "status=failed" in h and "%" not in t)
    assert _listed(client.get(failed_link).text) == {r.id for r in failed}
    assert _listed(client.get(links["rate_limited"]).text) == {r.id for r in failed}
    finished = html.split('id="finished"', 1)[1].split("</table>", 1)[0]
    assert 'href="/runs?status=failed&amp;finished=1h">3</a>' in finished


def test_durations_have_the_clis_precision(
    client: Any, repo: AgentRunRepository, observer: psycopg.Connection[Any]
) -> None:
    run = finished_run(repo)
    observer.execute(
        "UPDATE agent_runs SET finished_at = started_at + interval '1 millisecond' WHERE id = %s",
        (run.id,),
    )
    html = client.get("/runs").text
    assert '<td class="num">0.001s</td>' in html


def test_the_workers_counts_link_to_the_runs_of_those_attempts(
    client: Any, repo: AgentRunRepository
) -> None:
    failed = finished_run(
        repo, status="failed", worker="host-7", error_type="tool_error", error_message="x"
    )
    completed = [finished_run(repo, worker="host-7") for _ in range(2)]
    finished_run(repo, status="failed", worker="host-8", error_type="tool_error")
    html = client.get("/workers?since=1h").text
    row = html.split('href="/runs?worker=host-7">', 1)[1].split("</tr>", 1)[0]
    links = {
        text: href.replace("&amp;", "&")
        for href, text in re.findall(r'<a href="(/runs\?[^"]+)">([^<]+)</a>', row)
    }
    assert _listed(client.get(links["3"]).text) == {failed.id, *(r.id for r in completed)}
    assert _listed(client.get(links["2"]).text) == {r.id for r in completed}
    assert _listed(client.get(links["1"]).text) == {failed.id}
    assert _listed(client.get(links["tool_error"]).text) == {failed.id}
    assert "outcome=failed" in links["1"] and "finished=1h" in links["1"]
    by_attempt = client.get("/runs?outcome=failed&finished=1h").text
    assert failed.id in by_attempt and "with an attempt that finished" in by_attempt
    assert client.get("/runs?outcome=exploded").status_code == 400
    assert client.get("/runs?outcome=failed&agent_slug=a").status_code == 400


def test_the_stopped_count_links_to_the_cancelled_and_interrupted_attempts_runs(
    client: Any, repo: AgentRunRepository
) -> None:
    interrupted = finished_run(repo, status="interrupted", worker="host-5")
    cancelled = new_run(repo)
    owner = f"host-5:{cancelled.id[-6:]}"
    assert repo.mark_running(cancelled.id, worker_id=owner, lease_seconds=60).acquired
    assert repo.request_cancel(cancelled.id) is not None
    ended = repo.set_terminal_status(cancelled.id, status="cancelled", worker_id=owner)
    assert ended.changed
    finished_run(repo, status="failed", worker="host-5")
    html = client.get("/workers?since=1h").text
    row = html.split('href="/runs?worker=host-5">', 1)[1].split("</tr>", 1)[0]
    ((link, count),) = [
        (href.replace("&amp;", "&"), text)
        for href, text in re.findall(r'<a href="(/runs\?[^"]+)">([^<]+)</a>', row)
        if "outcome=cancelled" in href
    ]
    assert count == "2" and "outcome=interrupted" in link and "finished=1h" in link
    page = client.get(link).text
    assert _listed(page) == {interrupted.id, cancelled.id}
    assert "with outcome" in page and "multiple" in page  # the form keeps both outcomes
    assert client.get("/runs?outcome=failed&outcome=exploded").status_code == 400


def test_runs_by_attempt_pages_list_each_run_once(client: Any, repo: AgentRunRepository) -> None:
    ids = []
    for _ in range(3):
        run = new_run(repo)
        for _attempt in range(2):  # two attempts by the same worker identity
            claim = repo.mark_running(run.id, worker_id=f"host-9:{run.id[-4:]}", lease_seconds=60)
            assert claim.acquired and claim.run is not None and claim.run.worker_id
            if _attempt == 0:
                assert repo.release_lease_for_retry(run.id, worker_id=claim.run.worker_id)
            else:
                repo.set_terminal_status(run.id, status="completed", worker_id=claim.run.worker_id)
        ids.append(run.id)
    seen: list[str] = []
    link = "/runs?worker=host-9&finished=1h&limit=1"
    while link:
        html = client.get(link).text
        seen += sorted(_listed(html))
        found = re.search(r'<a rel="next" href="([^"]+)"', html)
        link = found.group(1).replace("&amp;", "&") if found else ""
    assert sorted(seen) == sorted(ids)
