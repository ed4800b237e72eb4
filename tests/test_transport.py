"""The one-round-trip transport (agent_runs.transport) against a real server: what goes on the
wire, and that every way it can fail leaves the connection usable and nothing written."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import pq

import agent_runs
from agent_runs import AgentRunRepository, RunStatus
from agent_runs.models import AgentRun
from agent_runs.transport import statement
from agent_runs.transport.pipeline import BEGIN, COMMIT
from agent_runs.transport.statements import statement_name
from tests.helpers import OWNER, new_run, read_state

Conn = psycopg.Connection[Any]
LEASE = 30.0


def claimed(repo: AgentRunRepository, t0: datetime, **kwargs: Any) -> AgentRun:
    run = new_run(repo, **kwargs)
    found = repo.claim_next(worker_id=OWNER, lease_seconds=LEASE, now=t0)
    assert found is not None and found.id == run.id
    return found


def protocol(conn: Conn, call: Any) -> list[tuple[str, str]]:
    """(sender, message type) of every protocol message `call()` exchanged on `conn`."""
    with tempfile.TemporaryFile() as sink:
        conn.pgconn.trace(sink.fileno())
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            call()
        finally:
            conn.pgconn.untrace()
        sink.seek(0)
        lines = sink.read().decode("utf-8", "replace").splitlines()
    messages = []
    for line in lines:
        parts = line.split("\t")
        if len(parts) >= 3 and parts[0] in ("F", "B") and parts[1].isdigit():
            messages.append((parts[0], parts[2]))
    return messages


def test_a_transition_is_its_own_transaction_in_one_round_trip(
    repo: AgentRunRepository, conn: Conn, t0: datetime
) -> None:
    run = claimed(repo, t0)
    repo.renew_lease(run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0)  # all prepared now

    messages = protocol(
        conn, lambda: repo.renew_lease(run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0)
    )
    sent = [m for s, m in messages if s == "F"]
    received = [m for s, m in messages if s == "B"]
    # BEGIN, the statement and COMMIT, bound to prepared statements (nothing parsed), one Sync.
    assert sent == ["Bind", "Describe", "Execute"] * 3 + ["Sync"]
    assert received.count("CommandComplete") == 3
    assert received.count("ReadyForQuery") == 1  # one round trip
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE


def test_the_first_call_of_a_session_prepares_in_the_same_round_trip(
    dsn: str, t0: datetime
) -> None:
    with agent_runs.connect(dsn) as fresh:
        repo = AgentRunRepository(fresh)
        created: list[AgentRun] = []
        messages = protocol(fresh, lambda: created.append(new_run(repo)))
        assert [m for s, m in messages if s == "F"].count("Parse") == 3  # BEGIN, create, COMMIT
        assert [m for s, m in messages if s == "B"].count("ReadyForQuery") == 1
        messages = protocol(
            fresh, lambda: repo.claim_next(worker_id=OWNER, lease_seconds=LEASE, now=t0)
        )
        assert [m for s, m in messages if s == "F"].count("Parse") == 1  # the claim alone
        assert [m for s, m in messages if s == "B"].count("ReadyForQuery") == 1
        assert read_state(fresh, created[0].id).run["status"] == "running"  # type: ignore[index]


def test_a_server_error_rolls_back_and_leaves_the_connection_idle(
    repo: AgentRunRepository, conn: Conn, observer: Conn, t0: datetime
) -> None:
    """An error inside BEGIN … COMMIT (here: a lock wait past lock_timeout) is raised as
    psycopg's class for its SQLSTATE, the transaction is rolled back, and the next call works."""
    run = claimed(repo, t0)
    before = read_state(observer, run.id)
    conn.execute("SET lock_timeout = '100ms'")
    with observer.transaction():
        observer.execute("SELECT 1 FROM agent_runs WHERE id = %s FOR UPDATE", (run.id,))
        with pytest.raises(psycopg.errors.LockNotAvailable):
            repo.renew_lease(
                run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0 + timedelta(seconds=1)
            )
        assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    assert read_state(observer, run.id) == before
    assert repo.renew_lease(run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0)


@pytest.fixture
def refusing_trigger(observer: Conn) -> Iterator[str]:
    """A trigger that fails any renewal to the heartbeat 2000-01-01, naming a constraint; with
    `deferred`, the same check runs at COMMIT instead. (This test database is recycled after.)"""
    observer.execute(
        """
        CREATE FUNCTION test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.heartbeat_at = '2000-01-01T00:00:00Z' THEN
                RAISE EXCEPTION 'refused by the test' USING ERRCODE = 'check_violation',
                    CONSTRAINT = 'test_refuse';
            END IF;
            RETURN NEW;
        END $$
        """
    )
    try:
        yield "2000-01-01T00:00:00Z"
    finally:
        observer.execute("DROP TRIGGER IF EXISTS test_refuse ON agent_runs")
        observer.execute("DROP FUNCTION test_refuse() CASCADE")


@pytest.mark.parametrize("when", ["in the statement", "at COMMIT"])
def test_a_failing_transaction_raises_its_error_and_writes_nothing(
    repo: AgentRunRepository, conn: Conn, observer: Conn, refusing_trigger: str, *, when: str
) -> None:
    t0 = datetime.now(UTC).replace(microsecond=0)
    run = claimed(repo, t0)
    if when == "at COMMIT":
        observer.execute(
            "CREATE CONSTRAINT TRIGGER test_refuse AFTER UPDATE ON agent_runs"
            " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION test_refuse()"
        )
    else:
        observer.execute(
            "CREATE TRIGGER test_refuse BEFORE UPDATE ON agent_runs"
            " FOR EACH ROW EXECUTE FUNCTION test_refuse()"
        )
    before = read_state(observer, run.id)
    refused_at = datetime.fromisoformat(refusing_trigger)
    with pytest.raises(psycopg.errors.CheckViolation) as caught:
        repo.renew_lease(run.id, worker_id=OWNER, lease_seconds=LEASE, now=refused_at)
    assert caught.value.diag.constraint_name == "test_refuse"
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    assert read_state(observer, run.id) == before  # neither the run nor its attempt moved
    assert repo.renew_lease(run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0)


def test_discard_all_is_survived_and_everything_is_prepared_again(
    repo: AgentRunRepository, conn: Conn, t0: datetime
) -> None:
    run = claimed(repo, t0)
    conn.execute("DISCARD ALL")  # a pooler's reset, or a new server session behind it
    assert repo.renew_lease(run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0)
    names = {r[0] for r in conn.execute("SELECT name FROM pg_prepared_statements")}
    assert {BEGIN.name.decode(), statement("renew_lease").name, COMMIT.name.decode()} <= names
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE


def test_a_statement_prepared_by_another_path_is_used_as_it_is(
    dsn: str, t0: datetime, observer: Conn
) -> None:
    with agent_runs.connect(dsn) as fresh:
        repo = AgentRunRepository(fresh)
        run = claimed(repo, t0)
        other = AgentRunRepository(agent_runs.connect(dsn))
        try:
            other.conn.execute(statement("renew_lease").prepare)  # e.g. by hand, to EXPLAIN it
            assert other.renew_lease(
                run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0 + timedelta(seconds=1)
            )
            state = read_state(observer, run.id).run
            assert state is not None
            assert state["lease_expires_at"] == t0 + timedelta(seconds=1 + LEASE)
        finally:
            other.conn.close()


def test_a_killed_session_raises_and_the_connection_reports_closed(
    repo: AgentRunRepository, conn: Conn, observer: Conn, t0: datetime
) -> None:
    run = claimed(repo, t0)
    before = read_state(observer, run.id)
    observer.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
    with pytest.raises(psycopg.OperationalError):
        repo.renew_lease(
            run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0 + timedelta(seconds=1)
        )
    assert conn.closed
    assert read_state(observer, run.id) == before


@pytest.mark.parametrize("timezone", ["America/New_York", "Asia/Kolkata", "UTC"])
def test_timestamps_are_utc_whatever_the_sessions_time_zone(
    repo: AgentRunRepository, conn: Conn, t0: datetime, timezone: str
) -> None:
    conn.execute(f"SET TIME ZONE '{timezone}'")
    run = claimed(repo, t0)
    finished = repo.set_terminal_status(run.id, status="completed", worker_id=OWNER, now=t0)
    with conn.transaction():  # the classic path, inside the caller's transaction
        inside = repo.get_run(run.id)
    assert finished.run is not None
    for value in (run.heartbeat_at, run.created_at, finished.run.finished_at):
        assert value is not None and value.tzinfo is UTC
    assert run.heartbeat_at == t0
    assert inside is not None and inside.finished_at == t0 and inside.finished_at.tzinfo is UTC


def test_text_follows_a_client_encoding_set_mid_session(
    repo: AgentRunRepository, conn: Conn, t0: datetime
) -> None:
    """The one-round-trip path assumes UTF-8; after SET client_encoding the repository runs the
    classic way, where psycopg decodes text in the session's encoding. (psycopg reads JSON as
    UTF-8 whatever the encoding, so the payloads here stay ASCII.)"""
    claimed(repo, t0, thread_id="thé-1", input_payload={"n": 1})
    conn.execute("SET client_encoding TO 'LATIN1'")
    run = new_run(repo, thread_id="thé-2", input_payload={"n": 2})
    found = repo.claim_next(worker_id="worker-b:2", lease_seconds=LEASE, now=t0)
    assert found is not None and found.id == run.id
    assert found.thread_id == "thé-2" and found.input_payload == {"n": 2}
    assert found.heartbeat_at == t0 and found.heartbeat_at.tzinfo is UTC
    conn.execute("SET client_encoding TO 'UTF8'")
    assert repo.renew_lease(run.id, worker_id="worker-b:2", lease_seconds=LEASE, now=t0)


def test_notifications_that_arrive_with_an_answer_are_delivered(
    repo: AgentRunRepository, conn: Conn, observer: Conn, t0: datetime
) -> None:
    run = claimed(repo, t0)
    received: list[str] = []
    conn.add_notify_handler(lambda n: received.append(n.payload))
    conn.execute("LISTEN agent_runs_test")
    observer.execute("NOTIFY agent_runs_test, 'hello'")
    repo.renew_lease(run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0)
    assert received == ["hello"]


def test_threads_sharing_one_connection_take_turns(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    """One repository, one connection, four threads: every call is whole and answered."""
    runs = [claimed(repo, t0) for _ in range(4)]
    errors: list[BaseException] = []
    statuses: list[RunStatus] = []
    start = threading.Barrier(len(runs))

    def heartbeat(run: AgentRun) -> None:
        try:
            start.wait(timeout=30)
            for i in range(50):
                assert repo.renew_lease(
                    run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0 + timedelta(seconds=i)
                )
            final = repo.set_terminal_status(run.id, status="completed", worker_id=OWNER, now=t0)
            assert final.run is not None
            statuses.append(final.run.status)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=heartbeat, args=(run,)) for run in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert statuses == [RunStatus.COMPLETED] * 4
    for run in runs:
        state = read_state(observer, run.id)
        assert state.run is not None and state.run["status"] == "completed"
        assert [a["outcome"] for a in state.attempts] == ["completed"]


@pytest.fixture
def pipelined(conn: Conn) -> Iterator[Conn]:
    with conn.pipeline():
        yield conn


def test_inside_the_callers_own_pipeline_it_runs_the_classic_way(
    repo: AgentRunRepository, pipelined: Conn, observer: Conn, t0: datetime
) -> None:
    run = claimed(repo, t0)
    assert repo.renew_lease(run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0)
    state = read_state(observer, run.id).run
    assert state is not None and state["lease_expires_at"] == t0 + timedelta(seconds=LEASE)


def test_prepare_threshold_none_means_no_named_statements_and_still_one_round_trip(
    dsn: str, t0: datetime
) -> None:
    with agent_runs.connect(dsn, prepare_threshold=None) as fresh:
        repo = AgentRunRepository(fresh)
        run = claimed(repo, t0)
        messages = protocol(
            fresh, lambda: repo.renew_lease(run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0)
        )
        assert [m for s, m in messages if s == "F"] == [
            "Parse",
            "Bind",
            "Describe",
            "Execute",
        ] * 3 + ["Sync"]
        assert [m for s, m in messages if s == "B"].count("ReadyForQuery") == 1
        with fresh.transaction():  # the classic path does not prepare either
            for _ in range(8):
                repo.get_run(run.id)
        assert fresh.execute("SELECT name FROM pg_prepared_statements").fetchall() == []


def test_statement_names_carry_a_digest_of_their_sql() -> None:
    name = statement("get_run").name
    assert name.startswith("agent_runs_get_run_") and len(name) <= 63
    assert statement_name("get_run", statement("get_run").sql + " ") != name
    assert statement_name("get_run", statement("get_run").sql) == name


def test_a_pooler_like_session_switches_to_unnamed_statements(
    repo: AgentRunRepository, conn: Conn, observer: Conn, t0: datetime
) -> None:
    """Prepared statements vanishing twice (a pooler's other server sessions): every call still
    succeeds, and the connection stops naming statements (psycopg's included)."""
    run = claimed(repo, t0)
    for i in range(2):
        conn.execute("DEALLOCATE ALL")
        assert repo.renew_lease(
            run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0 + timedelta(seconds=i)
        )
    assert conn.prepare_threshold is None
    conn.execute("DEALLOCATE ALL")
    assert repo.renew_lease(run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0)
    assert conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone() == (0,)
    state = read_state(observer, run.id).run
    assert state is not None and state["lease_expires_at"] == t0 + timedelta(seconds=LEASE)
