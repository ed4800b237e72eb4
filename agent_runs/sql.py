"""Loads the hand-written SQL files once per process, from a checkout or an installed wheel, and
assembles each statement from the fragments it includes (sql/README.md, Fragments)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Final, LiteralString

_PACKAGE_DIR = Path(__file__).resolve().parent

# `-- include: <fragment>` on a line of its own (`<fragment>,` when more CTEs follow), then its
# slots: `--   <slot>: <value>`, and a value's further lines `--    ...` (written at the column
# they take in the statement).
_INCLUDE: Final = re.compile(r"(?P<indent> *)-- include: (?P<name>[a-z_]+)(?P<comma>,?)")
_SLOT_LINE: Final = re.compile(r"--   (?P<slot>[a-z_]+):(?P<value>.*)")
_MORE_LINE: Final = re.compile(r"--(?P<text>    .*)")
# In a fragment: {{slot}} must be given, {{slot?}} is empty unless given.
_SLOT: Final = re.compile(r"\{\{(?P<slot>[a-z_]+)(?P<optional>\??)\}\}")


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
    """sql/<name>.sql with its fragments in place, assembled once and cached for the process."""
    text = (resource_dir("sql") / f"{name}.sql").read_text(encoding="utf-8")
    # The files ship with the package, never user input: they are literal SQL.
    return assemble(text, where=f"{name}.sql")


def query_names() -> list[str]:
    return sorted(p.stem for p in resource_dir("sql").glob("*.sql"))


def fragment_names() -> list[str]:
    return sorted(p.stem for p in (resource_dir("sql") / "fragments").glob("*.sql"))


@cache
def fragment(name: str) -> str:
    """The SQL of sql/fragments/<name>.sql: what follows its header and the blank line after it."""
    path = resource_dir("sql") / "fragments" / f"{name}.sql"
    if not path.is_file():
        raise LookupError(f"agent_runs: no sql/fragments/{name}.sql")
    header, _, body = path.read_text(encoding="utf-8").partition("\n\n")
    if not body.strip() or not all(line.startswith("--") for line in header.splitlines()):
        raise ValueError(f"agent_runs: sql/fragments/{name}.sql is not a header, a blank line, SQL")
    return body.rstrip("\n")


def includes(text: str) -> list[str]:
    """The fragments an SQL text includes by name, in order (not those they include in turn)."""
    return [m["name"] for line in text.splitlines() if (m := _INCLUDE.fullmatch(line))]


def assemble(
    text: str, fragments: Callable[[str], str] = fragment, *, where: str = "<text>"
) -> str:
    """`text` with each include directive replaced by the fragment it names (`fragments(name)`,
    itself assembled), indented as the directive is, its slots filled."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        found = _INCLUDE.fullmatch(lines[i])
        i += 1
        if found is None:
            out.append(lines[i - 1])
            continue
        indent, name = found["indent"], found["name"]
        slots: dict[str, str] = {}
        while i < len(lines) and lines[i].startswith(indent + "--"):
            line = lines[i][len(indent) :]
            if (slot := _SLOT_LINE.fullmatch(line)) is not None:
                slots[slot["slot"]] = slot["value"].strip()
            elif (more := _MORE_LINE.fullmatch(line)) is not None and slots:
                last = list(slots)[-1]
                slots[last] += "\n" + indent + "  " + more["text"]
            else:
                break
            i += 1
        body = _include(name, indent, slots, fragments, f"{where} < {name}")
        if found["comma"] and "--" in body.rsplit("\n", 1)[-1]:
            raise ValueError(f"agent_runs: {where}: {name!r} ends in a comment, before its ','")
        out.append(body + found["comma"])
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def _include(
    name: str, indent: str, slots: dict[str, str], fragments: Callable[[str], str], where: str
) -> str:
    if where.split(" < ").count(name) > 1:
        raise ValueError(f"agent_runs: sql fragment {name!r} includes itself ({where})")
    body = assemble(fragments(name), fragments, where=where)
    body = "\n".join(indent + line if line else line for line in body.splitlines())
    used: set[str] = set()

    def fill(match: re.Match[str]) -> str:
        slot = match["slot"]
        used.add(slot)
        if slot not in slots and not match["optional"]:
            raise ValueError(f"agent_runs: {where}: no value for the slot {slot!r}")
        return slots.get(slot, "")

    body = _SLOT.sub(fill, body)
    if unknown := sorted(set(slots) - used):
        raise ValueError(f"agent_runs: {where}: {name!r} has no slot {unknown}")
    # An optional slot left empty on a line of its own leaves no blank line behind.
    return "\n".join(line for line in body.splitlines() if line.strip())


def main(argv: Sequence[str] = ()) -> None:
    """Print the assembled statements (all, or those named): `make sql [SQL_ARGS=name ...]`."""
    for name in argv or query_names():
        sys.stdout.write(f"-- ===== sql/{name}.sql =====\n{query(name)}\n")
