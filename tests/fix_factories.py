"""Factories that forge rows directly, in any state (a pytest plugin): `make_run`,
`make_attempt`, the starting instant `t0`, and `runs` (a pending and a running run)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from agent_runs import AgentRun, AgentRunRepository, RunAttempt
from tests.helpers import OWNER, Runs, new_run

_JSONB_COLUMNS: Final = frozenset({"input_payload", "manifest"})


def _insert(table: str, cols: dict[str, Any]) -> sql.Composed:
    names = list(cols)
    return sql.SQL("INSERT INTO {} ({}) VALUES ({}) RETURNING *").format(
        sql.Identifier(table),
        sql.SQL(", ").join(sql.Identifier(n) for n in names),
        sql.SQL(", ").join(sql.Placeholder(n) for n in names),
    )


class RunFactory:
    """`make_run(**cols)`: INSERT an agent_runs row as given (defaults: a fresh pending run)."""

    def __init__(self, connection: psycopg.Connection[Any], repo: AgentRunRepository) -> None:
        self._conn = connection
        self._repo = repo

    def __call__(self, **cols: Any) -> AgentRun:
        key = uuid.uuid4().hex
        values: dict[str, Any] = {
            "id": str(uuid.uuid4()),
            "request_id": f"req-{key}",
            "thread_id": f"thread-{key}",
            "agent_slug": "agent",
            "uid": "user",
        }
        values.update(cols)
        params = {
            k: Jsonb(v) if k in _JSONB_COLUMNS and v is not None else v for k, v in values.items()
        }
        self._conn.execute(_insert("agent_runs", values), params)
        run = self._repo.get_run(values["id"])
        assert run is not None
        return run


class AttemptFactory:
    """`make_attempt(run_id, **cols)`: INSERT an attempt row as given (default: open, next no)."""

    def __init__(self, connection: psycopg.Connection[Any], repo: AgentRunRepository) -> None:
        self._conn = connection
        self._repo = repo

    def __call__(self, run_id: str, **cols: Any) -> RunAttempt:
        values: dict[str, Any] = {"run_id": run_id, "worker_id": "forged-worker"}
        values.update(cols)
        if "attempt_no" not in values or "started_at" not in values:
            row = self._conn.execute(
                "SELECT coalesce(max(attempt_no), 0) + 1, now() FROM agent_run_attempts"
                " WHERE run_id = %s",
                (run_id,),
            ).fetchone()
            assert row is not None
            values.setdefault("attempt_no", row[0])
            values.setdefault("started_at", row[1])
        row = self._conn.execute(_insert("agent_run_attempts", values), values).fetchone()
        assert row is not None
        [attempt] = [a for a in self._repo.list_run_attempts(run_id) if a.id == row[0]]
        return attempt


@pytest.fixture
def make_run(observer: psycopg.Connection[Any], repo: AgentRunRepository) -> RunFactory:
    return RunFactory(observer, repo)


@pytest.fixture
def make_attempt(observer: psycopg.Connection[Any], repo: AgentRunRepository) -> AttemptFactory:
    return AttemptFactory(observer, repo)


@pytest.fixture
def t0() -> datetime:
    """A timezone-aware starting instant; tests move time with `now=t0 + timedelta(...)`."""
    return datetime.now(UTC).replace(microsecond=0)


@pytest.fixture
def runs(repo: AgentRunRepository, t0: datetime) -> Runs:
    """A pending run and a running one leased by OWNER at t0 (30 s): what a bad call could
    damage."""
    pending = new_run(repo)
    running = new_run(repo)
    assert repo.mark_running(running.id, worker_id=OWNER, lease_seconds=30, now=t0).acquired
    return Runs(pending=pending.id, running=running.id, now=t0 + timedelta(seconds=1))
