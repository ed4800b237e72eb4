"""The repository's contract against both faces, in one suite: the rule-by-rule tests of
test_repository.py, test_operator_queries.py and test_create_runs.py are collected here again,
each run with this module's `repo` fixture: AgentRunRepository, AsyncAgentRunRepository (called
through a blocking adapter on a private event loop) and, where PgBouncer is installed,
AsyncAgentRunRepository through PgBouncer in transaction mode. Not a copy: the same test
functions."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from psycopg import pq

from agent_runs import AgentRunRepository, InvalidArgument, ThreadBusy, aio
from agent_runs.devtools.pgbouncer import PgBouncer, pgbouncer, pgbouncer_binary
from bench.protocol import traced
from tests.helpers import OWNER, Call, Runs, new_run, row_counts
from tests.test_create_runs import (  # noqa: F401 - collected here with this module's repo
    listener,
    test_a_busy_thread_refuses_the_whole_batch_naming_the_item,
    test_a_missing_parent_or_a_taken_run_id_is_refused_naming_the_item,
    test_a_repeated_item_does_not_make_its_thread_busy_for_a_later_one,
    test_parents_may_be_runs_of_the_same_batch,
)
from tests.test_limits import (  # noqa: F401 - collected here with this module's repo
    test_a_batched_claim_admits_a_key_only_up_to_its_free_slots_in_claim_order,
    test_a_claim_never_reads_the_runs_of_a_full_key,
    test_a_lowered_limit_admits_nobody_until_the_count_is_below_it,
    test_a_parked_run_made_pending_again_by_another_writer_is_never_stuck_parked,
    test_a_run_of_a_full_key_keeps_its_place_and_is_claimed_in_order_when_a_slot_frees,
    test_bad_keys_and_limits_are_refused_by_name_writing_nothing,
    test_every_transition_out_of_the_counted_states_frees_the_slot,
    test_finish_runs_and_claim_frees_its_slot_for_the_keys_next_run,
    test_finish_runs_and_claim_may_take_a_slot_it_frees_for_an_unparked_run,
    test_mark_running_on_a_run_whose_key_is_full_is_refused_writing_nothing,
    test_raising_deleting_and_pausing_a_limit_take_effect_at_the_next_claim,
    test_runs_are_listed_by_key_and_created_with_it_in_batches,
    test_the_explanation_of_a_run_waiting_for_its_key_says_so,
)
from tests.test_operator_queries import (  # noqa: F401 - collected here with this module's repo
    listed,
    test_cancel_tree_of_an_unknown_run_is_refused,
    test_cancel_tree_reaches_below_terminal_children_and_only_reports_changes,
    test_list_runs_filters_and_their_combinations,
    test_list_runs_is_newest_first_with_attempt_counts,
    test_list_runs_refuses_bad_arguments_by_name,
    test_list_runs_since_a_timestamp,
    test_prune_deletes_old_trees_with_their_attempts_and_keeps_the_rest,
    test_prune_dry_run_counts_without_deleting,
    test_prune_never_deletes_a_tree_that_gained_a_child_its_first_step_did_not_see,
    test_prune_refuses_bad_arguments_by_name,
    test_run_stats_counts_the_window_and_the_queue,
)
from tests.test_repository import (  # noqa: F401 - collected here with this module's repo
    test_a_cancel_requested_run_may_only_become_cancelled,
    test_a_claim_after_a_retry_release_keeps_started_at_and_opens_the_next_attempt,
    test_a_durable_cancel_wins_the_completion_race,
    test_a_lease_is_expired_exactly_at_its_expiry,
    test_a_pending_run_can_be_failed_or_cancelled_without_an_owner,
    test_a_pending_run_refuses_other_terminal_transitions,
    test_a_running_run_may_not_become_cancelled_even_by_its_owner,
    test_a_second_active_run_on_a_thread_raises_thread_busy_and_writes_nothing,
    test_a_terminal_run_is_never_changed_again,
    test_an_expired_owner_is_refused_everywhere_before_and_after_reconciliation,
    test_an_initial_claim_converges_a_forged_open_attempt_to_lease_expired,
    test_an_initial_claim_makes_the_run_running_and_opens_attempt_one,
    test_an_initial_claim_of_an_ownerless_cancel_requested_run_keeps_it_cancel_requested,
    test_cancelling_a_pending_run_that_never_started_cancels_it_at_once,
    test_cancelling_a_running_run_asks_its_owner_who_keeps_the_lease,
    test_claim_next_filters_by_agent_slugs,
    test_claim_next_is_fifo_by_created_at_then_id,
    test_claim_next_returns_none_when_nothing_is_claimable,
    test_create_run_stores_a_pending_run_with_no_lease_and_no_attempt,
    test_create_run_uses_the_given_run_id_type_and_parent,
    test_mark_running_refuses_a_running_run_it_may_not_take,
    test_only_the_live_owner_can_finish_a_running_run,
    test_readers_of_a_missing_run_return_nothing,
    test_record_run_manifest_refuses_anyone_but_the_live_owner_of_a_running_run,
    test_release_for_retry_is_refused_to_a_stale_or_expired_owner,
    test_release_for_retry_returns_the_run_to_pending_and_finishes_the_attempt,
    test_renew_lease_is_refused_to_a_stale_or_expired_owner,
    test_renew_lease_moves_the_run_and_its_open_attempt_forward,
    test_the_live_owner_records_the_manifest_once,
    test_the_owner_finishes_a_running_run_and_its_attempt_with_the_same_classification,
    test_the_reconciler_converges_every_kind_of_lost_run,
    test_the_reconciler_respects_its_limit,
    test_the_same_live_owner_claiming_again_refreshes_its_lease_without_a_new_attempt,
    test_the_same_request_id_returns_the_existing_run_whatever_its_status,
    test_values_are_frozen_dataclasses_with_utc_timestamps,
)
from tests.test_validation import CASES

FACES = ("sync", "async", "async-pgbouncer")


class BlockingFace:
    """AsyncAgentRunRepository called synchronously: each call runs to its end on the runner's
    event loop. Streams come back as lists; `transaction()` is a plain context manager whose
    block's calls run in the one task that holds the transaction (only that task's calls run
    inside it: a call from any other task waits for its end)."""

    def __init__(self, runner: asyncio.Runner, repo: aio.AsyncAgentRunRepository) -> None:
        self.runner = runner
        self.repo = repo
        self.conn = repo.conn
        self._session: _Session | None = None

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.repo, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            answer = method(*args, **kwargs)
            stream = inspect.isasyncgen(answer)
            awaited = _listed(answer) if stream else answer
            if self._session is not None:
                awaited = self._session.call(awaited)
            value = self.runner.run(awaited)
            return iter(value) if stream else value

        return call

    @contextmanager
    def transaction(self) -> Iterator[None]:
        outer = self._session
        session = _Session(self.repo)
        # A block nested in another runs in the outer block's task, as a call of it.
        start = session.run() if outer is None else outer.call(session.run())
        task = self.runner.get_loop().create_task(start)
        self.runner.run(session.started(task))
        self._session = session
        try:
            yield
        except BaseException as exc:
            self._session = outer
            if not self.runner.run(session.end(task, exc)):
                raise
        else:
            self._session = outer
            self.runner.run(session.end(task, None))


class _Session:
    """One task holding `async with repo.transaction():` and running the calls sent to it."""

    def __init__(self, repo: aio.AsyncAgentRunRepository) -> None:
        self.repo = repo
        self.opened = asyncio.Event()
        self.inbox: asyncio.Queue[_Item] = asyncio.Queue()

    async def run(self) -> None:
        async with self.repo.transaction():
            self.opened.set()
            while (item := await self.inbox.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                call, answer = item
                try:
                    answer.set_result(await call)
                except Exception as exc:
                    answer.set_exception(exc)

    async def started(self, task: asyncio.Task[Any]) -> None:
        """Once the block is open (or the task failed to open it: its error)."""
        opened = asyncio.ensure_future(self.opened.wait())
        await asyncio.wait({task, opened}, return_when=asyncio.FIRST_COMPLETED)
        opened.cancel()
        if not self.opened.is_set():
            await task

    async def call(self, call: Awaitable[Any]) -> Any:
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await self.inbox.put((call, answer))
        return await answer

    async def end(self, task: asyncio.Task[Any], exc: BaseException | None) -> bool:
        """Leave the block (raising `exc` in it); whether it swallowed `exc`."""
        await self.inbox.put(exc)
        try:
            await task
        except BaseException as raised:
            if raised is exc:
                return False
            raise
        return exc is not None


_Item = tuple[Awaitable[Any], "asyncio.Future[Any]"] | BaseException | None


async def _listed(items: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in items]


@contextmanager
def blocking_face(url: str, **options: Any) -> Iterator[BlockingFace]:
    """The async repository on a connection of its own to `url`, called synchronously."""
    with asyncio.Runner() as runner:
        aconn = runner.run(aio.connect(url, **options))
        try:
            yield BlockingFace(runner, aio.AsyncAgentRunRepository(aconn))
        finally:
            runner.run(aconn.close())


@pytest.fixture(scope="module")
def tx_bouncer(pg_server: Any) -> Iterator[PgBouncer | None]:
    if pgbouncer_binary() is None:
        yield None
        return
    with pgbouncer(pg_server.admin_url, mode="transaction", pool_size=2) as started:
        yield started


@pytest.fixture(params=FACES)
def repo(
    request: pytest.FixtureRequest,
    dsn: str,
    conn: psycopg.Connection[Any],
    tx_bouncer: PgBouncer | None,
) -> Iterator[Any]:
    """The face under test (overrides conftest's `repo` for the tests collected here)."""
    if request.param == "sync":
        yield AgentRunRepository(conn)
    elif request.param == "async":
        with blocking_face(dsn) as face:
            yield face
    else:
        if tx_bouncer is None:
            pytest.skip("pgbouncer is not installed (CI installs it)")
        with blocking_face(tx_bouncer.url_for(dsn), prepare_threshold=None) as face:
            yield face


def test_the_async_face_has_every_public_method_of_the_sync_one() -> None:
    public = {n for n in dir(AgentRunRepository) if not n.startswith("_")}
    assert public <= set(dir(aio.AsyncAgentRunRepository))
    for name in public - {"conn"}:
        ours = inspect.signature(getattr(aio.AsyncAgentRunRepository, name)).parameters
        assert ours == inspect.signature(getattr(AgentRunRepository, name)).parameters, name
    unbound = object.__new__(aio.AsyncAgentRunRepository)
    assert inspect.iscoroutinefunction(unbound.create_run)
    assert not inspect.iscoroutinefunction(object.__new__(AgentRunRepository).create_run)


@pytest.mark.parametrize(("argument", "call"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_async_face_refuses_a_bad_argument_before_any_sql_runs(
    pg_server: Any, argument: str, call: Call
) -> None:
    """On a closed connection any SQL would fail: only the shared validation can answer."""
    with blocking_face(pg_server.admin_url) as face:
        face.runner.run(face.conn.close())
        fake = Runs(pending="pending-run", running="running-run", now=datetime.now(UTC))
        with pytest.raises(InvalidArgument) as refused:
            call(face, fake)  # type: ignore[arg-type]
        assert argument in str(refused.value)


ROUND_TRIP_CALLS: dict[str, Callable[[BlockingFace, str], object]] = {
    "create_run": lambda f, _: f.create_run(
        thread_id="t2", agent_slug="agent", uid="u", request_id="r2"
    ),
    "get_run": lambda f, run_id: f.get_run(run_id),
    "mark_running": lambda f, run_id: f.mark_running(run_id, worker_id="w:1", lease_seconds=30),
    "claim_next": lambda f, _: f.claim_next(worker_id="w:2", lease_seconds=30),
    "request_cancel": lambda f, run_id: f.request_cancel(run_id),
    "set_terminal_status": lambda f, run_id: f.set_terminal_status(
        run_id, status="failed", error_type="e", error_message="m"
    ),
}


@pytest.mark.parametrize("name", ROUND_TRIP_CALLS)
def test_each_async_transition_is_one_statement_in_one_round_trip(dsn: str, name: str) -> None:
    with blocking_face(dsn) as face:
        run = face.create_run(thread_id="t1", agent_slug="agent", uid="u", request_id="r1")
        with traced(face.conn) as counts:  # type: ignore[arg-type]
            ROUND_TRIP_CALLS[name](face, run.id)
        assert (counts.round_trips, counts.statements) == (1, 1), counts.commands
        assert face.conn.info.transaction_status == pq.TransactionStatus.IDLE


def test_calls_in_a_transaction_commit_or_roll_back_together_and_a_refusal_does_not_abort_it(
    repo: Any, observer: psycopg.Connection[Any]
) -> None:
    """`with repo.transaction():` (`async with` on the async face) composes calls."""
    with pytest.raises(RuntimeError), repo.transaction():
        run = new_run(repo)
        assert repo.mark_running(run.id, worker_id=OWNER, lease_seconds=30).acquired
        raise RuntimeError("the caller changes its mind")
    assert row_counts(observer) == (0, 0)
    with repo.transaction():
        run = new_run(repo)
        with pytest.raises(ThreadBusy):  # refused inside a savepoint: the transaction goes on
            new_run(repo, thread_id=run.thread_id)
        claim = repo.mark_running(run.id, worker_id=OWNER, lease_seconds=30)
    assert claim.acquired and row_counts(observer) == (1, 1)
    assert repo.conn.info.transaction_status == pq.TransactionStatus.IDLE
