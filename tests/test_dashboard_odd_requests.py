"""The dashboard at HTTP level against odd requests: parameters only ASCII digits parse as
numbers, error pages inside the static mount link to the dashboard's own root, run ids of line
breaks or dots reach their routes, only login and static files are open without the token, and a
run page stays bounded."""

from __future__ import annotations

from typing import Any

import pytest
from psycopg_pool import ConnectionPool

from tests.fix_dashboard import assert_secured, make_client

pytest.importorskip("starlette")
from agent_runs.dashboard import create_app


@pytest.mark.parametrize("limit", ["%C2%B2", "%D9%A1", "%EF%BC%91", "1%E2%81%B0"])
def test_a_limit_of_non_ascii_digits_is_a_400_naming_it(client: Any, limit: str) -> None:
    response = client.get(f"/runs?limit={limit}")
    assert response.status_code == 400
    assert_secured(response)
    assert "Bad parameter: limit" in response.text


@pytest.mark.parametrize("prefix", ["", "/ops"])
def test_a_404_under_static_links_to_the_dashboard_root(
    dashboard_pool: ConnectionPool, prefix: str
) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    app: Any = create_app(dashboard_pool)
    if prefix:
        app = Starlette(routes=[Mount(prefix, app=app)])
    with make_client(app) as client:
        response = client.get(f"{prefix}/static/nowhere.css")
        assert response.status_code == 404
        assert_secured(response)
        assert f'href="{prefix}/static/dashboard.css"' in response.text
        assert f'<a href="{prefix}/">Back to the overview</a>' in response.text
        assert "/static/static/" not in response.text


def test_a_csrf_token_of_non_ascii_digits_is_refused_not_a_500(
    dashboard_pool: ConnectionPool, repo: Any
) -> None:
    from tests.helpers import new_run

    run = new_run(repo)
    with make_client(create_app(dashboard_pool, allow_cancel=True)) as client:
        for token in ("\u00b2.x", "\u0661\u0662.x", "1e3.x"):
            response = client.post(
                f"/cancel/{run.id}",
                data={"csrf": token},
                headers={"origin": "http://testserver"},
            )
            assert response.status_code == 403, token
            assert_secured(response)
    assert repo.get_run(run.id).status == "pending"


@pytest.mark.parametrize("run_id", ["cr\r\nlf", "lf\n", "\n", "ls\u2028ps\u2029", "a/b/../c"])
def test_a_run_id_with_line_breaks_reaches_every_route(
    dashboard_pool: ConnectionPool, repo: Any, run_id: str
) -> None:
    from urllib.parse import quote

    from tests.helpers import new_run

    new_run(repo, run_id=run_id)
    segment = quote(run_id, safe="")
    with make_client(create_app(dashboard_pool, allow_cancel=True)) as client:
        for route in ("runs", "tree", "json/run", "cancel", "cancel-tree"):
            response = client.get(f"/{route}/{segment}")
            assert response.status_code == 200, route
            assert_secured(response)


def test_only_the_login_page_and_static_files_are_open_without_the_token(
    dashboard_pool: ConnectionPool,
) -> None:
    from tests.fix_dashboard import TOKEN

    with make_client(create_app(dashboard_pool, token=TOKEN)) as client:
        for path in ("/loginx", "/login/x", "/login-page", "/staticx", "/static"):
            response = client.get(path)
            assert response.status_code == 401, path
            assert_secured(response)
        assert client.get("/login").status_code == 200
        assert client.get("/static/live.js").status_code == 200


def test_favicon_ico_is_served_for_pages_that_name_no_icon(
    dashboard_pool: ConnectionPool,
) -> None:
    """The JSON views name no icon, so Chromium asks for /favicon.ico: a 404 there was a
    console error on every JSON view."""
    from tests.fix_dashboard import TOKEN

    for token in (None, TOKEN):
        with make_client(create_app(dashboard_pool, token=token)) as client:
            response = client.get("/favicon.ico")
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("image/svg+xml")
            assert_secured(response)


def test_a_run_page_stays_bounded_whatever_its_number_of_attempts(
    client: Any, repo: Any, observer: Any
) -> None:
    """A crash-looping run may hold thousands of attempts: the run page shows the latest
    ATTEMPTS_SHOWN, says how many earlier ones it leaves out, and stays under 300 KB."""
    from agent_runs.dashboard.run_page import ATTEMPTS_SHOWN
    from tests.helpers import new_run

    run = new_run(repo)
    observer.execute(
        """
        INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at, finished_at,
                                        outcome, error_type, error_message)
        SELECT %(id)s, n, 'host-1:' || n, now() - interval '1 day' + n * interval '10 seconds',
               now() - interval '1 day' + n * interval '10 seconds' + interval '5 seconds',
               'retry_released', 'crash', repeat('<b>boom</b> ', 100)
        FROM generate_series(1, 2000) AS n
        """,
        {"id": run.id},
    )
    response = client.get(f"/runs/{run.id}")
    assert response.status_code == 200
    assert len(response.content) < 300_000, len(response.content)
    html = response.text
    assert html.count('<td class="num">2000</td>') == 1  # the latest attempt is shown
    assert f'<td class="num">{2000 - ATTEMPTS_SHOWN}</td>' not in html
    assert f"{2000 - ATTEMPTS_SHOWN:,} earlier attempts are not shown" in html


@pytest.mark.parametrize("run_id", ["..", "."])
def test_a_run_id_of_dots_is_linked_past_the_browsers_dot_segments(
    dashboard_pool: ConnectionPool, repo: Any, run_id: str
) -> None:
    """A browser drops `/runs/..` (and `/runs/%2E%2E`) to `/`: the dashboard links such an id
    with a NUL after it (no stored id holds one) and its routes take it off."""
    from tests.helpers import new_run

    new_run(repo, run_id=run_id)
    with make_client(create_app(dashboard_pool, allow_cancel=True)) as client:
        listing = client.get("/runs").text
        assert f'href="/runs/{run_id}%00"' in listing
        for route in ("runs", "tree", "json/run", "cancel", "cancel-tree"):
            response = client.get(f"/{route}/{run_id}%00")
            assert response.status_code == 200, route
        page = client.get(f"/runs/{run_id}%00").text
        assert f'href="/cancel/{run_id}%00"' in page
        confirm = client.get(f"/cancel/{run_id}%00").text
        csrf = confirm.split('name="csrf" value="', 1)[1].split('"', 1)[0]
        done = client.post(
            f"/cancel/{run_id}%00", data={"csrf": csrf}, headers={"origin": "http://testserver"}
        )
        assert done.status_code == 200
        assert client.get("/runs/x%00").status_code == 404  # a NUL after any other id: no run
    assert repo.get_run(run_id).status == "cancelled"
