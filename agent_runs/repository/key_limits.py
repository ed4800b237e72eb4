"""Concurrency limits per key: set_limit, delete_limit and list_limits of the repository.

A run created with a concurrency_key counts against that key's limit (agent_run_limits) while
it is running, or cancel_requested with an owner. A key without a limit, and a run without a
key, are unlimited; a limit of 0 pauses the key. No claim ever admits a run past its key's
limit (the claim statements lock the key's row; a trigger on agent_runs keeps its count), and a
change of a limit takes effect at the next claim. Plans (agent_runs.steps) that both
repository faces drive.
"""

from __future__ import annotations

from datetime import datetime

from agent_runs import validation as check
from agent_runs.models import KeyLimit
from agent_runs.steps import Execute, Plan, Transaction, planned
from agent_runs.transport import Row, statement

__all__ = ["KeyLimits"]


def _limit_of(row: Row) -> KeyLimit:
    return KeyLimit(
        concurrency_key=row["concurrency_key"],
        max_running=int(row["max_running"]),
        running=int(row["running"]),
        waiting=int(row["waiting"]),
    )


class KeyLimits:
    """The repository's limits per concurrency key (plans, see agent_runs.steps)."""

    @planned
    def set_limit(
        self, concurrency_key: str, max_running: int, *, now: datetime | None = None
    ) -> Plan[KeyLimit]:
        """At most `max_running` runs of `concurrency_key` counted at once, from the next claim
        (0 pauses the key). Lowering it admits nobody until the count is below it."""
        params = {
            "concurrency_key": check.concurrency_key(concurrency_key),
            "max_running": check.max_running(max_running),
            "now": check.now(now),
        }

        def save() -> Plan[list[Row]]:
            # The lock first, in a statement of its own: the count below then sees every
            # transition of the key that committed while it waited.
            yield Execute(statement("set_limit.lock"), params)
            rows: list[Row] = yield Execute(statement("set_limit"), params)
            yield Execute(statement("set_limit.gate"), params)
            return rows

        yield Transaction(save())
        [row] = yield Execute(statement("get_limit"), params)
        return _limit_of(row)

    @planned
    def get_limit(self, concurrency_key: str) -> Plan[KeyLimit | None]:
        """The key's limit, runs counted now and runs waiting; None when it has no limit."""
        params = {"concurrency_key": check.concurrency_key(concurrency_key)}
        rows: list[Row] = yield Execute(statement("get_limit"), params)
        return _limit_of(rows[0]) if rows else None

    @planned
    def delete_limit(self, concurrency_key: str) -> Plan[bool]:
        """Remove the key's limit: its runs are unlimited from the next claim. False when the
        key had none."""
        params = {"concurrency_key": check.concurrency_key(concurrency_key)}

        def delete() -> Plan[list[Row]]:
            rows: list[Row] = yield Execute(statement("delete_limit"), params)
            yield Execute(statement("set_limit.gate"), params)
            return rows

        rows = yield Transaction(delete())
        return bool(rows)

    @planned
    def list_limits(self) -> Plan[list[KeyLimit]]:
        """Every key with a limit, by key: its limit, runs counted now, runs waiting."""
        rows: list[Row] = yield Execute(statement("list_limits"), {})
        return [_limit_of(row) for row in rows]
