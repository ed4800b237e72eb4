"""Every value a request brings is echoed escaped and cut (a bad parameter's name included),
and a tree deeper than the tree query's bound says where it is cut and links onward, from the
root and from deep runs."""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest

from tests.fix_dashboard import assert_secured

pytest.importorskip("starlette")

RAW = ("\u202e", "\x1b", "\u2066", "\r", "\x07")


@pytest.mark.parametrize(
    "path",
    [
        "/runs?%E2%80%AE%1B[31m" + "n" * 10_000 + "=1",
        "/?%E2%80%AE" + "n" * 10_000 + "=1",
        "/workers?%1B" + "n" * 10_000 + "=1",
        "/runs?status=%E2%80%AE%1B" + "s" * 1000,
        "/runs?since=%E2%80%AE%1B" + "s" * 1000,
        "/runs/%E2%80%AE%1B" + "r" * 10_000,
        "/tree/x?%E2%80%AE" + "n" * 10_000 + "=1",
        "/json/%E2%80%AE" + "k" * 10_000 + "/x",
    ],
)
def test_every_echoed_value_is_escaped_and_cut(client: Any, path: str) -> None:
    response = client.get(path)
    assert response.status_code in (400, 404), path
    assert_secured(response)
    html = response.text
    for raw in RAW:
        assert raw not in html, (path, repr(raw))
    assert len(html) < 8_000, (path, len(html))  # not 10,000 characters, let alone twice
    for run in re.findall(r"[nsrk]{100,}", html):
        assert len(run) <= 2000, path


def test_a_bad_parameter_name_is_named_as_visible_text(client: Any) -> None:
    response = client.get("/runs?a%E2%80%AEb%1Bc=1")
    assert response.status_code == 400
    assert "Bad parameter: a\\u202eb\\ec" in response.text
    assert "unknown query parameter a\\u202eb\\ec" in response.text


def _chain(conn: psycopg.Connection[Any], n: int, prefix: str = "chain") -> list[str]:
    """n runs, each created by the one before (chain-0 is the root), straight into the table."""
    conn.execute(
        "INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, created_by_run_id,"
        " created_at)"
        " SELECT %(p)s || '-' || i, %(p)s || '-req-' || i, %(p)s || '-thread-' || i, 'deep',"
        " 'user', CASE WHEN i > 0 THEN %(p)s || '-' || (i - 1) END,"
        " now() - interval '1 hour' + i * interval '1 millisecond'"
        " FROM generate_series(0, %(last)s) AS i",
        {"p": prefix, "last": n - 1},
    )
    return [f"{prefix}-{i}" for i in range(n)]


def _listed(html: str) -> list[str]:
    tree = html.split('<ul class="tree">', 1)[1].split("</ul>", 1)[0]
    return re.findall(r">(chain-\d+)<", tree)


def test_a_deep_trees_root_page_says_it_is_cut_and_links_onward(
    client: Any, observer: psycopg.Connection[Any]
) -> None:
    chain = _chain(observer, 2000)
    page = client.get(f"/tree/{chain[0]}").text
    assert _listed(page) == chain[:101]
    assert "goes deeper than 100 levels" in page
    onward = f'href="/tree/{chain[100]}?start=here"'
    assert onward in page
    assert "goes higher" not in page
    # Onward: from chain-100 down, and a link back up.
    below = client.get(f"/tree/{chain[100]}?start=here").text
    assert _listed(below) == chain[100:201]
    assert f'href="/tree/{chain[200]}?start=here"' in below
    assert f'href="/tree/{chain[99]}"' in below and "goes higher" in below
    # The run page of the root: the first 50, a link to the whole tree.
    run_page = client.get(f"/runs/{chain[0]}").text
    assert f'href="/tree/{chain[0]}"' in run_page
    assert client.get(f"/tree/{chain[0]}?start=nowhere").status_code == 400


def test_a_deep_runs_pages_say_the_tree_goes_higher_and_lower(
    client: Any, observer: psycopg.Connection[Any]
) -> None:
    chain = _chain(observer, 2000)
    page = client.get(f"/tree/{chain[1500]}").text
    assert _listed(page) == chain[1400:1501]
    assert "goes higher" in page and f'href="/tree/{chain[1399]}"' in page
    assert f'href="/tree/{chain[1500]}?start=here"' in page
    up = client.get(f"/tree/{chain[1399]}").text
    assert _listed(up) == chain[1299:1400]
    run_page = client.get(f"/runs/{chain[1500]}").text
    assert "goes higher" in run_page and f'href="/tree/{chain[1399]}"' in run_page
    top = client.get(f"/tree/{chain[50]}").text
    assert _listed(top) == chain[:101] and "goes higher" not in top


def test_a_shallow_tree_has_no_cut_note(client: Any, observer: psycopg.Connection[Any]) -> None:
    chain = _chain(observer, 101)
    page = client.get(f"/tree/{chain[0]}").text
    assert _listed(page) == chain
    assert "tree-cut" not in page
    assert "tree-cut" not in client.get(f"/tree/{chain[100]}").text


def test_a_400_names_every_unknown_parameter(client: Any) -> None:
    response = client.get("/runs?stauts=failed&agent=x&status=failed")
    assert response.status_code == 400
    assert "unknown query parameters stauts, agent" in response.text
    many = client.get("/?" + "&".join(f"p{n}=1" for n in range(9)))
    assert "unknown query parameters p0, p1, p2, p3, p4 and 4 more" in many.text
