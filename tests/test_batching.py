"""Batched claims and completions: claim_next_attempts and finish_runs keep every rule and fact
of claim_next and set_terminal_status, one run at a time under its own lock; the worker's
group commit shares them between threads."""

from __future__ import annotations

import ctypes
import signal
import threading
from datetime import datetime
from typing import Any

import psycopg
import pytest

import agent_runs
from agent_runs import AgentRunRepository, Finish, RunStatus
from agent_runs.validation import MAX_BATCH
from agent_runs.worker.batching import GroupCommit
from tests.helpers import (
    OTHER,
    OWNER,
    Runs,
    assert_refused_before_sql,
    assert_refused_writing_nothing,
    at,
    new_run,
    read_state,
    register_waiter,
    wait_until,
)

Conn = psycopg.Connection[Any]


def _comparable(state: Any) -> tuple[Any, list[Any]]:
    """A run and its attempts without what differs between two equal histories."""
    drop_run = {"id", "request_id", "thread_id", "agent_slug", "created_at", "available_at"}
    drop_attempt = {"id", "run_id"}
    run = {k: v for k, v in state.run.items() if k not in drop_run}
    attempts = [{k: v for k, v in a.items() if k not in drop_attempt} for a in state.attempts]
    return run, attempts


# --- claim_next_attempts -------------------------------------------------------------------------


def test_claims_the_oldest_runs_in_fifo_order_one_per_owner(
    repo: AgentRunRepository, t0: datetime
) -> None:
    runs = [new_run(repo) for _ in range(5)]
    claimed = repo.claim_next_attempts(worker_ids=["a:1", "b:2", "c:3"], lease_seconds=30, now=t0)
    assert [c.run.id for c in claimed] == [r.id for r in runs[:3]]
    assert [c.run.worker_id for c in claimed] == ["a:1", "b:2", "c:3"]
    for c in claimed:
        assert c.attempt_no == 1 and c.run == repo.get_run(c.run.id)
        assert c.run.status == RunStatus.RUNNING
        assert c.run.lease_expires_at == at(t0, 30)
        opened = repo.get_open_attempt(c.run.id)
        assert opened is not None and opened.worker_id == c.run.worker_id
    rest = repo.claim_next_attempts(worker_ids=["d:4", "e:5", "f:6"], lease_seconds=30, now=t0)
    assert [c.run.id for c in rest] == [r.id for r in runs[3:]]
    assert repo.claim_next_attempts(worker_ids=["g:7"], lease_seconds=30, now=t0) == []


def test_batched_claim_writes_the_same_facts_as_claim_next(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    """Released, re-claimed and ownerless-cancel runs: one by one and in a batch, same history."""

    def scenario(slug: str, claim: Any) -> list[Any]:
        released = new_run(repo, agent_slug=slug)
        cancelled = new_run(repo, agent_slug=slug)
        assert claim([OWNER, OTHER], at(t0, 1), slug) == [released.id, cancelled.id]
        assert repo.release_lease_for_retry(released.id, worker_id=OWNER, now=at(t0, 2))
        assert repo.release_lease_for_retry(cancelled.id, worker_id=OTHER, now=at(t0, 2))
        assert repo.request_cancel(cancelled.id, now=at(t0, 3)) is not None
        assert claim(["third:3", "fourth:4"], at(t0, 4), slug) == [released.id, cancelled.id]
        return [_comparable(read_state(observer, r.id)) for r in (released, cancelled)]

    def one_by_one(owners: list[str], now: datetime, slug: str) -> list[str | None]:
        claims = [
            repo.claim_next(worker_id=owner, lease_seconds=30, now=now, agent_slugs=[slug])
            for owner in owners
        ]
        return [None if run is None else run.id for run in claims]

    def batched(owners: list[str], now: datetime, slug: str) -> list[str]:
        claimed = repo.claim_next_attempts(
            worker_ids=owners, lease_seconds=30, now=now, agent_slugs=[slug]
        )
        return [c.run.id for c in claimed]

    singly = scenario("twin-a", one_by_one)
    in_batches = scenario("twin-b", batched)
    assert in_batches == singly
    released, cancelled = in_batches
    assert [a["outcome"] for a in released[1]] == ["retry_released", None]
    assert cancelled[0]["status"] == "cancel_requested"  # owned now: its claimer finishes it
    assert cancelled[0]["worker_id"] == "fourth:4"


def test_a_row_locked_by_another_claimer_is_skipped(
    repo: AgentRunRepository, dsn: str, t0: datetime
) -> None:
    first, second, third = (new_run(repo) for _ in range(3))
    with psycopg.connect(dsn) as other:
        other.execute("SELECT 1 FROM agent_runs WHERE id = %s FOR UPDATE", (first.id,))
        claimed = repo.claim_next_attempts(worker_ids=["a:1", "b:2"], lease_seconds=30, now=t0)
        assert [c.run.id for c in claimed] == [second.id, third.id]
        other.rollback()
    claimed = repo.claim_next_attempts(worker_ids=["c:3", "d:4"], lease_seconds=30, now=t0)
    assert [c.run.id for c in claimed] == [first.id]


def test_concurrent_batched_claimers_take_each_run_exactly_once(
    repo: AgentRunRepository, observer: Conn, dsn: str
) -> None:
    runs = {new_run(repo).id for _ in range(120)}
    taken: list[list[str]] = [[] for _ in range(6)]
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def claimer(n: int) -> None:
        try:
            with agent_runs.connect(dsn) as own:
                mine = AgentRunRepository(own)
                start.wait()
                for round_no in range(100):
                    owners = [f"w{n}:{round_no}:{k}" for k in range(4)]
                    got = mine.claim_next_attempts(worker_ids=owners, lease_seconds=30)
                    if not got:
                        return
                    taken[n].extend(c.run.id for c in got)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    every = [run_id for ids in taken for run_id in ids]
    assert sorted(every) == sorted(runs)  # each run once, none missed
    counts = observer.execute(
        "SELECT count(*), count(*) FILTER (WHERE finished_at IS NULL) FROM agent_run_attempts"
    ).fetchone()
    assert counts == (120, 120)


# --- finish_runs ---------------------------------------------------------------------------------


def test_finish_runs_applies_each_runs_own_rule(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    runs = [new_run(repo) for _ in range(6)]
    owners = [f"w:{n}" for n in range(6)]
    claimed = repo.claim_next_attempts(worker_ids=owners, lease_seconds=30, now=t0)
    assert len(claimed) == 6
    ok, failed, wrong_owner, to_cancel, not_cancelled, cancel_as_completed = (r.id for r in runs)
    assert repo.request_cancel(to_cancel, now=at(t0, 1)) is not None
    assert repo.request_cancel(cancel_as_completed, now=at(t0, 1)) is not None
    before = {r.id: read_state(observer, r.id) for r in runs}
    finished = repo.finish_runs(
        [
            Finish(ok, "w:0", "completed"),
            Finish(failed, "w:1", RunStatus.FAILED, "tool_error", "bad\x00 tool"),
            Finish(wrong_owner, "w:0", "completed"),
            Finish(to_cancel, "w:3", "cancelled"),
            Finish(not_cancelled, "w:4", "cancelled"),  # running may not become cancelled
            Finish(cancel_as_completed, "w:5", "completed"),  # cancel_requested only cancelled
        ],
        now=at(t0, 2),
    )
    assert set(finished) == {ok, failed, to_cancel}
    assert all(stamp == at(t0, 2) for stamp in finished.values())
    for refused in (wrong_owner, not_cancelled, cancel_as_completed):
        assert read_state(observer, refused) == before[refused]
    failed_state = read_state(observer, failed)
    assert failed_state.run is not None
    assert (failed_state.run["status"], failed_state.run["error_message"]) == (
        "failed",
        "bad\ufffd tool",
    )
    (attempt,) = failed_state.attempts
    assert (attempt["outcome"], attempt["error_type"], attempt["error_message"]) == (
        "failed",
        "tool_error",
        "bad\ufffd tool",
    )
    cancelled = read_state(observer, to_cancel)
    assert cancelled.run is not None and cancelled.run["status"] == "cancelled"
    assert cancelled.attempts[0]["outcome"] == "cancelled"


def test_finish_runs_refuses_an_expired_lease_and_a_missing_run(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = new_run(repo)
    assert repo.claim_next_attempts(worker_ids=[OWNER], lease_seconds=30, now=t0)
    before = read_state(observer, run.id)
    finishes = [Finish(run.id, OWNER, "completed"), Finish("no-such-run", OWNER, "completed")]
    assert repo.finish_runs(finishes, now=at(t0, 30)) == {}  # at the expiry it has expired
    assert read_state(observer, run.id) == before


def test_finish_runs_writes_what_set_terminal_status_writes(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    def history(finish: Any) -> Any:
        run = new_run(repo, agent_slug="twin")
        claimed = repo.claim_next(worker_id=OWNER, lease_seconds=30, now=t0, agent_slugs=["twin"])
        assert claimed is not None and claimed.id == run.id
        finish(run.id)
        return _comparable(read_state(observer, run.id))

    long = "x" * 9000
    singly = history(
        lambda run_id: repo.set_terminal_status(
            run_id,
            status="interrupted",
            worker_id=OWNER,
            error_type="timeout",
            error_message=long,
            now=at(t0, 3),
        )
    )
    batched = history(
        lambda run_id: repo.finish_runs(
            [Finish(run_id, OWNER, "interrupted", "timeout", long)], now=at(t0, 3)
        )
    )
    assert batched == singly
    assert "[truncated 808 characters]" in batched[0]["error_message"]


def test_finish_runs_notifies_each_finished_run_someone_waits_for(
    repo: AgentRunRepository, dsn: str, t0: datetime
) -> None:
    runs = [new_run(repo) for _ in range(4)]
    repo.claim_next_attempts(worker_ids=["a:1", "b:2", "c:3", "d:4"], lease_seconds=30)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN agent_runs_finished")
        for run in runs[:3]:
            register_waiter(listener, run.id)
        finished = repo.finish_runs(
            [
                Finish(runs[0].id, "a:1", "completed"),
                Finish(runs[1].id, "b:2", "failed", "e", "m"),
                Finish(runs[2].id, "somebody-else", "completed"),
                Finish(runs[3].id, "d:4", "completed"),  # nobody waits: no notification
            ]
        )
        # Sent by another session (committed after the batch: it arrives last). psycopg before
        # 3.2.2 drops notifications that arrive while the listener runs a statement of its own.
        repo.conn.execute("SELECT pg_notify('agent_runs_finished', 'end')")
        heard: list[str] = []
        for note in listener.notifies(timeout=10.0):
            if note.payload == "end":
                break
            heard.append(note.payload)
    assert set(finished) == {runs[0].id, runs[1].id, runs[3].id}
    assert sorted(heard) == sorted([runs[0].id, runs[1].id])


def test_batched_statements_keep_one_generic_plan(
    repo: AgentRunRepository, conn: Conn, t0: datetime
) -> None:
    """A batch's length must not make each call plan anew (a custom plan per call costs more
    than the statement): after PostgreSQL's five trial plans, the generic plan is used."""
    conn.execute(
        "INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status, finished_at)"
        " SELECT 'old-' || g, 'old-' || g, 'old-' || g, 'agent', 'u', 'failed', now()"
        " FROM generate_series(1, 5000) AS g"
    )
    conn.execute("ANALYZE agent_runs, agent_run_attempts")
    for n in range(12):
        for _ in range(3):
            new_run(repo)
        owners = [f"w{n}:{k}" for k in range(1 + n % 3)]
        claimed = repo.claim_next_attempts(worker_ids=owners, lease_seconds=30)
        repo.renew_leases({c.run.id: c.run.worker_id or "" for c in claimed}, lease_seconds=30)
        repo.finish_runs([Finish(c.run.id, c.run.worker_id or "", "completed") for c in claimed])
    rows = conn.execute("SELECT name, generic_plans FROM pg_prepared_statements").fetchall()
    plans = {
        name: generic
        for name, generic in rows
        if name.startswith(
            (
                "agent_runs_claim_next_attempts_",
                "agent_runs_finish_runs_",
                "agent_runs_renew_leases_",
            )
        )
    }
    assert len(plans) == 3 and all(generic >= 5 for generic in plans.values()), plans


# --- bad input -----------------------------------------------------------------------------------


BAD_BATCHES: list[tuple[str, Any]] = [
    ("worker_ids", lambda r, x: r.claim_next_attempts(worker_ids="w:1", lease_seconds=30)),
    ("worker_ids", lambda r, x: r.claim_next_attempts(worker_ids=[], lease_seconds=30)),
    ("worker_ids", lambda r, x: r.claim_next_attempts(worker_ids=["a", "a"], lease_seconds=30)),
    ("worker_ids", lambda r, x: r.claim_next_attempts(worker_ids=["a\x00"], lease_seconds=30)),
    (
        "worker_ids",
        lambda r, x: r.claim_next_attempts(
            worker_ids=[f"w:{n}" for n in range(MAX_BATCH + 1)], lease_seconds=30
        ),
    ),
    ("lease_seconds", lambda r, x: r.claim_next_attempts(worker_ids=["a"], lease_seconds=0)),
    ("finishes", lambda r, x: r.finish_runs([])),
    ("finishes", lambda r, x: r.finish_runs("completed")),
    ("finishes", lambda r, x: r.finish_runs([(x.running, OWNER)])),
    (
        "finishes",
        lambda r, x: r.finish_runs(
            [Finish(x.running, OWNER, "completed"), Finish(x.running, OWNER, "failed")]
        ),
    ),
    ("status", lambda r, x: r.finish_runs([Finish(x.running, OWNER, "running")])),
    ("finishes run_id", lambda r, x: r.finish_runs([Finish("", OWNER, "completed")])),
    ("finishes worker_id", lambda r, x: r.finish_runs([Finish(x.running, "", "completed")])),
    ("error_type", lambda r, x: r.finish_runs([Finish(x.running, OWNER, "failed", "e" * 65)])),
    ("now", lambda r, x: r.finish_runs([Finish(x.running, OWNER, "completed")], now=1)),
]


@pytest.mark.parametrize(("argument", "call"), BAD_BATCHES)
def test_a_bad_batch_is_refused_by_name_and_writes_nothing(
    repo: AgentRunRepository, observer: Conn, runs: Runs, argument: str, call: Any
) -> None:
    assert_refused_writing_nothing(repo, observer, runs, argument, call)


@pytest.mark.parametrize(("argument", "call"), BAD_BATCHES)
def test_a_bad_batch_is_refused_before_any_sql_runs(dsn: str, argument: str, call: Any) -> None:
    assert_refused_before_sql(dsn, argument, call)


# --- group commit (real threads) ---------------------------------------------------------------


def test_group_commit_batches_waiting_threads_and_answers_each_its_own() -> None:
    entered = threading.Event()
    release = threading.Event()
    batches: list[list[int]] = []

    def write(items: list[int]) -> list[int]:
        batches.append(items)
        if len(batches) == 1:  # hold the first batch until the others are waiting
            entered.set()
            assert release.wait(5)
        return [item * 10 for item in items]

    group = GroupCommit(write, max_batch=3)
    answers: dict[int, int] = {}

    def submit(n: int) -> None:
        answers[n] = group.submit(n)

    first = threading.Thread(target=submit, args=(0,))
    first.start()
    assert entered.wait(5)
    others = [threading.Thread(target=submit, args=(n,)) for n in range(1, 6)]
    for t in others:
        t.start()
    wait_until(lambda: group.waiting == 5, timeout=5)
    release.set()
    for t in [first, *others]:
        t.join(5)
    assert answers == {n: n * 10 for n in range(6)}
    assert batches[0] == [0]
    assert sorted(len(b) for b in batches[1:]) == [2, 3]  # max_batch caps a batch
    assert (group.batches, group.items) == (3, 6)


def test_group_commit_gives_every_thread_of_a_failed_batch_its_exception() -> None:
    def write(items: list[int]) -> list[int]:
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    group: GroupCommit[int, int] = GroupCommit(write, max_batch=10)
    failures: list[BaseException] = []

    def submit(n: int) -> None:
        try:
            group.submit(n)
        except psycopg.OperationalError as exc:
            failures.append(exc)

    threads = [threading.Thread(target=submit, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert len(failures) == 4


def test_an_interrupt_of_the_writer_stays_its_own_and_leaves_the_others_in_doubt() -> None:
    """A KeyboardInterrupt in the thread writing a batch is raised there only; the threads whose
    items were in the batch learn that its outcome is unknown (a database error: in doubt)."""
    entered = threading.Event()
    release = threading.Event()
    batches: list[list[str]] = []

    def write(items: list[str]) -> list[str]:
        batches.append(items)
        entered.set()
        assert release.wait(5)
        raise KeyboardInterrupt

    group: GroupCommit[str, str] = GroupCommit(write, max_batch=10)
    seen: dict[str, BaseException] = {}

    def submit(item: str) -> None:
        try:
            group.submit(item)
        except BaseException as exc:  # what each thread gets is the point
            seen[item] = exc

    threads = {item: threading.Thread(target=submit, args=(item,)) for item in "abc"}
    threads["a"].start()
    assert entered.wait(5)  # a writes its own batch; b and c wait for the next one
    threads["b"].start()
    wait_until(lambda: group.waiting == 1, timeout=5)
    threads["c"].start()
    wait_until(lambda: group.waiting == 2, timeout=5)
    release.set()
    for t in threads.values():
        t.join(5)
    assert batches == [["a"], ["b", "c"]]
    assert isinstance(seen["a"], KeyboardInterrupt)
    # Whichever of b and c woke first wrote the second batch and was interrupted itself.
    kinds = sorted(type(seen[item]).__name__ for item in "bc")
    assert kinds == ["KeyboardInterrupt", "OperationalError"], seen
    in_doubt = next(seen[item] for item in "bc" if not isinstance(seen[item], KeyboardInterrupt))
    assert "outcome unknown" in str(in_doubt)


def _later_submit_answers(group: GroupCommit[str, str]) -> str | None:
    """What a fresh submit gets within 5 s; None when it hangs."""
    answer: list[str] = []
    later = threading.Thread(target=lambda: answer.append(group.submit("later")), daemon=True)
    later.start()
    later.join(5)
    return answer[0] if answer else None


def _held_first_batch() -> tuple[GroupCommit[str, str], threading.Thread, threading.Event]:
    """A group of one-item batches whose first batch ("slow") is being written, held open."""
    entered, release = threading.Event(), threading.Event()

    def write(items: list[str]) -> list[str]:
        if items == ["slow"]:
            entered.set()
            assert release.wait(5)
        return [f"{item}!" for item in items]

    group: GroupCommit[str, str] = GroupCommit(write, max_batch=1)
    writer = threading.Thread(target=group.submit, args=("slow",), daemon=True)
    writer.start()
    assert entered.wait(5)
    return group, writer, release


def test_a_waiter_interrupted_by_ctrl_c_leaves_the_queue_and_later_submits_are_written() -> None:
    group, writer, release = _held_first_batch()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(
        0.2, lambda: signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
    )
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            group.submit("main")  # waits behind "slow" until Ctrl-C reaches the main thread
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    release.set()
    writer.join(5)
    assert group.waiting == 0
    assert _later_submit_answers(group) == "later!"


class _Abort(BaseException):
    """An asynchronous exception, as thread-timeout helpers raise in a thread."""


def test_a_thread_interrupted_as_its_turn_to_write_comes_hands_the_turn_on() -> None:
    group, writer, release = _held_first_batch()
    seen: list[BaseException] = []

    def victim() -> None:
        try:
            group.submit("victim")
        except BaseException as exc:  # what the thread gets is the point
            seen.append(exc)

    thread = threading.Thread(target=victim, daemon=True)
    thread.start()
    wait_until(lambda: group.waiting == 1, timeout=5)
    # Raised in the victim at its next bytecode: when "slow" is written and the turn is its.
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident or 0), ctypes.py_object(_Abort)
    )
    release.set()
    writer.join(5)
    thread.join(5)
    assert [type(exc) for exc in seen] == [_Abort]
    assert _later_submit_answers(group) == "later!"


def test_a_group_commit_refuses_an_empty_batch_size() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        GroupCommit(lambda items: items, max_batch=0)
