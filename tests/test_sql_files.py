"""The sql/ folder: every query the repository uses exists, is commented, parameterized by
name, read once; and the hot queries are planned on their intended index (EXPLAIN)."""

from __future__ import annotations

import ast
import inspect
import re
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, LiteralString

import psycopg
import pytest
from psycopg import sql

import agent_runs
import agent_runs.sql
import agent_runs.transport
from agent_runs import AgentRunRepository
from agent_runs.sql import query, query_names

Conn = psycopg.Connection[Any]

# Public repository methods of SPEC section 3: each one is backed by at least one sql/ file.
SPEC_METHODS = [
    "create_run",
    "get_run",
    "mark_running",
    "claim_next",
    "renew_lease",
    "release_lease_for_retry",
    "set_terminal_status",
    "request_cancel",
    "reconcile_expired_leases",
    "record_run_manifest",
    "list_run_attempts",
    "get_open_attempt",
]
# The public loaders: a literal name passed to them must be a file.
_LOADERS = {agent_runs.sql.query.__name__, agent_runs.transport.statement.__name__}
PACKAGE = Path(agent_runs.__file__).parent


def _first_literals(node: ast.AST) -> Iterator[tuple[str | None, str]]:
    """(callee, value) of every call in `node` whose first argument is a string literal."""
    for call in ast.walk(node):
        if not isinstance(call, ast.Call) or not call.args:
            continue
        first = call.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            func = call.func
            callee = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            yield callee, first.value


def _names_used_by(node: ast.AST) -> set[str]:
    """The sql/ files `node` names: string literals, first argument of a call, naming a file."""
    files = set(query_names())
    return {value for _, value in _first_literals(node) if value in files}


def _package_tree() -> ast.Module:
    """Every module of agent_runs, in one tree."""
    body = [
        node
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.parse(path.read_text(encoding="utf-8")).body
    ]
    return ast.Module(body=body, type_ignores=[])


def _repository_tree() -> ast.Module:
    """The modules of the repository class and of its mixins (agent_runs.operations)."""
    names = dict.fromkeys(c.__module__ for c in AgentRunRepository.__mro__)
    body = [
        node
        for name in names
        if name.startswith("agent_runs")
        for node in ast.parse(inspect.getsource(sys.modules[name])).body
    ]
    return ast.Module(body=body, type_ignores=[])


def _methods() -> dict[str, ast.FunctionDef]:
    tree = _repository_tree()
    [cls] = [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == AgentRunRepository.__name__
    ]
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}


def _sql_path(name: str) -> Path:
    return agent_runs.sql.resource_dir("sql") / f"{name}.sql"


def test_every_spec_method_of_the_repository_is_backed_by_a_sql_file() -> None:
    """Each method has a file named after it, and the method names that file."""
    methods = _methods()
    files = set(query_names())
    for method in SPEC_METHODS:
        assert method in methods, f"AgentRunRepository.{method} is missing"
        assert method in files, f"no sql/{method}.sql"
        assert method in _names_used_by(methods[method]), f"{method} never names {method}.sql"


def test_every_query_the_repository_names_exists_and_every_file_is_used() -> None:
    tree = _package_tree()
    files = set(query_names())
    loaded = {value for callee, value in _first_literals(tree) if callee in _LOADERS}
    assert loaded, "found no query() / statement() call with a literal name in agent_runs"
    assert loaded <= files, f"missing sql/ files: {sorted(loaded - files)}"
    used = _names_used_by(tree)
    assert files <= used, f"sql/ files no code names: {sorted(files - used)}"


@pytest.mark.parametrize("name", query_names())
def test_each_sql_file_opens_with_a_comment(name: str) -> None:
    text = _sql_path(name).read_text(encoding="utf-8")
    first = text.lstrip("\ufeff").splitlines()[0]
    assert first.startswith("-- ") and len(first) > 10, f"{name}.sql starts with {first!r}"


@pytest.mark.parametrize("name", query_names())
def test_each_sql_file_uses_named_placeholders_only(name: str) -> None:
    """psycopg reads `%` everywhere in the text, comments included: only %(name)s and %%."""
    text = query(name)
    stray = re.findall(r"%(?!\(\w+\)s|%)", text.replace("%%", ""))
    assert not stray, f"{name}.sql has {len(stray)} stray '%' (use %(name)s, or %% for a literal)"
    assert re.search(r"%\(\w+\)s", text) or name.startswith("list_"), f"{name}.sql has no params"


def test_sql_files_are_read_once_and_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[Path] = []
    original = Path.read_text

    def counting_read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        reads.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counting_read_text)
    first = query("mark_running")
    for _ in range(5):
        assert query("mark_running") is first
    assert len([p for p in reads if p.name == "mark_running.sql"]) <= 1


# --- query plans ---------------------------------------------------------------------------------


# Values for the named parameters of the hot queries, by name, for EXPLAIN.
def _params(name: str, values: dict[str, Any]) -> dict[str, Any]:
    wanted = set(re.findall(r"%\((\w+)\)s", query(name)))
    missing = wanted - set(values)
    assert not missing, f"{name}.sql takes parameters this test has no value for: {missing}"
    return {key: values[key] for key in wanted}


def _plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _plan_nodes(child)


def _explain(observer: Conn, statement: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    text = "EXPLAIN (FORMAT JSON)\n" + statement
    row = observer.execute(text, params).fetchone()
    assert row is not None
    return list(_plan_nodes(row[0][0]["Plan"]))


def _explain_generic(observer: Conn, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """The generic plan of the statement the repository prepares for sql/<name>.sql."""
    stmt = agent_runs.transport.statement(name)
    with observer.transaction(force_rollback=True):
        observer.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        observer.execute(stmt.prepare)
        try:
            args = sql.SQL(", ").join(sql.Literal(params[param]) for param in stmt.params)
            row = observer.execute(
                sql.SQL("EXPLAIN (FORMAT JSON) EXECUTE {} ({})").format(
                    sql.Identifier(stmt.name), args
                )
            ).fetchone()
        finally:
            observer.execute(sql.SQL("DEALLOCATE {}").format(sql.Identifier(stmt.name)))
    assert row is not None
    return list(_plan_nodes(row[0][0]["Plan"]))


def _index_scans(nodes: list[dict[str, Any]]) -> set[str]:
    return {node["Index Name"] for node in nodes if "Index Name" in node}


def _seq_scanned(nodes: list[dict[str, Any]]) -> set[str]:
    return {node["Relation Name"] for node in nodes if node["Node Type"] == "Seq Scan"}


def _sorts(nodes: list[dict[str, Any]]) -> list[str]:
    return [node["Node Type"] for node in nodes if "Sort" in node["Node Type"]]


def _seed(observer: Conn, *, pending: int, finished: int, live: int, expired: int) -> None:
    """A realistic table: a long finished history, a backlog, a few live and lost leases."""
    counts = {"pending": pending, "finished": finished, "live": live, "expired": expired}
    for statement in _SEED:
        observer.execute(statement, counts)
    observer.execute("ANALYZE agent_runs")
    observer.execute("ANALYZE agent_run_attempts")


_SEED: list[LiteralString] = [
    """
    INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status,
                            created_at, started_at, finished_at)
    SELECT 'done-' || i, 'done-req-' || i, 'done-thread-' || i, 'agent-' || (i %% 7), 'u',
           'completed', now() - interval '30 days' + i * interval '1 second',
           now() - interval '30 days', now() - interval '29 days'
    FROM generate_series(1, %(finished)s) AS i
    """,
    """
    INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, created_at)
    SELECT 'todo-' || i, 'todo-req-' || i, 'todo-thread-' || i, 'agent-' || (i %% 7), 'u',
           now() - interval '1 day' + i * interval '1 second'
    FROM generate_series(1, %(pending)s) AS i
    """,
    """
    INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status, worker_id,
                            heartbeat_at, lease_expires_at, started_at)
    SELECT 'live-' || i, 'live-req-' || i, 'live-thread-' || i, 'agent-1', 'u', 'running',
           'w-' || i, now(), now() + interval '1 hour', now()
    FROM generate_series(1, %(live)s) AS i
    """,
    """
    INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status, worker_id,
                            heartbeat_at, lease_expires_at, started_at)
    SELECT 'lost-' || i, 'lost-req-' || i, 'lost-thread-' || i, 'agent-1', 'u', 'running',
           'w-lost-' || i, now() - interval '2 hours', now() - interval '1 hour',
           now() - interval '2 hours'
    FROM generate_series(1, %(expired)s) AS i
    """,
]


def _plans(observer: Conn, method: str, values: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Custom and generic plans of every sql/ file the repository method uses."""
    names = sorted(_names_used_by(_methods()[method]))
    assert names, f"{method} names no sql/ file"
    plans = []
    for name in names:
        params = _params(name, values)
        plans.append(_explain(observer, query(name), params))
        plans.append(_explain_generic(observer, name, params))
    return plans


@pytest.mark.parametrize("agent_slugs", [None, ["agent-3"], ["agent-2", "agent-5"]])
def test_claim_next_reads_the_claimable_index_in_order_without_sorting(
    repo: AgentRunRepository, observer: Conn, agent_slugs: list[str] | None
) -> None:
    _seed(observer, pending=2000, finished=4000, live=20, expired=0)
    values = {
        "worker_id": "w",
        "lease_seconds": 30.0,
        "now": None,
        "agent_slugs": agent_slugs,
        "lost_message": "lost",
    }
    plans = _plans(observer, "claim_next", values)
    for plan in plans:
        assert not _sorts(plan), f"claim_next sorts: {_sorts(plan)}"
        assert "agent_runs" not in _seq_scanned(plan)
        assert "ix_agent_runs_claimable" in _index_scans(plan)
    # And the real call takes the oldest claimable run of those slugs from that backlog.
    oldest = observer.execute(
        "SELECT id FROM agent_runs WHERE status = 'pending'"
        " AND (%(slugs)s::text[] IS NULL OR agent_slug = ANY(%(slugs)s::text[]))"
        " ORDER BY created_at, id LIMIT 1",
        {"slugs": agent_slugs},
    ).fetchone()
    claimed = repo.claim_next(worker_id="w", lease_seconds=30, agent_slugs=agent_slugs)
    assert claimed is not None and oldest is not None and claimed.id == oldest[0]


def test_the_reconciler_finds_lost_leases_through_the_live_index(
    repo: AgentRunRepository, observer: Conn
) -> None:
    _seed(observer, pending=1000, finished=5000, live=30, expired=5)
    lost = [f"lost-{i}" for i in range(1, 6)]
    values = {"now": None, "limit": 500, "lost_message": "lost", "run_ids": lost}
    plans = _plans(observer, "reconcile_expired_leases", values)
    for plan in plans:
        assert "agent_runs" not in _seq_scanned(plan)
    assert any("ix_agent_runs_live" in _index_scans(plan) for plan in plans[::2])  # custom
    assert any("ix_agent_runs_live" in _index_scans(plan) for plan in plans[1::2])  # generic
    converged = repo.reconcile_expired_leases(now=datetime.now(UTC))
    assert sorted(run.id for run in converged) == lost
