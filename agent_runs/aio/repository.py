"""AsyncAgentRunRepository: every method of AgentRunRepository as a coroutine, over one psycopg
AsyncConnection, driving the very same plans (agent_runs.steps): the same sql/ files, checks,
values and errors; one round trip per transition."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from agent_runs.aio.driver import AsyncDriver
from agent_runs.repository import AgentRunRepository as Sync
from agent_runs.steps import as_method, plan_of

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _coroutine(
    method: Callable[Concatenate[Any, _P], _T],
) -> Callable[Concatenate[AsyncDriver, _P], Coroutine[Any, Any, _T]]:
    """The synchronous face's method as a coroutine method that awaits the same plan here."""
    plan = plan_of(method)

    async def call(face: AsyncDriver, /, *args: Any, **kwargs: Any) -> Any:
        return await face._drive(plan(face, *args, **kwargs))

    call.plan = plan  # type: ignore[attr-defined]
    return as_method(plan, call)


def _stream(
    method: Callable[Concatenate[Any, _P], Iterator[_T]],
) -> Callable[Concatenate[AsyncDriver, _P], AsyncIterator[_T]]:
    """A stream method: the same one, whose face's `_iterate` is an async generator here."""
    return cast("Callable[Concatenate[AsyncDriver, _P], AsyncIterator[_T]]", method)


class AsyncAgentRunRepository(AsyncDriver):
    """AgentRunRepository for asyncio: `await repo.create_run(...)`, `async with
    repo.transaction(): ...`, `async for batch in repo.prune_batches(...)`.

    Each call runs in its own transaction (a lone statement on an idle autocommit connection,
    a savepoint inside the caller's transaction); tasks sharing the connection take turns. A
    task cancelled during a call leaves the connection idle (or closed) and the transition
    whole or absent: a CancelledError can arrive after the commit, so read the run to know.
    """

    # creating and reading
    create_run = _coroutine(Sync.create_run)
    get_run = _coroutine(Sync.get_run)
    get_run_by_owner = _coroutine(Sync.get_run_by_owner)
    list_run_attempts = _coroutine(Sync.list_run_attempts)
    get_open_attempt = _coroutine(Sync.get_open_attempt)
    # ownership
    mark_running = _coroutine(Sync.mark_running)
    claim_next = _coroutine(Sync.claim_next)
    claim_next_attempt = _coroutine(Sync.claim_next_attempt)
    claim_next_attempts = _coroutine(Sync.claim_next_attempts)
    renew_lease = _coroutine(Sync.renew_lease)
    renew_leases = _coroutine(Sync.renew_leases)
    release_lease_for_retry = _coroutine(Sync.release_lease_for_retry)
    # finishing
    set_terminal_status = _coroutine(Sync.set_terminal_status)
    finish_runs = _coroutine(Sync.finish_runs)
    finish_runs_and_claim = _coroutine(Sync.finish_runs_and_claim)
    request_cancel = _coroutine(Sync.request_cancel)
    reconcile_expired_leases = _coroutine(Sync.reconcile_expired_leases)
    record_run_manifest = _coroutine(Sync.record_run_manifest)
    record_resumed_from = _coroutine(Sync.record_resumed_from)
    create_runs = _coroutine(Sync.create_runs)
    # operating
    list_runs = _coroutine(Sync.list_runs)
    list_run_summaries = _coroutine(Sync.list_run_summaries)
    list_run_listings = _coroutine(Sync.list_run_listings)
    request_cancel_tree = _coroutine(Sync.request_cancel_tree)
    run_stats = _coroutine(Sync.run_stats)
    prune_finished_runs = _coroutine(Sync.prune_finished_runs)
    prune_batches = _stream(Sync.prune_batches)
    # recovery policy
    retry_or_fail = _coroutine(Sync.retry_or_fail)
    requeue_run = _coroutine(Sync.requeue_run)
    list_run_requeues = _coroutine(Sync.list_run_requeues)
    list_scheduled_runs = _coroutine(Sync.list_scheduled_runs)
    next_available_in = _coroutine(Sync.next_available_in)
    set_policy = _coroutine(Sync.set_policy)
    get_policy = _coroutine(Sync.get_policy)
    list_policies = _coroutine(Sync.list_policies)
    delete_policy = _coroutine(Sync.delete_policy)
    # limits per key
    set_limit = _coroutine(Sync.set_limit)
    get_limit = _coroutine(Sync.get_limit)
    delete_limit = _coroutine(Sync.delete_limit)
    list_limits = _coroutine(Sync.list_limits)
