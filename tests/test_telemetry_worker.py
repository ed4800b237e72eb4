"""agent_runs.telemetry in the Worker: attempt spans across the claimer, executing and writer
threads, retries, cancel, lost leases, the reconciler, logs, and metrics held to the attempt
rows and to their attribute allow-list."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, RunStatus, create_pool
from agent_runs.agents import ScriptedAgent
from agent_runs.devtools.pgbouncer import pgbouncer, pgbouncer_binary
from agent_runs.worker import AgentResult, RunContext, Worker
from tests.fix_telemetry import Otel
from tests.helpers import enqueue, new_run, wait_until

LEASE = 1.0
HEARTBEAT = 0.1


def attrs(span: Any) -> dict[str, Any]:
    return dict(span.attributes or {})


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=1, max_size=8) as p:
        yield p


def make_worker(pool: ConnectionPool, agent: Any, otel: Otel, **kwargs: Any) -> Worker:
    kwargs.setdefault("name", "tw")
    kwargs.setdefault("lease_seconds", LEASE)
    kwargs.setdefault("heartbeat_seconds", HEARTBEAT)
    kwargs.setdefault("poll_seconds", 0.05)
    options = {k: kwargs.pop(k) for k in ("span_relationship", "observe_queue") if k in kwargs}
    return Worker(pool, agent, telemetry=otel.telemetry(**options), **kwargs)


def process_spans(otel: Otel, run_id: str) -> list[Any]:
    spans = [s for s in otel.spans("process") if attrs(s)["messaging.message.id"] == run_id]
    return sorted(spans, key=lambda s: attrs(s)["agent_runs.attempt"])


def test_a_retried_run_shows_each_attempt_linked_to_the_request(
    pool: ConnectionPool, repo: AgentRunRepository, otel: Otel
) -> None:
    from opentelemetry.trace import StatusCode

    producer_repo = AgentRunRepository(repo.conn, telemetry=otel.telemetry())
    with otel.tracer.start_as_current_span("POST /chat"):
        run = enqueue(producer_repo, ["retry", "ok"], agent_slug="writer")
    with make_worker(pool, ScriptedAgent(), otel, max_tries=3) as worker:
        while worker.run_once() is not None:
            pass
    (producer,) = otel.spans("create_run")
    first, second = process_spans(otel, run.id)
    for n, span in enumerate((first, second), start=1):
        assert span.parent is None and span.context.trace_id != producer.context.trace_id
        assert [(link.context.trace_id, link.context.span_id) for link in span.links] == [
            (producer.context.trace_id, producer.context.span_id)
        ]
        assert attrs(span)["agent_runs.attempt"] == n
        assert attrs(span)["messaging.client.id"].startswith("tw:")
    assert attrs(first)["agent_runs.outcome"] == "retry_released"
    assert attrs(first)["error.type"] == "retryable_error"
    assert first.status.status_code == StatusCode.ERROR
    assert attrs(second)["agent_runs.outcome"] == "completed"
    assert second.status.status_code == StatusCode.UNSET
    assert "error.type" not in attrs(second)


def test_a_cancelled_run_is_not_an_error(
    pool: ConnectionPool, repo: AgentRunRepository, otel: Otel
) -> None:
    from opentelemetry.trace import StatusCode

    run = enqueue(repo, ["wait_cancel"])
    with make_worker(pool, ScriptedAgent(), otel) as worker:
        done: list[AgentRun | None] = []
        thread = threading.Thread(target=lambda: done.append(worker.run_once()))
        thread.start()
        wait_until(lambda: (r := repo.get_run(run.id)) is not None and r.status == "running")
        repo.request_cancel(run.id)
        thread.join(10)
    (span,) = process_spans(otel, run.id)
    assert attrs(span)["agent_runs.outcome"] == "cancelled"
    assert span.status.status_code == StatusCode.UNSET


def test_a_lost_lease_ends_the_span_as_an_error_and_the_reconciler_records_it(
    pool: ConnectionPool, repo: AgentRunRepository, otel: Otel
) -> None:
    from opentelemetry.trace import StatusCode

    run = enqueue(repo, ["wait_cancel"])

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        while not ctx.wait(5):
            pass
        return AgentResult.completed()

    with make_worker(pool, agent, otel) as worker:
        done: list[AgentRun | None] = []
        thread = threading.Thread(target=lambda: done.append(worker.run_once()))
        thread.start()
        wait_until(lambda: (r := repo.get_run(run.id)) is not None and r.status == "running")
        # Another process's reconciler, clock moved on: the next renewal is refused.
        reconciler = AgentRunRepository(repo.conn, telemetry=otel.telemetry())
        (converged,) = reconciler.reconcile_expired_leases(
            now=datetime.now(UTC) + timedelta(hours=1)
        )
        thread.join(10)
    assert converged.id == run.id and done[0] is not None and done[0].status == "failed"
    (span,) = process_spans(otel, run.id)
    assert span.status.status_code == StatusCode.ERROR
    assert attrs(span)["error.type"] == "worker_lease_expired"
    assert attrs(span)["agent_runs.outcome"] == "lease_expired"
    (reconcile,) = otel.spans("reconcile")
    assert attrs(reconcile)["agent_runs.reconciled.count"] == 1
    assert otel.total("agent_runs.lease.lost") == 1
    assert otel.total("agent_runs.reconciler.converged") == 1
    assert otel.total("agent_runs.worker.active") == 0


def test_run_forever_threads_carry_the_attempt_span_to_the_agent_and_its_logs(
    pool: ConnectionPool, repo: AgentRunRepository, otel: Otel, caplog: pytest.LogCaptureFixture
) -> None:
    seen: dict[str, tuple[int, int, str]] = {}  # run id -> (trace id, span id, thread)

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        with otel.tracer.start_as_current_span("llm call") as inner:
            parent = inner.parent  # type: ignore[attr-defined]
            seen[run.id] = (parent.trace_id, parent.span_id, threading.current_thread().name)
        logging.getLogger("agent_runs.worker").info("agent of %s ran", run.id)
        return AgentResult.completed()

    runs = [enqueue(repo, agent_slug="a") for _ in range(6)]
    stop = threading.Event()
    caplog.set_level(logging.INFO, logger="agent_runs.worker")
    with make_worker(pool, agent, otel) as worker:
        threads = [
            threading.Thread(target=worker.run_forever, args=(stop,), name=f"executing-{n}")
            for n in range(3)
        ]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: len(otel.spans("process")) == len(runs))
        finally:
            stop.set()
            for thread in threads:
                thread.join(10)
    for run in runs:
        (span,) = process_spans(otel, run.id)
        assert seen[run.id][:2] == (span.context.trace_id, span.context.span_id)
        assert attrs(span)["agent_runs.outcome"] == "completed"
        (line,) = [r for r in caplog.records if r.getMessage().startswith(f"agent of {run.id}")]
        assert line.otelTraceID == format(span.context.trace_id, "032x")  # type: ignore[attr-defined]
        assert line.span_id == format(span.context.span_id, "016x")  # type: ignore[attr-defined]
        assert f"span_id={span.context.span_id:016x}" in line.getMessage()
    # Claimed in the claimer thread, executed here: the span travelled between them.
    assert {thread for _, _, thread in seen.values()} <= {t.name for t in threads}


def test_metrics_match_the_attempt_rows_and_stay_within_their_allow_list(
    pool: ConnectionPool, repo: AgentRunRepository, otel: Otel, dsn: str
) -> None:
    from agent_runs.telemetry.metrics import METRIC_ATTRIBUTES

    producer = AgentRunRepository(repo.conn, telemetry=otel.telemetry())
    scripts = [["sleep:0.3"], ["retry", "ok"], ["fail:tool_broke"], ["interrupt"], ["retry"]]
    for n, script in enumerate(scripts * 2):
        enqueue(producer, script, agent_slug=f"agent-{n % 3}")
    stale = enqueue(producer, agent_slug="agent-0")
    assert (
        AgentRunRepository(repo.conn)
        .mark_running(stale.id, worker_id="gone:1", lease_seconds=0.2)
        .acquired
    )
    with make_worker(pool, ScriptedAgent(), otel, max_tries=2) as worker:
        while worker.run_once() is not None:
            pass

        def stale_failed() -> bool:
            worker.maybe_reconcile()
            found = repo.get_run(stale.id)
            return found is not None and found.status == RunStatus.FAILED

        assert wait_until(stale_failed)
    rows = repo.conn.execute(
        "SELECT outcome, count(*) FROM agent_run_attempts GROUP BY outcome"
    ).fetchall()
    points = otel.points()
    by_outcome: Counter[str] = Counter()
    for point in points["agent_runs.attempt.duration"]:
        by_outcome[point.attributes["agent_runs.outcome"]] += point.count
    assert dict(by_outcome) == {outcome: n for outcome, n in rows}
    # Every attempt but the stale one, claimed by a process without telemetry.
    assert otel.total("agent_runs.attempt.started") == sum(n for _, n in rows) - 1
    assert otel.total("agent_runs.run.created") == len(scripts) * 2 + 1
    assert set(points) >= {
        "agent_runs.run.created",
        "agent_runs.attempt.started",
        "agent_runs.attempt.duration",
        "agent_runs.pickup.duration",
        "agent_runs.lease.renewals",
        "agent_runs.reconciler.converged",
        "agent_runs.worker.active",
    }
    for name, found in points.items():
        allowed = METRIC_ATTRIBUTES[name]
        for point in found:
            assert set(point.attributes) <= allowed, (name, dict(point.attributes))
            assert not any(
                isinstance(v, str) and (v.startswith("tw:") or len(v) == 36)
                for v in point.attributes.values()
            ), (name, dict(point.attributes))  # no owner token, no run id


@pytest.mark.skipif(pgbouncer_binary() is None, reason="pgbouncer is not installed")
def test_through_pgbouncer_in_transaction_mode_the_context_still_travels(
    repo: AgentRunRepository, otel: Otel, dsn: str, pg_server: Any
) -> None:
    with pgbouncer(pg_server.admin_url, mode="transaction", pool_size=1) as bouncer:
        pooled = bouncer.url_for(dsn)
        with psycopg.connect(pooled, autocommit=True, prepare_threshold=None) as conn:
            producer = AgentRunRepository(conn, telemetry=otel.telemetry())
            run = enqueue(producer, ["ok"])
            enqueue(producer, ["ok"], agent_slug="waiting", run_type="resume")
        with (
            create_pool(pooled, min_size=1, max_size=4, prepare_threshold=None) as p,
            make_worker(p, ScriptedAgent(), otel, observe_queue=True, agent_slugs=["agent"]) as w,
        ):
            assert w.run_once() is not None
            # The gauges' SET LOCAL statement timeout and read go through the pooler too.
            ages = otel.points()["agent_runs.pending.age"]
            assert [a.attributes["messaging.destination.name"] for a in ages] == ["waiting"], ages
    stored = repo.get_run(run.id)
    assert stored is not None and stored.status == RunStatus.COMPLETED
    assert stored.trace_context == run.trace_context is not None
    (producer_span,) = [
        s for s in otel.spans("create_run") if attrs(s)["messaging.message.id"] == run.id
    ]
    (span,) = process_spans(otel, run.id)
    assert span.links[0].context.span_id == producer_span.context.span_id


def test_an_end_whose_reply_was_lost_is_confirmed_and_its_span_ends_with_its_outcome(
    pool: ConnectionPool, repo: AgentRunRepository, otel: Otel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry.trace import StatusCode

    run = enqueue(repo, ["ok"])
    real = AgentRunRepository.finish_runs

    def finish_then_lose_the_reply(self: AgentRunRepository, *args: Any, **kwargs: Any) -> Any:
        real(AgentRunRepository(self.conn), *args, **kwargs)  # committed, never reported
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(AgentRunRepository, "finish_runs", finish_then_lose_the_reply)
    with make_worker(pool, ScriptedAgent(), otel, lease_seconds=30) as worker:
        ended = worker.run_once()
    assert ended is not None and ended.status == RunStatus.COMPLETED
    (span,) = process_spans(otel, run.id)
    assert attrs(span)["agent_runs.outcome"] == "completed"
    assert span.status.status_code == StatusCode.UNSET
    assert otel.total("agent_runs.lease.lost") == 0


def test_empty_polls_and_heartbeats_leave_no_spans(
    pool: ConnectionPool, repo: AgentRunRepository, otel: Otel
) -> None:
    with make_worker(pool, ScriptedAgent(), otel) as worker:
        assert worker.run_once() is None  # nothing claimable
        assert worker.maybe_reconcile() == []  # nothing to converge
        assert otel.exporter.get_finished_spans() == ()
        run = new_run(
            repo, uid="secret-uid", input_payload={"script": ["sleep:0.5"], "secret": "payload"}
        )
        assert worker.run_once() is not None
    assert otel.total("agent_runs.lease.renewals") >= 2  # heartbeats happened
    (span,) = otel.exporter.get_finished_spans()  # and left no span
    assert attrs(span)["messaging.message.id"] == run.id
    assert not {"secret-uid", "payload"} & {str(v) for v in attrs(span).values()}


def test_a_claim_whose_reply_was_lost_gets_its_span_when_found_by_its_owner_token(
    pool: ConnectionPool, repo: AgentRunRepository, otel: Otel, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = enqueue(repo, ["ok"])
    real = AgentRunRepository.claim_next_attempt

    def claim_then_lose_the_reply(self: AgentRunRepository, **kwargs: Any) -> Any:
        real(AgentRunRepository(self.conn), **kwargs)  # committed, never reported
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(AgentRunRepository, "claim_next_attempt", claim_then_lose_the_reply)
    with make_worker(pool, ScriptedAgent(), otel, lease_seconds=30) as worker:
        ended = worker.run_once()
    assert ended is not None and ended.status == RunStatus.COMPLETED
    (span,) = [s for s in otel.spans("process") if attrs(s)["messaging.message.id"] == run.id]
    assert attrs(span)["agent_runs.outcome"] == "completed"
    assert attrs(span)["messaging.client.id"] == repo.list_run_attempts(run.id)[0].worker_id
