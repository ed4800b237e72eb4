"""The chaos suite's invariant checkers fail on a forged bad state and pass on a good one.

A checker that cannot fail proves nothing, so each one is shown a database holding exactly the
violation it exists to catch. States the schema allows are forged with plain INSERTs (the
trigger only guards UPDATE/DELETE); states the schema forbids (two open attempts, a rewritten
finished attempt) are forged in a scratch copy of the tables, which the checkers read through
`search_path` because they use unqualified table names.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agent_runs import AgentRunRepository, RunStatus
from chaos import invariants as inv
from chaos.faults import Supervisor, WorkerSettings, in_flight_by_worker
from tests.fix_factories import AttemptFactory, RunFactory

Conn = psycopg.Connection[Any]


@pytest.fixture
def forged(conn: Conn) -> Iterator[Conn]:
    """`conn`, reading a scratch copy of both tables (no constraints, no trigger) from now on."""
    conn.execute("CREATE SCHEMA forged")
    conn.execute("CREATE TABLE forged.agent_runs AS TABLE public.agent_runs")
    conn.execute("CREATE TABLE forged.agent_run_attempts AS TABLE public.agent_run_attempts")
    conn.execute("SET search_path TO forged")
    yield conn
    conn.execute("SET search_path TO public")


def _create(repo: AgentRunRepository, name: str, script: list[str] | None = None) -> str:
    run = repo.create_run(
        thread_id=f"thread-{name}",
        agent_slug="scripted",
        uid="chaos",
        request_id=f"req-{name}",
        input_payload={"script": script or ["ok"]},
        run_id=name,
    )
    return run.id


def _good_history(repo: AgentRunRepository, t0: datetime) -> dict[str, str]:
    """Real transitions only: every kind of ending the workers produce. Returns name -> id."""
    s = timedelta(seconds=1)
    ids = {
        name: _create(repo, name)
        for name in ("ok", "retry_ok", "fail", "lost", "cancel_early", "cancel_late")
    }
    assert repo.mark_running(ids["ok"], worker_id="w1g0:a", lease_seconds=3, now=t0).acquired
    repo.set_terminal_status(ids["ok"], status="completed", worker_id="w1g0:a", now=t0 + s)

    repo.mark_running(ids["retry_ok"], worker_id="w1g0:b", lease_seconds=3, now=t0)
    assert repo.release_lease_for_retry(ids["retry_ok"], worker_id="w1g0:b", now=t0 + s)
    repo.mark_running(ids["retry_ok"], worker_id="w2g0:c", lease_seconds=3, now=t0 + 2 * s)
    repo.set_terminal_status(
        ids["retry_ok"], status="completed", worker_id="w2g0:c", now=t0 + 3 * s
    )

    repo.mark_running(ids["fail"], worker_id="w1g0:d", lease_seconds=3, now=t0)
    repo.set_terminal_status(
        ids["fail"],
        status="failed",
        worker_id="w1g0:d",
        error_type="tool_error",
        error_message="scripted failure",
        now=t0 + s,
    )

    repo.mark_running(ids["lost"], worker_id="w3g0:e", lease_seconds=3, now=t0)

    repo.request_cancel(ids["cancel_early"], now=t0)

    repo.mark_running(ids["cancel_late"], worker_id="w2g0:f", lease_seconds=3, now=t0)
    repo.request_cancel(ids["cancel_late"], now=t0 + s)
    repo.set_terminal_status(ids["cancel_late"], status="cancelled", worker_id="w2g0:f", now=t0 + s)

    converged = repo.reconcile_expired_leases(now=t0 + 10 * s)
    assert [r.id for r in converged] == [ids["lost"]]
    return ids


def _run_with_lease(make_run: RunFactory, worker_id: str, t0: datetime) -> str:
    return make_run(
        status="running",
        worker_id=worker_id,
        heartbeat_at=t0,
        lease_expires_at=t0 + timedelta(seconds=3),
        started_at=t0,
    ).id


# -- the good state ---------------------------------------------------------------------------


def test_a_history_written_by_real_transitions_passes_every_checker(
    conn: Conn, repo: AgentRunRepository, t0: datetime
) -> None:
    ids = _good_history(repo, t0)
    state = inv.load_state(conn)
    ledger = inv.FactLedger()
    ledger.observe(inv.snapshot_finished_attempts(conn))
    assert inv.sample_owners(conn).violations == {}
    assert inv.nothing_lost(state, ids.values()) == {}
    assert inv.never_two_owners(state, {}) == {}
    assert inv.facts_never_rewritten(ledger, inv.snapshot_finished_attempts(conn)) == {}
    assert inv.history_explains_state(state) == {}
    assert len(ledger.first_seen) == state.attempt_count == 6
    # "lost" lost its lease: only a worker killed while executing it excuses that.
    scripts = {
        ids["ok"]: ["ok"],
        ids["retry_ok"]: ["retry", "ok"],
        ids["fail"]: ["fail:tool_error"],
        ids["lost"]: ["ok"],
        ids["cancel_early"]: ["wait_cancel"],
        ids["cancel_late"]: ["wait_cancel"],
    }
    assert inv.scripted_expectations(state, scripts, killed={ids["lost"]}) == {}


def test_a_live_lease_is_one_owner_not_two(
    conn: Conn, repo: AgentRunRepository, t0: datetime
) -> None:
    run_id = _create(repo, "live")
    repo.mark_running(run_id, worker_id="w1g0:live", lease_seconds=3)
    sample = inv.sample_owners(conn)
    assert sample.violations == {}
    assert sample.open_attempts == 1
    assert inv.never_two_owners(inv.load_state(conn), {}) == {}


# -- nothing lost -------------------------------------------------------------------------------


def test_nothing_lost_flags_a_missing_run_and_a_non_terminal_one(
    conn: Conn, make_run: RunFactory, t0: datetime
) -> None:
    pending = make_run().id
    running = _run_with_lease(make_run, "w1g0:x", t0)
    done = make_run(status="completed", finished_at=t0).id
    state = inv.load_state(conn)

    bad = inv.nothing_lost(state, [pending, running, done, "run-9999-ok"])

    assert set(bad) == {pending, running, "run-9999-ok"}
    assert "missing" in bad["run-9999-ok"]
    assert "pending" in bad[pending]


# -- never two owners ---------------------------------------------------------------------------


def test_two_open_attempts_are_caught_by_the_sample_and_at_the_end(
    forged: Conn, t0: datetime
) -> None:
    forged.execute(
        "INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, run_type, status,"
        " input_payload, worker_id, heartbeat_at, lease_expires_at, started_at, created_at,"
        " updated_at) VALUES ('two', 'req-two', 't', 'a', 'u', 'chat', 'running', '{}',"
        " 'w1g0:a', %(t)s, %(t)s, %(t)s, %(t)s, %(t)s)",
        {"t": t0},
    )
    for attempt_id, (no, owner) in enumerate([(1, "w1g0:a"), (2, "w2g0:b")], start=1):
        forged.execute(
            "INSERT INTO agent_run_attempts (id, run_id, attempt_no, worker_id, started_at,"
            " created_at, updated_at) VALUES (%s, 'two', %s, %s, %s, %s, %s)",
            (attempt_id, no, owner, t0, t0, t0),
        )

    sample = inv.sample_owners(forged)
    assert set(sample.violations) == {"two"}
    assert "2 open attempts" in sample.violations["two"]
    assert sample.open_attempts == 2
    bad = inv.never_two_owners(inv.load_state(forged), {})
    assert set(bad) == {"two"}
    assert "open" in bad["two"]


def test_a_run_owned_by_someone_else_than_its_open_attempt_is_caught(
    conn: Conn, make_run: RunFactory, make_attempt: AttemptFactory, t0: datetime
) -> None:
    run_id = _run_with_lease(make_run, "w1g0:owner", t0)
    make_attempt(run_id, worker_id="w2g0:intruder", started_at=t0)
    ownerless = make_run(status="pending").id
    make_attempt(ownerless, worker_id="w3g0:ghost", started_at=t0)

    violations = inv.sample_owners(conn).violations

    assert set(violations) == {run_id, ownerless}
    assert "w2g0:intruder" in violations[run_id]
    assert "w3g0:ghost" in violations[ownerless]
    # What a sample saw during the run fails the invariant even if the end looks fine.
    assert set(inv.never_two_owners(inv.load_state(conn), violations)) == {run_id, ownerless}


def test_attempt_numbers_with_a_gap_are_caught(
    conn: Conn, make_run: RunFactory, make_attempt: AttemptFactory, t0: datetime
) -> None:
    run_id = make_run(status="failed", finished_at=t0 + timedelta(seconds=9), started_at=t0).id
    make_attempt(
        run_id, attempt_no=1, started_at=t0, finished_at=t0 + timedelta(seconds=1),
        outcome="retry_released",
    )  # fmt: skip
    make_attempt(
        run_id, attempt_no=3, started_at=t0 + timedelta(seconds=2),
        finished_at=t0 + timedelta(seconds=3), outcome="failed",
    )  # fmt: skip

    bad = inv.never_two_owners(inv.load_state(conn), {})

    assert set(bad) == {run_id}
    assert "[1, 3]" in bad[run_id]


def test_a_finished_attempt_overlapping_a_later_one_is_caught(
    conn: Conn, make_run: RunFactory, make_attempt: AttemptFactory, t0: datetime
) -> None:
    run_id = make_run(status="completed", finished_at=t0 + timedelta(seconds=20), started_at=t0).id
    make_attempt(
        run_id, attempt_no=1, started_at=t0, finished_at=t0 + timedelta(seconds=10),
        outcome="retry_released",
    )  # fmt: skip
    make_attempt(
        run_id, attempt_no=2, started_at=t0 + timedelta(seconds=5),
        finished_at=t0 + timedelta(seconds=20), outcome="completed",
    )  # fmt: skip

    bad = inv.never_two_owners(inv.load_state(conn), {})

    assert set(bad) == {run_id}
    assert "overlaps attempt 2" in bad[run_id]


def test_touching_intervals_are_not_an_overlap(
    conn: Conn, make_run: RunFactory, make_attempt: AttemptFactory, t0: datetime
) -> None:
    """A takeover closes the old attempt at the same instant the new one starts."""
    run_id = make_run(status="completed", finished_at=t0 + timedelta(seconds=20), started_at=t0).id
    make_attempt(
        run_id, attempt_no=1, started_at=t0, finished_at=t0 + timedelta(seconds=10),
        outcome="lease_expired",
    )  # fmt: skip
    make_attempt(
        run_id, attempt_no=2, started_at=t0 + timedelta(seconds=10),
        finished_at=t0 + timedelta(seconds=20), outcome="completed",
    )  # fmt: skip

    assert inv.never_two_owners(inv.load_state(conn), {}) == {}


# -- facts never rewritten ----------------------------------------------------------------------


def test_a_finished_attempt_rewritten_after_it_was_sampled_is_caught(
    conn: Conn, repo: AgentRunRepository, t0: datetime
) -> None:
    ids = _good_history(repo, t0)
    ledger = inv.FactLedger()
    ledger.observe(inv.snapshot_finished_attempts(conn))

    # The trigger refuses this on the real table; forge it in a scratch copy.
    conn.execute("CREATE SCHEMA forged")
    conn.execute("CREATE TABLE forged.agent_run_attempts AS TABLE public.agent_run_attempts")
    conn.execute("SET search_path TO forged, public")
    conn.execute(
        "UPDATE agent_run_attempts SET error_message = 'a nicer story' WHERE run_id = %s",
        (ids["fail"],),
    )
    final = inv.snapshot_finished_attempts(conn)

    bad = inv.facts_never_rewritten(ledger, final)
    assert set(bad) == {ids["fail"]}
    assert "rewritten" in bad[ids["fail"]]
    assert "a nicer story" in bad[ids["fail"]]

    # A later periodic sample sees the change too, even if it were undone before the end.
    ledger.observe(final)
    assert set(ledger.changed) == {ids["fail"]}


def test_a_sampled_fact_that_vanished_is_caught(
    conn: Conn, repo: AgentRunRepository, t0: datetime
) -> None:
    ids = _good_history(repo, t0)
    ledger = inv.FactLedger()
    ledger.observe(inv.snapshot_finished_attempts(conn))
    conn.execute("DELETE FROM agent_runs WHERE id = %s", (ids["retry_ok"],))  # cascades

    bad = inv.facts_never_rewritten(ledger, inv.snapshot_finished_attempts(conn))

    assert set(bad) == {ids["retry_ok"]}
    assert "gone" in bad[ids["retry_ok"]]


def test_an_unchanged_open_attempt_finishing_later_is_not_a_rewrite(
    conn: Conn, repo: AgentRunRepository, t0: datetime
) -> None:
    run_id = _create(repo, "later")
    repo.mark_running(run_id, worker_id="w1g0:z", lease_seconds=3)
    ledger = inv.FactLedger()
    ledger.observe(inv.snapshot_finished_attempts(conn))
    repo.set_terminal_status(run_id, status="completed", worker_id="w1g0:z")
    final = inv.snapshot_finished_attempts(conn)
    ledger.observe(final)

    assert inv.facts_never_rewritten(ledger, final) == {}
    assert ledger.changed == {}


# -- history explains the state -----------------------------------------------------------------


def test_a_status_its_attempts_do_not_explain_is_caught(
    conn: Conn, make_run: RunFactory, make_attempt: AttemptFactory, t0: datetime
) -> None:
    end = t0 + timedelta(seconds=5)
    completed_by_failure = make_run(status="completed", finished_at=end, started_at=t0).id
    make_attempt(
        completed_by_failure, attempt_no=1, started_at=t0, finished_at=end, outcome="failed",
        error_type="tool_error",
    )  # fmt: skip
    completed_without_attempt = make_run(status="completed", finished_at=end).id
    good = make_run(status="completed", finished_at=end, started_at=t0).id
    make_attempt(good, attempt_no=1, started_at=t0, finished_at=end, outcome="completed")

    bad = inv.history_explains_state(inv.load_state(conn))

    assert set(bad) == {completed_by_failure, completed_without_attempt}
    assert all(text.startswith("unexplained") for text in bad.values())


# -- scripted expectations ----------------------------------------------------------------------


def test_an_all_ok_run_that_did_not_complete_without_a_kill_is_caught(
    conn: Conn, repo: AgentRunRepository, t0: datetime
) -> None:
    ids = _good_history(repo, t0)
    state = inv.load_state(conn)
    assert state.runs[ids["lost"]].status == RunStatus.FAILED

    bad = inv.scripted_expectations(state, {ids["lost"]: ["ok"], ids["ok"]: ["ok"]}, killed=())

    assert set(bad) == {ids["lost"]}
    assert "no worker executing it was killed" in bad[ids["lost"]]


def test_a_killed_all_ok_run_must_end_failed_with_a_lease_expired_attempt(
    conn: Conn, repo: AgentRunRepository, t0: datetime
) -> None:
    ids = _good_history(repo, t0)
    state = inv.load_state(conn)
    scripts = {ids["ok"]: ["ok"], ids["fail"]: ["ok", "ok"], ids["lost"]: ["ok"]}

    # "ok" completed and "fail" failed with tool_error: neither fits a killed worker.
    bad = inv.scripted_expectations(state, scripts, killed=set(ids.values()))

    assert set(bad) == {ids["ok"], ids["fail"]}
    assert "killed worker" in bad[ids["ok"]]


def test_every_step_of_the_mix_has_its_own_ending(
    conn: Conn, repo: AgentRunRepository, t0: datetime
) -> None:
    ids = _good_history(repo, t0)
    state = inv.load_state(conn)
    scripts = {
        ids["lost"]: ["hang"],  # hang and crash always end failed / worker_lease_expired
        ids["fail"]: ["fail:quota_exceeded"],  # failed, but with another error type
        ids["retry_ok"]: ["retry", "retry", "ok"],  # completed, but on attempt 2 of 3
        ids["ok"]: ["interrupt"],  # completed instead of interrupted
        ids["cancel_late"]: ["sleep:0.5"],  # cancelled instead of completed
        ids["cancel_early"]: ["sleep:0.1", "ok"],  # not a script the checker judges
    }

    bad = inv.scripted_expectations(state, scripts, killed=())

    assert set(bad) == {ids["fail"], ids["retry_ok"], ids["ok"], ids["cancel_late"]}
    assert "quota_exceeded" in bad[ids["fail"]]
    assert "after 3 attempt(s)" in bad[ids["retry_ok"]]
    assert inv.scripted_expectations(state, {ids["lost"]: ["crash"]}, killed=()) == {}
    assert set(inv.scripted_expectations(state, {ids["ok"]: ["crash"]}, killed=())) == {ids["ok"]}


def test_expectations_follow_the_scripted_agent_and_max_tries() -> None:
    exp = inv.expectation_for
    assert exp(["ok"], max_tries=3) == inv.Expectation(RunStatus.COMPLETED, attempts=1)
    assert exp(["retry", "retry", "ok"], max_tries=3) == inv.Expectation(
        RunStatus.COMPLETED, attempts=3
    )
    assert exp(["retry", "retry", "ok"], max_tries=2) is None  # exhausted first: not judged
    assert exp(["retry"], max_tries=4) == inv.Expectation(
        RunStatus.FAILED, "retries_exhausted", attempts=4
    )
    assert exp(["fail:x"], max_tries=3) == inv.Expectation(RunStatus.FAILED, "x", attempts=1)
    assert exp(["wait_cancel"], max_tries=3) == inv.Expectation(RunStatus.CANCELLED)
    hang = exp(["hang"], max_tries=3)
    assert hang is not None and hang.even_if_killed and hang.error_type == "worker_lease_expired"
    assert exp([], max_tries=3) is None
    assert exp(["retry", "fail:x"], max_tries=3) is None


# -- who was in flight on a dead worker ---------------------------------------------------------


def test_runs_in_flight_on_a_dead_worker_are_its_open_and_later_expired_attempts(
    conn: Conn, make_run: RunFactory, make_attempt: AttemptFactory, t0: datetime
) -> None:
    death = t0 + timedelta(seconds=10)
    open_run = _run_with_lease(make_run, "w1g0:a", t0)
    make_attempt(open_run, worker_id="w1g0:a", started_at=t0)
    expired_after = make_run(status="failed", finished_at=death, started_at=t0).id
    make_attempt(
        expired_after, worker_id="w1g0:b", started_at=t0, finished_at=death + timedelta(seconds=3),
        outcome="lease_expired",
    )  # fmt: skip
    expired_before = make_run(status="failed", finished_at=t0, started_at=t0).id
    make_attempt(
        expired_before, worker_id="w1g0:c", started_at=t0, finished_at=t0 + timedelta(seconds=1),
        outcome="lease_expired",
    )  # fmt: skip
    completed = make_run(status="completed", finished_at=death, started_at=t0).id
    make_attempt(
        completed, worker_id="w1g0:d", started_at=t0, finished_at=death, outcome="completed"
    )
    other_worker = _run_with_lease(make_run, "w1g01:e", t0)
    make_attempt(other_worker, worker_id="w1g01:e", started_at=t0)

    assert inv.runs_in_flight_on(conn, "w1g0", since=death) == sorted([open_run, expired_after])
    assert in_flight_by_worker(conn) == {"w1g0": 1, "w1g01": 1}


def test_the_suite_stops_a_worker_started_a_moment_ago_with_a_clean_exit(
    dsn: str, tmp_path: Path
) -> None:
    """A replacement started just before the suite stops everything: SIGTERM during its imports
    would kill it outright (exit -15), which the suite reports as a failed process. stop_all
    waits for its start line, after which SIGTERM is handled and the worker exits 0."""
    settings = WorkerSettings(
        concurrency=1,
        lease_seconds=4.0,
        heartbeat_seconds=1.0,
        max_tries=3,
        poll_seconds=0.25,
        completion="durable",
        reconcile_every=1.0,
    )
    supervisor = Supervisor(dsn, settings, tmp_path)
    process = supervisor.start_worker(1)
    stopped = supervisor.stop_all(grace=20.0)
    assert stopped == [process]
    assert process.exit_code == 0, process.log_tail()
    assert process.ready()
