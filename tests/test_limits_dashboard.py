"""The dashboard's /keys page and the run page of a run waiting for its key, over HTTP."""

from __future__ import annotations

from typing import Any

import pytest

from agent_runs import AgentRunRepository
from tests.helpers import new_run

pytest.importorskip("starlette")


def test_keys_lists_each_limited_key_and_a_waiting_run_says_it_waits(
    repo: AgentRunRepository, client: Any
) -> None:
    assert "No key has a limit" in client.get("/keys").text
    repo.set_limit("user:<b>7</b>", 1)
    first = new_run(repo, concurrency_key="user:<b>7</b>")
    waiting = new_run(repo, concurrency_key="user:<b>7</b>")
    assert repo.claim_next(worker_id="w", lease_seconds=60).id == first.id  # type: ignore[union-attr]
    page = client.get("/keys")
    assert page.status_code == 200
    assert "user:&lt;b&gt;7&lt;/b&gt;" in page.text and "<b>7</b>" not in page.text
    run_page = client.get(f"/runs/{waiting.id}")
    assert "waiting for its key user:&lt;b&gt;7&lt;/b&gt; (1 running, limit 1)" in run_page.text
    assert client.get("/keys?x=1").status_code == 400
