"""create_runs: many runs in one statement with create_run's rules per item (idempotency, one
active run per thread, validation naming the item), parents inside the batch, one
agent_runs_claimable per slug."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import agent_runs
from agent_runs import AgentRunRepository, InvalidArgument, RunStatus, ThreadBusy
from agent_runs.notify import CLAIMABLE_CHANNEL
from agent_runs.validation import MAX_BATCH
from tests.helpers import assert_refused_before_sql, everything, new_run
from tests.test_notify import CONNECT_OPTIONS, received

Conn = psycopg.Connection[Any]


@pytest.fixture
def listener(dsn: str) -> Iterator[Conn]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("LISTEN agent_runs_claimable")
        conn.execute("LISTEN agent_runs_finished")
        yield conn


@pytest.fixture(params=list(CONNECT_OPTIONS))
def any_repo(request: pytest.FixtureRequest, dsn: str) -> Iterator[AgentRunRepository]:
    with agent_runs.connect(dsn, **CONNECT_OPTIONS[request.param]) as conn:
        yield AgentRunRepository(conn)


def item(**overrides: Any) -> dict[str, Any]:
    key = uuid.uuid4().hex
    return {"thread_id": f"t-{key}", "agent_slug": "agent", "uid": "u", "request_id": key} | (
        overrides
    )


def test_creates_every_item_in_order_with_its_arguments_and_wakes_each_slug_once(
    any_repo: AgentRunRepository, listener: Conn, observer: Conn
) -> None:
    repo = any_repo
    parent = new_run(repo)
    received(listener, observer)
    items = [
        item(agent_slug="a", input_payload={"n": 1, "text": "it's; -- \u00e9"}),
        item(agent_slug="b", run_type="subagent", created_by_run_id=parent.id),
        item(agent_slug="a", run_id="chosen-id"),
        item(agent_slug="a"),
    ]
    runs = repo.create_runs(items)
    assert [r.request_id for r in runs] == [i["request_id"] for i in items]
    assert all(r.status == RunStatus.PENDING and r.worker_id is None for r in runs)
    assert runs[0].input_payload == {"n": 1, "text": "it's; -- \u00e9"}
    assert runs[3].input_payload == {}
    assert (runs[1].run_type, runs[1].created_by_run_id) == ("subagent", parent.id)
    assert runs[2].id == "chosen-id"
    assert [repo.get_run(r.id) for r in runs] == runs
    assert all(repo.list_run_attempts(r.id) == [] for r in runs)
    assert sorted(received(listener, observer)) == [
        (CLAIMABLE_CHANNEL, "a"),
        (CLAIMABLE_CHANNEL, "b"),
    ]


def test_a_request_id_seen_before_gives_the_existing_run_whatever_its_status(
    repo: AgentRunRepository, listener: Conn, observer: Conn
) -> None:
    done = new_run(repo)
    repo.request_cancel(done.id)
    done = repo.get_run(done.id)  # type: ignore[assignment]
    fresh = item()
    received(listener, observer)
    runs = repo.create_runs(
        [item(request_id=done.request_id, thread_id="other"), fresh, item(**fresh)]
    )
    assert runs[0] == done
    assert runs[1] == runs[2]  # the same request twice in a batch: one run
    assert received(listener, observer) == [(CLAIMABLE_CHANNEL, "agent")]

    again = repo.create_runs([item(request_id=done.request_id), fresh])
    assert again == [done, runs[1]]
    assert received(listener, observer) == []  # nothing new: nobody to wake


def test_a_busy_thread_refuses_the_whole_batch_naming_the_item(
    repo: AgentRunRepository, listener: Conn, observer: Conn
) -> None:
    busy = new_run(repo, thread_id="busy")
    received(listener, observer)
    before = everything(observer)
    with pytest.raises(ThreadBusy, match=r"items\[2\]: thread 'busy'"):
        repo.create_runs([item(), item(), item(thread_id="busy", uid=busy.uid)])
    with pytest.raises(ThreadBusy, match=r"items\[3\]: thread 'twice'"):
        repo.create_runs([item(), item(thread_id="twice"), item(), item(thread_id="twice")])
    assert everything(observer) == before
    assert received(listener, observer) == []
    assert not repo.conn.info.transaction_status


def test_a_repeated_item_does_not_make_its_thread_busy_for_a_later_one(
    repo: AgentRunRepository,
) -> None:
    ended = new_run(repo, thread_id="t")
    repo.request_cancel(ended.id)
    runs = repo.create_runs(
        [item(request_id=ended.request_id, thread_id="t", uid=ended.uid), item(thread_id="t")]
    )
    assert runs[0].id == ended.id and runs[0].status == RunStatus.CANCELLED
    assert runs[1].status == RunStatus.PENDING and runs[1].thread_id == "t"


def test_parents_may_be_runs_of_the_same_batch(repo: AgentRunRepository) -> None:
    children = [item(created_by_run_id="lead-run", run_type="subagent") for _ in range(3)]
    runs = repo.create_runs([children[0], item(run_id="lead-run"), *children[1:]])
    assert {r.created_by_run_id for r in runs} == {"lead-run", None}
    cancelled = repo.request_cancel_tree("lead-run")
    assert len(cancelled) == 4


@pytest.mark.parametrize(
    ("items", "match"),
    [
        ([item(created_by_run_id="nobody")], r"items\[0\]: created_by_run_id 'nobody'"),
        ([item(), item(run_id="taken")], r"items\[1\]: run_id 'taken' already exists"),
    ],
)
def test_a_missing_parent_or_a_taken_run_id_is_refused_naming_the_item(
    repo: AgentRunRepository, observer: Conn, items: list[dict[str, Any]], match: str
) -> None:
    new_run(repo, run_id="taken")
    before = everything(observer)
    with pytest.raises(InvalidArgument, match=match):
        repo.create_runs(items)
    assert everything(observer) == before


@pytest.mark.parametrize(
    ("items", "argument"),
    [
        ("not a list", "items must be a list"),
        ({"thread_id": "t"}, "items must be a list"),
        ([], "items must hold 1 to"),
        ([item()] * (MAX_BATCH + 1), "items must hold 1 to"),
        ([item(), "x"], "items[1] must be a mapping"),
        ([item(), item(colour="red")], "items[1]: unknown argument(s) colour"),
        ([{"thread_id": "t", "agent_slug": "a", "uid": "u"}], "items[0]: request_id is required"),
        ([item(), item(uid="")], "items[1]: uid"),
        ([item(thread_id="x" * 65)], "items[0]: thread_id"),
        ([item(agent_slug="a\x00b")], "items[0]: agent_slug"),
        ([item(run_type="batch")], "items[0]: run_type"),
        ([item(input_payload={"x": float("nan")})], "items[0]: input_payload"),
        ([item(input_payload=[1])], "items[0]: input_payload"),
        ([item(created_by_run_id="")], "items[0]: created_by_run_id"),
        ([item(run_id="same"), item(run_id="same")], "items[1]: run_id 'same'"),
        ([item(run_id="me", created_by_run_id="me")], "items[0]: created_by_run_id 'me'"),
        (
            [
                item(run_id="x", created_by_run_id="z"),
                item(run_id="y", created_by_run_id="x"),
                item(run_id="z", created_by_run_id="y"),
            ],
            "closes a loop",
        ),
    ],
)
def test_bad_items_are_refused_before_any_sql_naming_item_and_argument(
    dsn: str, items: Any, argument: str
) -> None:
    assert_refused_before_sql(dsn, argument, lambda repo, _runs: repo.create_runs(items))


def _race(dsn: str, batches: list[list[dict[str, Any]]]) -> list[list[str] | str]:
    """Each batch from its own connection, all started together: the run ids each got, or
    'busy'."""
    barrier = threading.Barrier(len(batches))
    outcomes: list[list[str] | str] = []

    def create(batch: list[dict[str, Any]]) -> None:
        with agent_runs.connect(dsn) as conn:
            barrier.wait()
            try:
                outcomes.append([r.id for r in AgentRunRepository(conn).create_runs(batch)])
            except ThreadBusy:
                outcomes.append("busy")

    workers = [threading.Thread(target=create, args=(batch,)) for batch in batches]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert len(outcomes) == len(batches)
    return outcomes


def test_concurrent_batches_with_the_same_requests_get_the_same_runs(dsn: str) -> None:
    for _ in range(5):
        items = [item() for _ in range(20)]
        outcomes = _race(dsn, [items, items, items[::-1]])
        ids = {tuple(sorted(ids)) for ids in outcomes}
        assert len(ids) == 1 and len(next(iter(ids))) == 20


def test_inside_a_callers_transaction_a_refusal_leaves_it_usable_and_rollback_undoes_all(
    repo: AgentRunRepository, conn: Conn, observer: Conn
) -> None:
    busy = new_run(repo, thread_id="busy")
    before = everything(observer)
    with repo.transaction():
        with pytest.raises(ThreadBusy):
            repo.create_runs([item(thread_id="busy", uid=busy.uid)])
        kept = repo.create_runs([item()])
        assert repo.get_run(kept[0].id) is not None
        with conn.transaction(force_rollback=True):
            repo.create_runs([item(), item()])
    after = everything(observer)
    assert len(after[0]) == len(before[0]) + 1


def test_concurrent_batches_on_the_same_threads_one_wins_the_other_is_told_busy(
    dsn: str, observer: Conn
) -> None:
    for _ in range(3):
        threads = [f"t-{uuid.uuid4().hex}" for _ in range(10)]
        outcomes = _race(
            dsn, [[item(thread_id=t) for t in threads], [item(thread_id=t) for t in threads[::-1]]]
        )
        assert sorted(map(str, outcomes)).count("busy") == 1
        row = observer.execute(
            "SELECT count(*) FROM agent_runs WHERE thread_id = ANY(%s)", (threads,)
        ).fetchone()
        assert row == (10,)
