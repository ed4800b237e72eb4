"""The words of the explanation for a waiting run whose concurrency key is full."""

from __future__ import annotations

from agent_runs.display import escape
from agent_runs.models import AgentRun, KeyLimit, RunStatus


def key_wait_text(run: AgentRun, key_limit: KeyLimit | None) -> str | None:
    """ "; waiting for its key K (n running, limit m)" when `run` waits (pending, or
    cancel_requested without an owner) and `key_limit`, its key's limit, is full; else None."""
    waiting = run.status == RunStatus.PENDING or (
        run.status == RunStatus.CANCEL_REQUESTED and run.worker_id is None
    )
    if (
        not waiting
        or key_limit is None
        or key_limit.concurrency_key != run.concurrency_key
        or key_limit.running < key_limit.max_running
    ):
        return None
    return (
        f"; waiting for its key {escape(key_limit.concurrency_key)} "
        f"({key_limit.running} running, limit {key_limit.max_running})"
    )
