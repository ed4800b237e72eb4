"""The sql/ folder: every query the repository uses exists, is commented, parameterized by
name, assembled from its fragments, and read once (query plans: tests/test_query_plans.py)."""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
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
from agent_runs.sql import assemble, fragment, fragment_names, includes, query, query_names

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


# --- fragments (sql/README.md, Fragments) ---------------------------------------------------------


def _fragment_path(name: str) -> Path:
    return agent_runs.sql.resource_dir("sql") / "fragments" / f"{name}.sql"


def test_every_include_resolves_and_every_fragment_is_used() -> None:
    """Each fragment a statement (or a fragment it includes) names exists, and each is included."""
    fragments = set(fragment_names())
    assert fragments, "sql/fragments/ holds no fragment"
    seen: set[str] = set()
    todo = [(f"{n}.sql", _sql_path(n).read_text(encoding="utf-8")) for n in query_names()]
    while todo:
        where, text = todo.pop()
        for name in includes(text):
            assert name in fragments, f"{where} includes {name!r}: no sql/fragments/{name}.sql"
            if name not in seen:
                seen.add(name)
                todo.append((f"fragments/{name}.sql", _fragment_path(name).read_text("utf-8")))
    assert seen == fragments, f"fragments no statement includes: {sorted(fragments - seen)}"


@pytest.mark.parametrize("name", fragment_names())
def test_each_fragment_opens_with_a_header_naming_it(name: str) -> None:
    first = _fragment_path(name).read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith(f"-- {name}: "), f"fragments/{name}.sql starts with {first!r}"
    assert fragment(name).strip(), f"fragments/{name}.sql holds no SQL after its header"


@pytest.mark.parametrize("name", query_names())
def test_no_directive_or_slot_remains_in_an_assembled_statement(name: str) -> None:
    text = query(name)
    assert not includes(text) and "-- include:" not in text, f"{name}.sql: an include remains"
    assert "{{" not in text and "}}" not in text, f"{name}.sql: a slot remains"


def test_assembly_is_deterministic() -> None:
    """Two fresh processes (other hash seeds) print what this one assembled, byte for byte."""
    here = "".join(f"-- ===== sql/{n}.sql =====\n{query(n)}\n" for n in query_names())
    code = "from agent_runs.sql import main; main()"
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        printed = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert printed.stdout == here


def test_the_shared_clauses_are_written_once() -> None:
    """What several transitions share stands in a fragment: the transitions include it."""
    users = {
        "claim_candidates": ["claim_next", "claim_next_attempts", "finish_runs_and_claim"],
        "open_attempt": ["claim_next", "mark_running"],
        "lease_attempts": ["claim_next_attempts", "finish_runs_and_claim"],
        "close_attempt": ["set_terminal_status"],
        "finish_batch_runs": ["finish_runs", "finish_runs_and_claim"],
        "run_policy": ["retry_or_fail", "reconcile_expired_leases"],
    }
    for name, statements in users.items():
        for statement in statements:
            assert name in includes(_sql_path(statement).read_text("utf-8")), (name, statement)
    # The batch statements write none of these clauses themselves: their fragments do.
    claim = ("FOR UPDATE SKIP LOCKED", "INSERT INTO agent_run_attempts", "UPDATE agent_runs r")
    finish = ("UPDATE agent_runs r", "UPDATE agent_run_attempts a", "pg_notify")
    clauses = {
        "claim_next_attempts": claim,
        "finish_runs": finish,
        "finish_runs_and_claim": claim + finish,
    }
    for statement, written in clauses.items():
        for clause in written:
            assert clause not in _sql_path(statement).read_text("utf-8"), (clause, statement)
            assert clause in query(statement), (clause, statement)


_FRAGMENTS = {
    "pick": "-- pick: a test fragment.\n\nSELECT {{what}}\nFROM t{{where?}}",
    "ctes": "-- ctes: two CTEs.\n\na AS (\n    SELECT 1\n),\n-- include: pick\n--   what: 2",
    "loop": "-- loop: includes itself.\n\n-- include: loop",
}


def _body(name: str) -> str:
    return _FRAGMENTS[name].partition("\n\n")[2]


def test_an_include_is_indented_as_its_directive_and_its_slots_filled() -> None:
    text = "WITH x AS (\n    -- include: pick\n    --   what: a,\n    --    b\n)\nSELECT 1\n"
    # A value's further lines keep the column they are written at: 4 + 2 + 4.
    assert (
        assemble(text, _body)
        == "WITH x AS (\n    SELECT a,\n          b\n    FROM t\n)\nSELECT 1\n"
    )
    given = "-- include: pick\n--   what: *\n--   where:\n--    WHERE t.id = 1"
    assert assemble(given, _body) == "SELECT *\nFROM t\n      WHERE t.id = 1"


def test_a_trailing_comma_follows_the_fragment_and_fragments_nest() -> None:
    text = "-- include: ctes,\n-- include: pick\n--   what: 3"
    assert assemble(text, _body) == (
        "a AS (\n    SELECT 1\n),\nSELECT 2\nFROM t,\nSELECT 3\nFROM t"
    )


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("-- include: pick", "no value for the slot 'what'"),
        ("-- include: pick\n--   what: 1\n--   whom: 2", "has no slot"),
        ("-- include: nowhere", "nowhere"),
        ("-- include: loop", "includes itself"),
    ],
)
def test_an_include_that_does_not_resolve_raises(text: str, error: str) -> None:
    with pytest.raises(LookupError if error == "nowhere" else ValueError, match=error):
        assemble(text, _body)
