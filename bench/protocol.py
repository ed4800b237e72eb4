"""Counting what a call really costs on the wire: libpq's protocol trace of one connection.

libpq logs every protocol message (PQtrace). A statement executed is a CommandComplete (or an
ErrorResponse) from the server, whichever protocol carried it: three statements sent in one
simple-protocol Query message are three statements. A message is a Query (simple protocol) or
an Execute (extended protocol) sent by the client; a round trip is a ReadyForQuery the client
waits for; a Parse is a statement text the server had to parse and plan.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import pq


@dataclass
class MessageCounts:
    """Protocol traffic observed during one traced block."""

    statements: int = 0
    messages: int = 0
    round_trips: int = 0
    parses: int = 0
    commands: list[str] = field(default_factory=list)  # CommandComplete tags, in order

    def as_dict(self) -> dict[str, Any]:
        return {
            "statements": self.statements,
            "messages": self.messages,
            "round_trips": self.round_trips,
            "parses": self.parses,
            "commands": self.commands,
        }


def _count(trace: str, counts: MessageCounts) -> None:
    for line in trace.splitlines():
        parts = line.split("\t", 4)
        if len(parts) < 3 or parts[0] not in ("F", "B") or not parts[1].isdigit():
            continue  # a continuation line of a multi-line SQL text
        sender, message = parts[0], parts[2]
        if sender == "F" and message in ("Execute", "Query"):
            counts.messages += 1
        elif sender == "F" and message == "Parse":
            counts.parses += 1
        elif sender == "B" and message == "ReadyForQuery":
            counts.round_trips += 1
        elif sender == "B" and message == "CommandComplete":
            counts.statements += 1
            tag = parts[3].strip().strip('"') if len(parts) > 3 else "?"
            counts.commands.append(tag.split(" ")[0])
        elif sender == "B" and message == "ErrorResponse":
            counts.statements += 1
            counts.commands.append("ERROR")


@contextlib.contextmanager
def traced(conn: psycopg.Connection[Any]) -> Iterator[MessageCounts]:
    """Count the protocol messages `conn` exchanges inside the block."""
    counts = MessageCounts()
    with tempfile.TemporaryFile() as sink:
        conn.pgconn.trace(sink.fileno())
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            yield counts
        finally:
            conn.pgconn.untrace()  # flushes libpq's buffer into the file
            sink.seek(0)
            _count(sink.read().decode("utf-8", "replace"), counts)
