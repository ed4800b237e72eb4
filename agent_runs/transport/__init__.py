"""How a transition reaches PostgreSQL: its own explicit transaction, in one round trip.

`BEGIN`, the transition's prepared statement and `COMMIT` go out as one libpq pipeline (one
write), and their results come back together (one read): an explicit transaction that costs
the network and the server no more than an autocommit statement. The statement is prepared on
the server once per session, in the same pipeline as its first use. Its parameters travel as
text, typed by the prepared statement itself; its rows come back in binary (no timestamp or
JSON text to format on the server and parse here).

Where that path does not apply (inside the caller's transaction, in the caller's own pipeline,
on a libpq without pipeline mode), the repository runs the same SQL the classic way.

Everything that touches psycopg below its connection API lives in this package and nowhere
else: statements.py (sql/ files as prepared statements), results.py (rows by column name),
pipeline.py (the one-round-trip transaction and each session's prepared statements) and
connection.py (the socket: waiting, reading results, recovering the connection).

Without named statements (`conn.prepare_threshold is None`, psycopg's convention, or once a
connection pooler has been detected on the connection) the same pipeline carries unnamed
statements: still one round trip, only parsed each time. Prepared statement names end with a
digest of their SQL text, so two releases sharing pooled server sessions never run each other's
statements. This package is the only one that reaches below psycopg's public connection API; its
one entry point is `Channel.execute`, and it waits on the socket itself.
"""

from __future__ import annotations

from agent_runs.transport.connection import pooled
from agent_runs.transport.pipeline import PIPELINE_SUPPORTED, Channel
from agent_runs.transport.results import Row, Shape, rows_of, shape, shape_of
from agent_runs.transport.statements import Statement, statement

__all__ = [
    "PIPELINE_SUPPORTED",
    "Channel",
    "Row",
    "Shape",
    "Statement",
    "pooled",
    "rows_of",
    "shape",
    "shape_of",
    "statement",
]
