"""The sql/ folder: every query the repository uses exists, is commented, parameterized by
name, and read once (query plans: tests/test_query_plans.py)."""

from __future__ import annotations

import ast
import inspect
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import agent_runs
import agent_runs.sql
import agent_runs.transport
from agent_runs import AgentRunRepository
from agent_runs.sql import query, query_names

Conn = psycopg.Connection[Any]

# Public transition and reader methods: each one is backed by at least one sql/ file.
SQL_METHODS = [
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
    """The modules of the repository class and of its mixins (agent_runs.repository)."""
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


def test_every_public_method_of_the_repository_is_backed_by_a_sql_file() -> None:
    """Each method has a file named after it, and the method names that file."""
    methods = _methods()
    files = set(query_names())
    for method in SQL_METHODS:
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


_CLOCK = "clock AS (\n    SELECT coalesce(%(now)s::timestamptz, now()) AS now\n)"


@pytest.mark.parametrize("name", query_names())
def test_a_statement_that_takes_now_reads_it_once_in_its_clock(name: str) -> None:
    """One clock idiom (sql/README.md, Clock): `%(now)s` only in the `clock` CTE, once."""
    text = query(name)
    if "%(now)s" not in text:
        return
    assert text.count("%(now)s") == 1, f"{name}.sql names %(now)s outside its clock CTE"
    assert _CLOCK in text, f"{name}.sql takes %(now)s but not as `WITH clock AS (...)`"
