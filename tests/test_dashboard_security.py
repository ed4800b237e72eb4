"""The dashboard's guards at HTTP level: token auth (Bearer or the /login cookie, never the
URL, never logged), the security headers on every response, cancel only through a confirmed
same-origin POST with a CSRF token, and hostile strings from users and agents shown as text."""

from __future__ import annotations

import logging
import re
from html import escape as html_escape
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRunRepository
from agent_runs.explain import explain_run
from tests.fix_dashboard import TOKEN, assert_secured, finished_run, make_client, running_run
from tests.helpers import new_run

pytest.importorskip("starlette")
from agent_runs.dashboard import create_app

ORIGIN = {"origin": "http://testserver"}


@pytest.fixture
def guarded_client(dashboard_pool: ConnectionPool) -> Any:
    with make_client(create_app(dashboard_pool, token=TOKEN, allow_cancel=True)) as c:
        yield c


@pytest.fixture
def cancel_client(dashboard_pool: ConnectionPool) -> Any:
    with make_client(create_app(dashboard_pool, allow_cancel=True)) as c:
        yield c


def test_without_the_token_every_page_is_refused(
    guarded_client: Any, repo: AgentRunRepository
) -> None:
    run = new_run(repo)
    for path in ("/", "/runs", f"/runs/{run.id}", "/workers", "/healthz", f"/json/run/{run.id}"):
        for headers in ({}, {"authorization": "Bearer wrong-token-000"}, {"authorization": TOKEN}):
            response = guarded_client.get(path, headers=headers)
            assert response.status_code == 401, (path, headers)
            assert response.headers["www-authenticate"].startswith("Bearer")
            assert_secured(response)
            assert run.id not in response.text
        # A token in the URL is never accepted, under any name.
        for name in ("token", "access_token", "auth"):
            assert guarded_client.get(f"{path}?{name}={TOKEN}").status_code in (400, 401)
    refused = guarded_client.get(f"/?token={TOKEN}")
    assert refused.status_code == 401
    static = guarded_client.get("/static/dashboard.css")
    assert static.status_code == 200
    assert_secured(static)


def test_the_bearer_token_opens_every_page(guarded_client: Any, repo: AgentRunRepository) -> None:
    run = finished_run(repo)
    bearer = {"authorization": f"Bearer {TOKEN}"}
    for path in ("/", "/runs", f"/runs/{run.id}", "/workers", f"/tree/{run.id}"):
        response = guarded_client.get(path, headers=bearer)
        assert response.status_code == 200, path
        assert_secured(response)
    assert guarded_client.get("/healthz", headers=bearer).text == "ok\n"


def test_login_sets_a_strict_httponly_cookie_that_is_not_the_token(
    guarded_client: Any, repo: AgentRunRepository
) -> None:
    form = guarded_client.get("/login")
    assert form.status_code == 200 and 'type="password"' in form.text
    assert_secured(form)
    wrong = guarded_client.post("/login", data={"token": "nope-nope-nope"}, headers=ORIGIN)
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    cross = guarded_client.post(
        "/login", data={"token": TOKEN}, headers={"origin": "https://evil.example"}
    )
    assert cross.status_code == 403 and "set-cookie" not in cross.headers
    ok = guarded_client.post(
        "/login", data={"token": TOKEN}, headers=ORIGIN, follow_redirects=False
    )
    assert ok.status_code == 303
    cookie = ok.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    assert TOKEN not in cookie
    assert_secured(ok)
    assert guarded_client.get("/").status_code == 200  # the client kept the cookie
    out = guarded_client.post("/logout", headers=ORIGIN, follow_redirects=False)
    assert out.status_code == 303
    guarded_client.cookies.clear()
    assert guarded_client.get("/").status_code == 401


def test_the_token_is_never_logged(
    guarded_client: Any, repo: AgentRunRepository, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    guarded_client.get("/", headers={"authorization": f"Bearer {TOKEN}"})
    guarded_client.get("/", headers={"authorization": "Bearer x" + TOKEN})
    guarded_client.post("/login", data={"token": TOKEN}, headers=ORIGIN)
    assert TOKEN not in caplog.text


def test_create_app_refuses_bad_settings(dashboard_pool: ConnectionPool) -> None:
    from agent_runs import InvalidArgument

    for kwargs in (
        {"token": "short"},
        {"token": "line\nbreak-token"},
        {"statement_timeout_seconds": 0},
        {"statement_timeout_seconds": float("nan")},
        {"allow_cancel": "yes"},
    ):
        with pytest.raises(InvalidArgument):
            create_app(dashboard_pool, **kwargs)


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "no CSRF token on the confirmation page"
    return found.group(1)


def test_cancel_needs_confirmation_origin_and_csrf(
    cancel_client: Any, repo: AgentRunRepository
) -> None:
    run = running_run(repo)
    page = cancel_client.get(f"/runs/{run.id}")
    assert f'href="/cancel/{run.id}"' in page.text
    confirm = cancel_client.get(f"/cancel/{run.id}")
    assert confirm.status_code == 200 and "Cancel this run?" in confirm.text
    token = _csrf(confirm.text)
    unchanged = repo.get_run(run.id)
    assert unchanged is not None and unchanged.status == "running"  # GET changed nothing
    refused = [
        cancel_client.post(f"/cancel/{run.id}", data={"csrf": token}),  # no Origin
        cancel_client.post(
            f"/cancel/{run.id}", data={"csrf": token}, headers={"origin": "https://evil.example"}
        ),
        cancel_client.post(f"/cancel/{run.id}", data={}, headers=ORIGIN),  # no token
        cancel_client.post(f"/cancel/{run.id}", data={"csrf": "1.abc"}, headers=ORIGIN),
        # A token for another action or run is not this one's.
        cancel_client.post(f"/cancel-tree/{run.id}", data={"csrf": token}, headers=ORIGIN),
    ]
    for response in refused:
        assert response.status_code == 403
        assert_secured(response)
    still = repo.get_run(run.id)
    assert still is not None and still.status == "running"
    done = cancel_client.post(f"/cancel/{run.id}", data={"csrf": token}, headers=ORIGIN)
    assert done.status_code == 200 and "cancel_requested" in done.text
    after = repo.get_run(run.id)
    assert after is not None and after.status == "cancel_requested"
    again = cancel_client.post(f"/cancel/{run.id}", data={"csrf": token}, headers=ORIGIN)
    assert again.status_code == 200 and "Nothing changed" in again.text


def test_cancel_tree_follows_request_cancel_tree(
    cancel_client: Any, repo: AgentRunRepository
) -> None:
    root = running_run(repo)
    child = new_run(repo, created_by_run_id=root.id)
    grandchild = running_run(repo, created_by_run_id=child.id)
    done = finished_run(repo, created_by_run_id=root.id)
    confirm = cancel_client.get(f"/cancel-tree/{root.id}")
    assert confirm.status_code == 200
    for run in (root, child, grandchild, done):
        assert run.id in confirm.text
    response = cancel_client.post(
        f"/cancel-tree/{root.id}", data={"csrf": _csrf(confirm.text)}, headers=ORIGIN
    )
    assert response.status_code == 200
    statuses = {
        r.id: r.status for r in (repo.get_run(x.id) for x in (root, child, grandchild, done)) if r
    }
    assert statuses == {
        root.id: "cancel_requested",
        child.id: "cancelled",  # pending, never started
        grandchild.id: "cancel_requested",
        done.id: "completed",
    }


def test_cancel_of_an_unknown_run_is_a_404(cancel_client: Any) -> None:
    assert cancel_client.get("/cancel/no-such-run").status_code == 404


HOSTILE = {
    "thread_id": "<script>alert('thread')</script>",
    "agent_slug": '"><img src=x onerror=alert(1)>',
    "uid": "javascript:alert(document.cookie)",
}
HOSTILE_MESSAGE = (
    "</pre><script>alert('msg')</script>\u202eevil\u2066\x1b[31mred\r\nnext\x07"
    " <a href='javascript:alert(1)'>x</a> \ud800 lone"
)


def test_hostile_strings_render_as_visible_text(
    cancel_client: Any, repo: AgentRunRepository, observer: psycopg.Connection[Any]
) -> None:
    run = finished_run(
        repo,
        status="failed",
        error_type="<b>bold</b>",
        error_message=HOSTILE_MESSAGE,
        input_payload={"<script>": "</script><script>alert(2)</script>", "bidi": "\u202e\u2067"},
        worker='w"><svg onload=alert(3)>',
        **HOSTILE,
    )
    # Straight into the table: a 5 MB message the repository would have cut, and a manifest.
    observer.execute(
        "UPDATE agent_runs SET error_message = repeat('<i>x</i>', 700000),"
        " manifest = jsonb_build_object('k', repeat('\u202e<script>', 100000)),"
        " manifest_fingerprint = repeat('a', 64), manifest_recorded_at = finished_at"
        " WHERE id = %s",
        (run.id,),
    )
    pages = [
        "/",
        "/runs",
        f"/runs/{run.id}",
        "/workers",
        f"/tree/{run.id}",
        f"/cancel/{run.id}",
        "/runs?thread=" + "%3Cscript%3Ealert(1)%3C%2Fscript%3E",
        "/runs/%3Cscript%3Ealert(1)%3C%2Fscript%3E",
        "/runs?status=%3Cscript%3E",
    ]
    for path in pages:
        response = cancel_client.get(path)
        assert response.status_code in (200, 400, 404), path
        assert_secured(response)
        html = response.text
        assert len(response.content) < 300_000, (path, len(response.content))
        assert "<script>alert" not in html and "<img" not in html and "<svg onload" not in html
        assert "<script" not in html.replace('<script src="/static/live.js" defer></script>', "")
        assert "<i>x</i>" not in html and "<b>bold" not in html
        for raw in ("\u202e", "\u2066", "\u2067", "\x1b", "\x07", "\r"):
            assert raw not in html, (path, repr(raw))
        for href in re.findall(r'href="([^"]*)"', html):
            assert href.startswith(("/", "#")), (path, href)
        assert not re.search(r"<[^>]*\son\w+\s*=", html), path  # no event handler attribute
    detail = cancel_client.get(f"/runs/{run.id}").text
    assert "&lt;script&gt;alert(&#39;msg&#39;)&lt;/script&gt;" in detail
    # Line breaks are kept (CRLF as one), every other control character made visible.
    assert "\\u202eevil\\u2066\\e[31mred\nnext\\x07" in detail
    assert "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;" in detail
    assert "javascript:alert(document.cookie)" in detail  # shown as text, never as a link
    assert 'href="javascript' not in detail
    assert "more characters]" in detail  # the 5 MB message, cut
    # The explanation is shown exactly as `agent-runs attempts` words it: escaped once.
    other = finished_run(repo, status="failed", error_type="e", error_message="\u202eevil\\x")
    explanation = explain_run(other, repo.list_run_attempts(other.id)).text
    assert explanation.endswith("e: \\u202eevil\\\\x")
    head = cancel_client.get(f"/runs/{other.id}").text.split('class="explanation">', 1)[1]
    assert head.split("</span>", 1)[0] == html_escape(explanation, quote=True)


def test_requeue_sits_beside_cancel_under_the_same_rules(
    cancel_client: Any, repo: AgentRunRepository
) -> None:
    run = new_run(repo)
    repo.set_terminal_status(run.id, status="failed", error_type="tool_error")
    page = cancel_client.get(f"/runs/{run.id}")
    assert f'href="/requeue/{run.id}"' in page.text
    confirm = cancel_client.get(f"/requeue/{run.id}")
    assert confirm.status_code == 200 and "Requeue this run?" in confirm.text
    token = _csrf(confirm.text)
    refused = cancel_client.post(f"/requeue/{run.id}", data={"csrf": token})  # no Origin
    assert refused.status_code == 403
    assert repo.get_run(run.id).status == "failed"  # type: ignore[union-attr]
    done = cancel_client.post(f"/requeue/{run.id}", data={"csrf": token}, headers=ORIGIN)
    assert done.status_code == 200 and "Requeued" in done.text
    assert repo.get_run(run.id).status == "pending"  # type: ignore[union-attr]
    assert "requeued at" in cancel_client.get(f"/runs/{run.id}").text
    again = cancel_client.post(f"/requeue/{run.id}", data={"csrf": token}, headers=ORIGIN)
    assert again.status_code == 200 and "Nothing changed" in again.text


def test_requeue_of_a_completed_run_is_refused_and_says_how_to_run_it_again(
    cancel_client: Any, repo: AgentRunRepository
) -> None:
    run = new_run(repo)
    repo.claim_next(worker_id="w:1", lease_seconds=30)
    repo.set_terminal_status(run.id, status="completed", worker_id="w:1")
    assert f'href="/requeue/{run.id}"' not in cancel_client.get(f"/runs/{run.id}").text
    token = _csrf(cancel_client.get(f"/requeue/{run.id}").text)
    refused = cancel_client.post(f"/requeue/{run.id}", data={"csrf": token}, headers=ORIGIN)
    assert refused.status_code == 409 and "new run" in refused.text
    assert repo.get_run(run.id).status == "completed"  # type: ignore[union-attr]
