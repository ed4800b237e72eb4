"""Collections: agent slugs and the batches of the bulk calls (a lone str is refused)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from agent_runs.errors import InvalidArgument
from agent_runs.validation.documents import output_text
from agent_runs.validation.limits import MAX_BATCH
from agent_runs.validation.text import (
    error_message,
    error_type,
    identifier,
    terminal_status,
    worker_id,
)


def agent_slugs(value: object, name: str = "agent_slugs") -> list[str] | None:
    """None (every agent) or a non-empty collection of agent slugs; a lone str is refused."""
    if value is None:
        return None
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise InvalidArgument(
            f"{name} must be a list of agent slugs or None, got {type(value).__name__}"
        )
    slugs = [identifier(name, slug) for slug in value]
    if not slugs:
        raise InvalidArgument(f"{name} must not be empty (use None for every agent)")
    return slugs


def leases(value: object) -> tuple[list[str], list[str]]:
    """renew_leases: a mapping run_id -> worker_id, returned as two parallel lists."""
    if not isinstance(value, Mapping):
        raise InvalidArgument("leases must be a mapping of run_id to worker_id")
    run_ids = [identifier("leases run_id", run_id) for run_id in value]
    worker_ids = [worker_id(owner, "leases worker_id") for owner in value.values()]
    return run_ids, worker_ids


def worker_ids(value: object) -> list[str]:
    """claim_next_attempts: 1..MAX_BATCH distinct owner tokens; a lone str is refused."""
    items = _batch("worker_ids", value)
    owners = [worker_id(owner, "worker_ids") for owner in items]
    if len(set(owners)) != len(owners):
        raise InvalidArgument("worker_ids must be distinct (one run per owner token)")
    return owners


def finishes(value: object) -> list[list[str | None]]:
    """finish_runs: 1..MAX_BATCH Finish values of distinct runs, as six parallel lists
    (run_ids, worker_ids, statuses, error_types, error_messages, outputs as JSON text)."""
    items = _batch("finishes", value)
    columns: list[list[str | None]] = [[], [], [], [], [], []]
    for item in items:
        if not isinstance(item, tuple) or len(item) not in (5, 6):
            raise InvalidArgument(
                "finishes must hold Finish(run_id, worker_id, status, error_type, error_message,"
                f" output) values, got {type(item).__name__}"
            )
        run_id, owner, status, error, message, *rest = item
        row = (
            identifier("finishes run_id", run_id),
            worker_id(owner, "finishes worker_id"),
            terminal_status(status).value,
            error_type(error),
            error_message(message),
            output_text(rest[0] if rest else None, "finishes output"),
        )
        for column, field in zip(columns, row, strict=True):
            column.append(field)
    if len(set(columns[0])) != len(columns[0]):
        raise InvalidArgument("finishes must name each run_id once")
    return columns


def _batch(name: str, value: object) -> list[object]:
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise InvalidArgument(f"{name} must be a list, got {type(value).__name__}")
    items = list(value)
    if not 1 <= len(items) <= MAX_BATCH:
        raise InvalidArgument(f"{name} must hold 1 to {MAX_BATCH} items, got {len(items)}")
    return items
