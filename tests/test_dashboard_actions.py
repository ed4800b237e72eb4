"""Actions that behave, at HTTP level: POST, then a redirect to a signed result page that says
what changed (reloading it does nothing again); cancel of runs selected in the runs table under
the same rules; /login goes back to the page asked for (same origin only) and slows repeated
failures."""

from __future__ import annotations

import re
import time
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRunRepository
from tests.fix_dashboard import TOKEN, assert_secured, finished_run, make_client, running_run
from tests.helpers import new_run

pytest.importorskip("starlette")
from agent_runs.dashboard import create_app
from agent_runs.dashboard.login import safe_next

ORIGIN = {"origin": "http://testserver"}


@pytest.fixture
def cancel_client(dashboard_pool: ConnectionPool) -> Any:
    with make_client(create_app(dashboard_pool, allow_cancel=True)) as c:
        yield c


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found
    return found.group(1)


def test_a_cancel_redirects_to_a_result_page_with_counts(
    cancel_client: Any, repo: AgentRunRepository
) -> None:
    root = running_run(repo)
    new_run(repo, created_by_run_id=root.id)
    token = _csrf(cancel_client.get(f"/cancel-tree/{root.id}").text)
    posted = cancel_client.post(
        f"/cancel-tree/{root.id}", data={"csrf": token}, headers=ORIGIN, follow_redirects=False
    )
    assert posted.status_code == 303
    location = posted.headers["location"]
    assert location.startswith("/done/cancel-tree?")
    shown = cancel_client.get(location)
    assert shown.status_code == 200
    assert_secured(shown)
    assert "<h1>Cancel requested</h1>" in shown.text
    assert "2 runs changed, from the run down." in shown.text
    assert "cancel_requested" in shown.text
    # Reloading the result changes nothing and says the same.
    before = [r.status for r in repo.list_runs(limit=10)]
    assert cancel_client.get(location).text.count("changed") == shown.text.count("changed")
    assert [r.status for r in repo.list_runs(limit=10)] == before
    # A forged result link is refused.
    forged = re.sub(r"changed=\d+", "changed=99", location)
    assert cancel_client.get(forged).status_code == 400


def test_the_selected_runs_are_cancelled_after_one_confirmation(
    cancel_client: Any, repo: AgentRunRepository
) -> None:
    live = [running_run(repo) for _ in range(2)]
    waiting = new_run(repo)
    done = finished_run(repo)
    table = cancel_client.get("/runs").text
    assert 'form="bulk"' in table and "Cancel the selected runs" in table
    chosen = [*live, waiting, done]
    query = "&".join(f"run={quote(quote(r.id, safe=''), safe='')}" for r in chosen)
    confirm = cancel_client.get(f"/selected/cancel?{query}")
    assert confirm.status_code == 200
    assert "Cancel these 4 runs?" in confirm.text
    for run in chosen:
        assert run.id in confirm.text
    unchanged = [repo.get_run(x.id) for x in live]
    assert all(r is not None and r.status == "running" for r in unchanged)
    fields = [("csrf", _csrf(confirm.text))] + [("run", quote(r.id, safe="")) for r in chosen]

    def post(data: list[tuple[str, str]], headers: dict[str, str], **kwargs: Any) -> Any:
        body = urlencode(data)
        form = {"content-type": "application/x-www-form-urlencoded", **headers}
        return cancel_client.post("/selected/cancel", content=body, headers=form, **kwargs)

    refused = post([*fields[1:], ("csrf", "1.x")], ORIGIN)
    assert refused.status_code == 403
    cross = post(fields, {"origin": "http://evil"})
    assert cross.status_code == 403
    fewer = post(fields[:-1], ORIGIN)
    assert fewer.status_code == 403  # the token is for exactly the confirmed runs
    posted = post(fields, ORIGIN, follow_redirects=False)
    assert posted.status_code == 303
    result = cancel_client.get(posted.headers["location"]).text
    assert "3 of 4 runs changed" in result
    statuses = {r.id: r.status for r in map(repo.get_run, [x.id for x in chosen]) if r}
    assert statuses == {
        live[0].id: "cancel_requested",
        live[1].id: "cancel_requested",
        waiting.id: "cancelled",
        done.id: "completed",
    }


def test_no_bulk_action_without_allow_cancel(client: Any, repo: AgentRunRepository) -> None:
    run = running_run(repo)
    assert 'form="bulk"' not in client.get("/runs").text
    assert client.get(f"/selected/cancel?run={run.id}").status_code == 403


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("/runs?status=failed", "/runs?status=failed"),
        ("/runs/abc", "/runs/abc"),
        ("https://evil.example/", "/"),
        ("//evil.example/x", "/"),
        ("/\\evil.example", "/"),
        ("javascript:alert(1)", "/"),
        ("/runs\r\nSet-Cookie: x=1", "/"),
        ("", "/"),
    ],
)
def test_login_goes_back_only_to_paths_of_the_dashboard(given: str, expected: str) -> None:
    assert safe_next(given) == expected


def test_login_returns_to_the_requested_page_and_slows_failures(
    dashboard_pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    run = finished_run(repo)
    with make_client(create_app(dashboard_pool, token=TOKEN)) as client:
        assert client.get(f"/runs/{run.id}").status_code == 401
        # The 401 page links to /login; the browser sends the page as its Referer.
        form = client.get("/login", headers={"referer": f"http://testserver/runs/{run.id}"})
        assert f'name="next" value="{quote("/runs/" + run.id, safe="")}"' in form.text
        foreign = client.get("/login", headers={"referer": "http://evil.example/runs/x"})
        assert 'name="next" value="%2F"' in foreign.text
        timings = []
        for _ in range(3):
            started = time.monotonic()
            wrong = client.post("/login", data={"token": "wrong-token-x"}, headers=ORIGIN)
            timings.append(time.monotonic() - started)
            assert wrong.status_code == 401
        assert timings[2] >= 0.45 and timings[1] >= 0.2, timings
        ok = client.post(
            "/login",
            data={"token": TOKEN, "next": quote(f"/runs/{run.id}", safe="")},
            headers=ORIGIN,
            follow_redirects=False,
        )
        assert ok.status_code == 303 and ok.headers["location"] == f"/runs/{run.id}"
        evil = client.post(
            "/login",
            data={"token": TOKEN, "next": quote("//evil.example/", safe="")},
            headers=ORIGIN,
            follow_redirects=False,
        )
        assert evil.headers["location"] == "/"
