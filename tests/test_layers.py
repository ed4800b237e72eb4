"""Import rules import-linter cannot express: no module of agent_runs, bench or chaos reaches
for a private name of another agent_runs module (a `_name` imported from it, or read as an
attribute of one of its modules). What two modules share is public in one of them.

The module-level rules (who may import the worker, the CLI, the transport, psycopg internals)
are contracts in pyproject.toml, checked by `lint-imports` in `make lint`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = ("bench", "chaos")


def _private_uses(tree: ast.AST) -> list[str]:
    """`from agent_runs… import _x`, `import agent_runs._x`, and `agent_runs…._x` reads."""
    aliases = {"agent_runs"}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (
            node.level or (node.module or "").startswith("agent_runs")
        ):
            module = "." * node.level + (node.module or "")
            if any(part.startswith("_") for part in module.split(".") if part):
                found.append(f"line {node.lineno}: from {module} import …")
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"line {node.lineno}: from {module} import {alias.name}")
                else:
                    aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("agent_runs"):
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(f"line {node.lineno}: import {alias.name}")
                    aliases.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return found


def _client_files() -> list[Path]:
    return sorted(path for name in CLIENTS for path in (ROOT / name).rglob("*.py"))


def _package_files() -> list[Path]:
    return sorted((ROOT / "agent_runs").rglob("*.py"))


@pytest.mark.parametrize("path", _client_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_bench_and_chaos_use_no_private_name_of_agent_runs(path: Path) -> None:
    found = _private_uses(ast.parse(path.read_text(encoding="utf-8")))
    assert not found, f"{path.relative_to(ROOT)} uses private names: {found}"


@pytest.mark.parametrize("path", _package_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_of_agent_runs_uses_a_private_name_of_another(path: Path) -> None:
    found = _private_uses(ast.parse(path.read_text(encoding="utf-8")))
    assert not found, f"{path.relative_to(ROOT)} uses private names of another module: {found}"


@pytest.mark.parametrize(
    "source",
    [
        "from agent_runs.worker import _Lease",
        "from agent_runs._internal import Thing",
        "import agent_runs.repository as r\nr._execute",
        "from agent_runs import transport\ntransport._session",
        "from agent_runs.validation.text import _shown",
        "from .pipeline import _BEGIN",
        "from . import _helpers",
    ],
)
def test_the_scan_sees_a_private_name(source: str) -> None:
    assert _private_uses(ast.parse(source))


def test_the_scan_accepts_the_public_api() -> None:
    source = "import agent_runs\nfrom agent_runs import AgentRunRepository\nagent_runs.connect\n"
    assert not _private_uses(ast.parse(source))
