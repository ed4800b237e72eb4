"""sql/ files as server-side prepared statements: $n placeholders, names that carry a digest of
the SQL text."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cache
from typing import Final, LiteralString

from agent_runs.sql import query

_PLACEHOLDER: Final = re.compile(r"%\((\w+)\)s")


@dataclass(frozen=True, slots=True)
class Statement:
    """sql/<name>.sql as a server-side prepared statement: %(param)s placeholders as $n."""

    name: LiteralString  # the prepared statement's name on the server
    sql: LiteralString  # the file's SQL with $1, $2, … in place of its named placeholders
    params: tuple[str, ...]  # parameter names, in $n order

    @property
    def prepare(self) -> LiteralString:
        """The same statement as an SQL-level PREPARE (for EXPLAIN in tests and by hand)."""
        return f"PREPARE {self.name} AS\n{self.sql}"


@cache
def statement(name: str) -> Statement:
    params: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in params:
            params.append(match.group(1))
        return f"${params.index(match.group(1)) + 1}"

    # Comment lines may mention a placeholder too; only the statement's own count.
    body = "\n".join(line for line in query(name).splitlines() if not line.startswith("--"))
    sql = _PLACEHOLDER.sub(number, body)
    # Derived only from the shipped .sql file and its fixed name: literal SQL, never input.
    return Statement(name=statement_name(name, sql), sql=sql, params=tuple(params))


def statement_name(name: str, sql: str) -> LiteralString:
    """agent_runs_<name>_<digest of the SQL>: a release whose SQL differs uses other names."""
    digest = hashlib.sha256(sql.encode()).hexdigest()[:10]
    # Only [a-z0-9_.] from a shipped file name (`.` written `_`) and a hex digest: safe as an
    # SQL identifier.
    return f"agent_runs_{name.replace('.', '_')[:40]}_{digest}"
