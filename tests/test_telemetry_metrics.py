"""agent_runs.telemetry's metrics on the repository: pickups, renewals, active attempts, the
slug cap, and the queue gauges (one grouped query per collection, never on a borrowed
connection)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from agent_runs import AgentRunRepository
from tests.fix_telemetry import Otel
from tests.helpers import new_run


def attrs(point: Any) -> dict[str, Any]:
    return dict(point.attributes or {})


def test_pickup_renewals_and_active_attempts_are_measured(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    repo = AgentRunRepository(conn, telemetry=otel.telemetry())
    run = new_run(repo, agent_slug="a")
    repo.claim_next(worker_id="w:1", lease_seconds=30)
    assert otel.total("agent_runs.worker.active", **{"messaging.destination.name": "a"}) == 1
    assert repo.renew_lease(run.id, worker_id="w:1", lease_seconds=30)
    assert repo.renew_leases({run.id: "w:1"}, lease_seconds=30)
    assert not repo.renew_lease(run.id, worker_id="w:2", lease_seconds=30)
    assert otel.total("agent_runs.lease.renewals") == 2
    (pickup,) = otel.points()["agent_runs.pickup.duration"]
    assert pickup.count == 1 and 0 <= pickup.sum < 60
    repo.set_terminal_status(run.id, status="completed", worker_id="w:1")
    assert otel.total("agent_runs.worker.active") == 0


def test_agent_slugs_beyond_the_cap_count_as_other(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    repo = AgentRunRepository(conn, telemetry=otel.telemetry(max_agent_slugs=2))
    for slug in ("a", "b", "c", "d"):
        new_run(repo, agent_slug=slug)
    labels = {
        attrs(p)["messaging.destination.name"]: p.value
        for p in otel.points()["agent_runs.run.created"]
    }
    assert labels == {"a": 1, "b": 1, "_OTHER": 2}


def test_the_queue_gauges_read_one_grouped_query_per_collection(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    telemetry = otel.telemetry(observe_queue=True)
    repo = AgentRunRepository(conn, telemetry=telemetry)
    for slug in ("a", "a", "b"):
        new_run(repo, agent_slug=slug)
    repo.claim_next(worker_id="w:1", lease_seconds=30, agent_slugs=["b"])
    gauges = telemetry.queue_gauges
    assert gauges is not None
    points = otel.points()
    assert gauges.queries == 1
    counts = {
        (attrs(p)["agent_runs.status"], attrs(p)["messaging.destination.name"]): p.value
        for p in points["agent_runs.run.count"]
    }
    assert counts == {("pending", "a"): 2, ("running", "b"): 1}
    (age,) = points["agent_runs.pending.age"]
    assert attrs(age)["messaging.destination.name"] == "a" and 0 <= age.value < 60


def test_the_queue_gauges_read_a_connection_of_any_row_factory(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    conn.row_factory = dict_row
    telemetry = otel.telemetry(observe_queue=True)
    repo = AgentRunRepository(conn, telemetry=telemetry)
    new_run(repo, agent_slug="a")
    counts = {
        (attrs(p)["agent_runs.status"], attrs(p)["messaging.destination.name"]): p.value
        for p in otel.points()["agent_runs.run.count"]
    }
    assert counts == {("pending", "a"): 1}


def test_without_observe_queue_there_are_no_gauges(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    repo = AgentRunRepository(conn, telemetry=otel.telemetry())
    new_run(repo)
    assert "agent_runs.run.count" not in otel.points()


def test_a_retry_s_pickup_starts_when_the_attempt_before_it_ended(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    repo = AgentRunRepository(conn, telemetry=otel.telemetry())
    run = new_run(repo)
    t0 = run.created_at + timedelta(seconds=100)
    repo.claim_next(worker_id="w:1", lease_seconds=30, now=t0)
    repo.release_lease_for_retry(run.id, worker_id="w:1", now=t0 + timedelta(seconds=10))
    again = repo.claim_next_attempts(
        worker_ids=["w:2"], lease_seconds=30, now=t0 + timedelta(seconds=25)
    )
    assert [c.attempt_no for c in again] == [2]
    (pickup,) = otel.points()["agent_runs.pickup.duration"]
    assert pickup.count == 2
    assert pickup.sum == pytest.approx(100 + 15)


def test_the_gauges_never_borrow_a_pooled_connection_nor_join_an_open_transaction(
    conn: psycopg.Connection[Any], dsn: str, otel: Otel
) -> None:
    from agent_runs import create_pool

    telemetry = otel.telemetry(observe_queue=True)
    with create_pool(dsn, min_size=1, max_size=2) as pool, pool.connection() as lent:
        new_run(AgentRunRepository(lent, telemetry=telemetry))
    assert telemetry.queue_gauges is None  # that connection went back to the pool
    repo = AgentRunRepository(conn, telemetry=telemetry)
    gauges = telemetry.queue_gauges
    assert gauges is not None
    with conn.transaction():  # the application's own transaction on its connection
        assert "agent_runs.run.count" not in otel.points()
    assert gauges.queries == 0
    new_run(repo)
    assert sum(p.value for p in otel.points()["agent_runs.run.count"]) == 2
