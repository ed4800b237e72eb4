"""Concurrency limits per key: admission on every claim path, the count, waking, bad input.

The functions taking `repo` are collected again by test_aio_contract.py against the asyncio
face."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from agent_runs import AgentRunRepository, Finish, InvalidArgument, KeyLimit, RunStatus
from agent_runs.explain import explain_run
from tests.helpers import everything, new_run

Conn = psycopg.Connection[Any]
LEASE = 60.0


def _counted(observer: Conn, key: str) -> int:
    """The key's runs counted now, from the runs themselves (never from the counter)."""
    row = observer.execute(
        "SELECT count(*) FROM agent_runs WHERE concurrency_key = %s"
        " AND (status = 'running' OR (status = 'cancel_requested' AND worker_id IS NOT NULL))",
        (key,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def _limit(repo: AgentRunRepository, key: str) -> KeyLimit:
    [found] = [x for x in repo.list_limits() if x.concurrency_key == key]
    return found


def test_a_run_of_a_full_key_keeps_its_place_and_is_claimed_in_order_when_a_slot_frees(
    repo: AgentRunRepository,
) -> None:
    repo.set_limit("user:a", 1)
    first = new_run(repo, concurrency_key="user:a")
    second = new_run(repo, concurrency_key="user:a")
    free = new_run(repo)
    third = new_run(repo, concurrency_key="user:a")
    claimed = repo.claim_next(worker_id="w-1", lease_seconds=LEASE)
    assert claimed is not None and claimed.id == first.id
    skipped = repo.claim_next(worker_id="w-2", lease_seconds=LEASE)
    assert skipped is not None and skipped.id == free.id  # second waits, its place kept
    assert repo.claim_next(worker_id="w-3", lease_seconds=LEASE) is None
    assert repo.set_terminal_status(first.id, status="completed", worker_id="w-1").changed
    after = repo.claim_next(worker_id="w-4", lease_seconds=LEASE)
    assert after is not None and after.id == second.id
    assert after.concurrency_key == "user:a"
    assert repo.get_run(third.id).status == RunStatus.PENDING  # type: ignore[union-attr]
    assert _limit(repo, "user:a") == KeyLimit("user:a", 1, 1, 1)


def test_a_batched_claim_admits_a_key_only_up_to_its_free_slots_in_claim_order(
    repo: AgentRunRepository,
) -> None:
    repo.set_limit("provider:x", 2)
    keyed = [new_run(repo, concurrency_key="provider:x") for _ in range(4)]
    other = [new_run(repo, concurrency_key="provider:y") for _ in range(2)]
    claimed = repo.claim_next_attempts(worker_ids=[f"w-{i}" for i in range(8)], lease_seconds=LEASE)
    ids = {c.run.id for c in claimed}
    assert ids == {keyed[0].id, keyed[1].id, other[0].id, other[1].id}
    assert repo.list_limits() == [KeyLimit("provider:x", 2, 2, 2)]


def test_finish_runs_and_claim_frees_its_slot_for_the_keys_next_run(
    repo: AgentRunRepository,
) -> None:
    """The key's next run was parked when its key filled: it comes back at the statement's
    end, and the next claim takes it (the statement itself claims only unparked runs)."""
    repo.set_limit("user:b", 1)
    first = new_run(repo, concurrency_key="user:b")
    second = new_run(repo, concurrency_key="user:b")
    claimed = repo.claim_next(worker_id="w-1", lease_seconds=LEASE)
    assert claimed is not None and claimed.id == first.id
    finished, next_runs = repo.finish_runs_and_claim(
        [Finish(first.id, "w-1", "completed")], worker_ids=["w-2"], lease_seconds=LEASE
    )
    assert list(finished) == [first.id]
    assert next_runs == []
    assert _limit(repo, "user:b").running == 0
    claimed = repo.claim_next(worker_id="w-3", lease_seconds=LEASE)
    assert claimed is not None and claimed.id == second.id
    assert _limit(repo, "user:b").running == 1


def test_finish_runs_and_claim_may_take_a_slot_it_frees_for_an_unparked_run(
    repo: AgentRunRepository, observer: Conn
) -> None:
    repo.set_limit("user:f", 1)
    first = new_run(repo, concurrency_key="user:f")
    assert repo.claim_next(worker_id="w-1", lease_seconds=LEASE).id == first.id  # type: ignore[union-attr]
    # Created while its key was full, by a writer holding the key row: never parked.
    second = new_run(repo, concurrency_key="user:f")
    observer.execute("UPDATE agent_runs SET key_waiting = false WHERE id = %s", (second.id,))
    assert repo.claim_next(worker_id="w-2", lease_seconds=LEASE) is None  # passed over
    _, next_runs = repo.finish_runs_and_claim(
        [Finish(first.id, "w-1", "completed")], worker_ids=["w-2"], lease_seconds=LEASE
    )
    assert [c.run.id for c in next_runs] == [second.id]
    assert _limit(repo, "user:f").running == 1


def test_mark_running_on_a_run_whose_key_is_full_is_refused_writing_nothing(
    repo: AgentRunRepository, observer: Conn
) -> None:
    repo.set_limit("user:c", 1)
    new_run(repo, concurrency_key="user:c")
    waiting = new_run(repo, concurrency_key="user:c")
    assert repo.claim_next(worker_id="w-1", lease_seconds=LEASE) is not None
    before = everything(observer)
    run, acquired = repo.mark_running(waiting.id, worker_id="w-2", lease_seconds=LEASE)
    assert not acquired and run is not None and run.status == RunStatus.PENDING
    assert everything(observer) == before
    assert repo.list_run_attempts(waiting.id) == []


def test_a_lowered_limit_admits_nobody_until_the_count_is_below_it(
    repo: AgentRunRepository, observer: Conn
) -> None:
    repo.set_limit("user:d", 3)
    runs = [new_run(repo, concurrency_key="user:d") for _ in range(4)]
    owned = [repo.claim_next(worker_id=f"w-{i}", lease_seconds=LEASE) for i in range(3)]
    assert [r.id for r in owned if r is not None] == [r.id for r in runs[:3]]
    assert repo.set_limit("user:d", 1) == KeyLimit("user:d", 1, 3, 1)
    for index in range(3):
        assert repo.claim_next(worker_id="late", lease_seconds=LEASE) is None
        assert repo.set_terminal_status(runs[index].id, status="completed", worker_id=f"w-{index}")
        assert _counted(observer, "user:d") == 2 - index
    claimed = repo.claim_next(worker_id="late", lease_seconds=LEASE)
    assert claimed is not None and claimed.id == runs[3].id


def test_raising_deleting_and_pausing_a_limit_take_effect_at_the_next_claim(
    repo: AgentRunRepository,
) -> None:
    repo.set_limit("user:e", 0)  # paused
    runs = [new_run(repo, concurrency_key="user:e") for _ in range(3)]
    assert repo.claim_next(worker_id="w", lease_seconds=LEASE) is None
    repo.set_limit("user:e", 1)
    assert repo.claim_next(worker_id="w-1", lease_seconds=LEASE).id == runs[0].id  # type: ignore[union-attr]
    assert repo.claim_next(worker_id="w", lease_seconds=LEASE) is None
    assert repo.delete_limit("user:e") is True
    assert repo.delete_limit("user:e") is False
    assert repo.list_limits() == []
    assert repo.claim_next(worker_id="w-2", lease_seconds=LEASE).id == runs[1].id  # type: ignore[union-attr]
    # A limit set on a key with live runs starts from their count.
    assert repo.set_limit("user:e", 2) == KeyLimit("user:e", 2, 2, 1)
    assert repo.claim_next(worker_id="w", lease_seconds=LEASE) is None


def test_every_transition_out_of_the_counted_states_frees_the_slot(
    repo: AgentRunRepository, observer: Conn
) -> None:
    repo.set_limit("k", 5)
    runs = [new_run(repo, concurrency_key="k") for _ in range(5)]
    for i in range(5):
        assert repo.claim_next(worker_id=f"w-{i}", lease_seconds=LEASE) is not None
    assert _limit(repo, "k").running == 5
    assert repo.release_lease_for_retry(runs[0].id, worker_id="w-0")
    repo.request_cancel(runs[1].id)  # cancel_requested with an owner: still counted
    assert _limit(repo, "k").running == 4
    assert repo.set_terminal_status(runs[1].id, status="cancelled", worker_id="w-1").changed
    repo.set_terminal_status(runs[2].id, status="failed", worker_id="w-2", error_type="x")
    observer.execute(
        "UPDATE agent_runs SET lease_expires_at = heartbeat_at WHERE id = %s", (runs[3].id,)
    )
    assert [r.id for r in repo.reconcile_expired_leases()] == [runs[3].id]
    assert _limit(repo, "k").running == 1 == _counted(observer, "k")
    # A raw writer is counted too: the trigger keeps the count whoever writes the run.
    observer.execute("DELETE FROM agent_runs WHERE id = %s", (runs[4].id,))
    assert _limit(repo, "k").running == 0 == _counted(observer, "k")


def test_runs_are_listed_by_key_and_created_with_it_in_batches(repo: AgentRunRepository) -> None:
    created = repo.create_runs(
        [
            {"thread_id": "t-1", "agent_slug": "a", "uid": "u", "request_id": "r-1",
             "concurrency_key": "tenant:1"},
            {"thread_id": "t-2", "agent_slug": "a", "uid": "u", "request_id": "r-2"},
        ]
    )  # fmt: skip
    assert [r.concurrency_key for r in created] == ["tenant:1", None]
    assert [r.id for r in repo.list_runs(concurrency_key="tenant:1")] == [created[0].id]


@pytest.mark.parametrize(
    ("argument", "call"),
    [
        ("concurrency_key", lambda r: new_run(r, concurrency_key="k" * 129)),
        ("concurrency_key", lambda r: new_run(r, concurrency_key="a\x00b")),
        ("concurrency_key", lambda r: new_run(r, concurrency_key="")),
        ("concurrency_key", lambda r: r.set_limit("k" * 129, 1)),
        ("concurrency_key", lambda r: r.set_limit("a\x00b", 1)),
        ("max_running", lambda r: r.set_limit("k", -1)),
        ("max_running", lambda r: r.set_limit("k", 2**31)),
        ("max_running", lambda r: r.set_limit("k", True)),
        ("concurrency_key", lambda r: r.delete_limit("a\x00b")),
        ("concurrency_key", lambda r: r.list_runs(concurrency_key="k" * 129)),
        (
            "concurrency_key",
            lambda r: r.create_runs(
                [
                    {
                        "thread_id": "t",
                        "agent_slug": "a",
                        "uid": "u",
                        "request_id": "q",
                        "concurrency_key": "k" * 129,
                    }
                ]
            ),
        ),
    ],
)
def test_bad_keys_and_limits_are_refused_by_name_writing_nothing(
    repo: AgentRunRepository, observer: Conn, argument: str, call: Any
) -> None:
    before = everything(observer), observer.execute("SELECT * FROM agent_run_limits").fetchall()
    with pytest.raises(InvalidArgument, match=argument):
        call(repo)
    after = everything(observer), observer.execute("SELECT * FROM agent_run_limits").fetchall()
    assert after == before


def test_a_claim_never_reads_the_runs_of_a_full_key(
    repo: AgentRunRepository, observer: Conn
) -> None:
    """A full key's waiting runs leave the claim index (parked), in whatever way they came:
    created while it was full, or waiting when it filled; they come back when slots free."""
    repo.set_limit("busy", 1)
    early = [new_run(repo, concurrency_key="busy") for _ in range(30)]
    assert repo.claim_next(worker_id="w-1", lease_seconds=LEASE).id == early[0].id  # type: ignore[union-attr]
    late = [new_run(repo, concurrency_key="busy") for _ in range(30)]
    free = new_run(repo)
    plan = "\n".join(
        row[0]
        for row in observer.execute(
            "EXPLAIN (ANALYZE, TIMING OFF, COSTS OFF) SELECT id FROM agent_runs r"
            " WHERE (status = 'pending' OR (status = 'cancel_requested' AND worker_id IS NULL))"
            " AND NOT r.key_waiting ORDER BY created_at, id LIMIT 1"
        )
    )
    assert "ix_agent_runs_claimable" in plan and "Rows Removed" not in plan, plan
    assert repo.claim_next(worker_id="w-2", lease_seconds=LEASE).id == free.id  # type: ignore[union-attr]
    parked = observer.execute(
        "SELECT count(*) FROM agent_runs WHERE concurrency_key = 'busy' AND key_waiting"
    ).fetchone()
    assert parked == (59,)
    repo.set_limit("busy", 3)  # two slots free: the two oldest waiting runs come back
    claimed = [repo.claim_next(worker_id=f"w-{i}", lease_seconds=LEASE) for i in (3, 4, 5)]
    assert [c.id if c else None for c in claimed] == [early[1].id, early[2].id, None]
    assert repo.delete_limit("busy")
    assert repo.claim_next(worker_id="w-6", lease_seconds=LEASE).id == early[3].id  # type: ignore[union-attr]
    assert late[0].id in {r.id for r in repo.list_runs(concurrency_key="busy", limit=100)}


def test_the_explanation_of_a_run_waiting_for_its_key_says_so(repo: AgentRunRepository) -> None:
    repo.set_limit("user:g", 1)
    first = new_run(repo, concurrency_key="user:g")
    waiting = new_run(repo, concurrency_key="user:g")
    running = repo.claim_next(worker_id="w-1", lease_seconds=LEASE)
    assert running is not None and running.id == first.id
    limit = repo.get_limit("user:g")
    assert limit == KeyLimit("user:g", 1, 1, 1)
    text = explain_run(waiting, [], key_limit=limit).text
    assert text == (
        "pending: waiting for its first attempt; waiting for its key user:g (1 running, limit 1)"
    )
    attempts = repo.list_run_attempts(first.id)
    assert "waiting for its key" not in explain_run(running, attempts, key_limit=limit).text
    repo.set_terminal_status(first.id, status="completed", worker_id="w-1")
    freed = repo.get_limit("user:g")
    assert (
        explain_run(waiting, [], key_limit=freed).text == "pending: waiting for its first attempt"
    )
    assert repo.get_limit("user:none") is None


def test_a_parked_run_made_pending_again_by_another_writer_is_never_stuck_parked(
    repo: AgentRunRepository, observer: Conn
) -> None:
    repo.set_limit("k-requeue", 1)
    first = new_run(repo, concurrency_key="k-requeue")
    parked = new_run(repo, concurrency_key="k-requeue")
    assert repo.claim_next(worker_id="w-1", lease_seconds=LEASE).id == first.id  # type: ignore[union-attr]
    repo.request_cancel(parked.id)  # cancelled while parked
    repo.set_terminal_status(first.id, status="completed", worker_id="w-1")
    # A requeue (another module's, or an operator's raw SQL) makes it pending again.
    observer.execute(
        "UPDATE agent_runs SET status = 'pending', finished_at = NULL WHERE id = %s", (parked.id,)
    )
    claimed = repo.claim_next(worker_id="w-2", lease_seconds=LEASE)
    assert claimed is not None and claimed.id == parked.id
