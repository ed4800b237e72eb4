"""The worker package's shape, read from its source: its longest chain of imports between its
own modules is at most five modules, and only the runtime knows the Worker."""

from __future__ import annotations

import ast
import itertools
from functools import cache
from pathlib import Path

import pytest

PACKAGE = "agent_runs.worker"
FOLDER = Path(__file__).resolve().parents[1] / "agent_runs" / "worker"
LONGEST_CHAIN = 5


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """The package's modules that `tree` imports, wherever the import statement is (under
    TYPE_CHECKING or in a function included): `from agent_runs.worker.x import …`,
    `from agent_runs.worker import x`, `import agent_runs.worker.x`."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == PACKAGE:
                found.update(alias.name for alias in node.names if alias.name in modules)
            elif node.module.startswith(PACKAGE + "."):
                found.add(node.module.removeprefix(PACKAGE + ".").split(".")[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    found.add(alias.name.removeprefix(PACKAGE + ".").split(".")[0])
    return found & modules


def graph_of(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module name -> the modules of the same package it imports (the package's `__init__`,
    which only re-exports, is left out)."""
    modules = set(sources) - {"__init__"}
    return {name: _imports(ast.parse(sources[name]), modules) for name in modules}


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest import chain, its modules in order (ValueError on an import circle)."""

    def longest(chains: list[tuple[str, ...]]) -> tuple[str, ...]:
        found: tuple[str, ...] = ()
        for chain in chains:
            if len(chain) > len(found):
                found = chain
        return found

    @cache
    def from_(name: str, seen: frozenset[str]) -> tuple[str, ...]:
        if name in seen:
            raise ValueError(f"import circle through {name}")
        return (name, *longest([from_(other, seen | {name}) for other in sorted(graph[name])]))

    return list(longest([from_(name, frozenset()) for name in sorted(graph)]))


def _package_sources() -> dict[str, str]:
    return {path.stem: path.read_text(encoding="utf-8") for path in FOLDER.glob("*.py")}


def test_the_longest_import_chain_inside_the_worker_is_at_most_five_modules() -> None:
    chain = longest_chain(graph_of(_package_sources()))
    assert len(chain) >= 3, chain  # the scan sees the package's imports
    assert len(chain) <= LONGEST_CHAIN, " -> ".join(chain)


def test_only_the_runtime_names_the_worker() -> None:
    """The parts take the parts and functions they use, never the Worker or a stand-in."""
    for name, source in _package_sources().items():
        if name in {"__init__", "runtime"}:
            continue
        tree = ast.parse(source)
        names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        assert "Worker" not in names and "runtime" not in _imports(tree, {"runtime"}), name


def test_the_scan_follows_every_form_of_import() -> None:
    sources = {
        "a": "from agent_runs.worker.b import thing\n",
        "b": "import typing\nif typing.TYPE_CHECKING:\n    import agent_runs.worker.c\n",
        "c": "def f():\n    from agent_runs.worker import d\n",
        "d": "import os\n",
        "__init__": "from agent_runs.worker.a import thing\n",
    }
    graph = graph_of(sources)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"d"}, "d": set()}
    assert longest_chain(graph) == ["a", "b", "c", "d"]


def test_a_chain_of_six_is_too_long_and_a_circle_is_refused() -> None:
    names = ["m1", "m2", "m3", "m4", "m5", "m6"]
    tower = {name: {below} for name, below in itertools.pairwise(names)}
    tower["m6"] = set()
    assert len(longest_chain(tower)) == 6 > LONGEST_CHAIN
    with pytest.raises(ValueError, match="circle"):
        longest_chain({"a": {"b"}, "b": {"a"}})
