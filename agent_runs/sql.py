"""Loads the hand-written SQL files once per process, from a checkout or an installed wheel."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import LiteralString

_PACKAGE_DIR = Path(__file__).resolve().parent


def resource_dir(name: str) -> Path:
    """The `sql` or `migrations` folder: inside the package (wheel) or beside it (checkout)."""
    for candidate in (_PACKAGE_DIR / name, _PACKAGE_DIR.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"agent_runs: cannot find the {name!r} folder near {_PACKAGE_DIR}")


def migrations_dir() -> Path:
    return resource_dir("migrations")


@cache
def query(name: str) -> LiteralString:
    """The text of sql/<name>.sql, read once and cached for the life of the process."""
    path = resource_dir("sql") / f"{name}.sql"
    # The files ship with the package, never user input: they are literal SQL.
    return path.read_text(encoding="utf-8")


def query_names() -> list[str]:
    return sorted(p.stem for p in resource_dir("sql").glob("*.sql"))
