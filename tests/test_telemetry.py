"""agent_runs.telemetry on the repository: the producer span, the stored trace context (write
once), attempt spans from claim to committed end, the reconciler, metrics, telemetry off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import errors as pg_errors

from agent_runs import AgentRunRepository, Finish, InvalidArgument, RunStatus, ThreadBusy
from tests.fix_telemetry import Otel
from tests.helpers import new_run

GOOD = '"traceparent": "00-' + "1" * 32 + "-" + "2" * 16 + '-01"'


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def attrs(span: Any) -> dict[str, Any]:
    return dict(span.attributes or {})


def _ids(links: Any) -> list[tuple[int, int]]:
    return [(link.context.trace_id, link.context.span_id) for link in links]


def _id(span: Any) -> tuple[int, int]:
    return (span.context.trace_id, span.context.span_id)


def test_create_run_stores_the_context_of_its_producer_span_a_child_of_the_callers(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    from opentelemetry.trace import SpanKind

    repo = AgentRunRepository(conn, telemetry=otel.telemetry())
    with otel.tracer.start_as_current_span("POST /chat") as request:
        run = new_run(repo, agent_slug="writer")
    (producer,) = otel.spans("create_run")
    assert producer.name == "create_run writer"
    assert producer.kind == SpanKind.PRODUCER
    assert producer.parent is not None
    assert producer.parent.span_id == request.get_span_context().span_id
    assert producer.context.trace_id == request.get_span_context().trace_id
    assert dict(producer.attributes or {}) == {
        "messaging.system": "agent_runs",
        "messaging.operation.type": "send",
        "messaging.operation.name": "create_run",
        "messaging.destination.name": "writer",
        "messaging.message.id": run.id,
    }
    assert run.trace_context is not None
    stored = AgentRunRepository(conn).get_run(run.id)
    assert stored is not None and stored.trace_context == run.trace_context
    assert run.trace_context["traceparent"] == (
        f"00-{_hex(producer.context.trace_id, 32)}-{_hex(producer.context.span_id, 16)}-"
        f"{_hex(producer.context.trace_flags, 2)}"
    )
    assert otel.total("agent_runs.run.created", **{"messaging.destination.name": "writer"}) == 1


def test_without_telemetry_or_a_valid_span_the_context_is_null(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    from opentelemetry.trace import NoOpTracerProvider

    off = new_run(AgentRunRepository(conn))
    assert off.trace_context is None
    no_op = otel.telemetry()
    no_op.tracer = NoOpTracerProvider().get_tracer("agent_runs")
    invalid = new_run(AgentRunRepository(conn, telemetry=no_op))
    assert invalid.trace_context is None
    read = AgentRunRepository(conn).get_run(invalid.id)
    assert read is not None and read.trace_context is None


def test_the_same_request_again_returns_the_run_and_keeps_its_first_context(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    repo = AgentRunRepository(conn, telemetry=otel.telemetry())
    first = new_run(repo, request_id="req-1", thread_id="t-1")
    again = new_run(repo, request_id="req-1", thread_id="t-1")
    assert again.id == first.id and again.trace_context == first.trace_context
    assert len(otel.spans("create_run")) == 2
    assert [attrs(s)["messaging.message.id"] for s in otel.spans("create_run")] == [
        first.id,
        first.id,
    ]
    assert otel.total("agent_runs.run.created") == 1  # one row was created


def test_a_refused_create_is_an_error_span_without_the_message(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    from opentelemetry.trace import StatusCode

    repo = AgentRunRepository(conn, telemetry=otel.telemetry())
    new_run(repo, thread_id="t", uid="secret-uid")
    with pytest.raises(ThreadBusy):
        new_run(repo, thread_id="t", uid="secret-uid")
    refused = otel.spans("create_run")[-1]
    assert refused.status.status_code == StatusCode.ERROR
    assert refused.status.description is None
    assert attrs(refused)["error.type"] == "agent_runs.errors.ThreadBusy"
    assert not refused.events  # no exception event: its message names the uid
    assert "secret-uid" not in json.dumps(dict(refused.attributes or {}))


def test_the_trace_context_is_written_once(
    conn: psycopg.Connection[Any], observer: psycopg.Connection[Any], otel: Otel
) -> None:
    run = new_run(AgentRunRepository(conn, telemetry=otel.telemetry()))
    for value in ("{" + GOOD + "}", None):
        with pytest.raises(pg_errors.RestrictViolation, match=f"run id={run.id}"):
            observer.execute(
                "UPDATE agent_runs SET trace_context = %s WHERE id = %s", (value, run.id)
            )
    blank = new_run(AgentRunRepository(conn))
    with pytest.raises(pg_errors.RestrictViolation):
        observer.execute(
            "UPDATE agent_runs SET trace_context = %s WHERE id = %s",
            ("{" + GOOD + "}", blank.id),
        )
    # Updates that do not name it (claims, renewals) go on.
    observer.execute("UPDATE agent_runs SET updated_at = now() WHERE id = %s", (run.id,))


@pytest.mark.parametrize(
    "value",
    [
        "[]",
        '{"traceparent": 1}',
        '{"traceparent": "not-a-traceparent"}',
        '{"tracestate": "a=b"}',
        "{" + GOOD + ', "uid": "x"}',
        "{" + GOOD + ', "tracestate": 5}',
    ],
)
def test_a_trace_context_of_another_shape_is_refused(
    observer: psycopg.Connection[Any], value: str
) -> None:
    with pytest.raises(pg_errors.CheckViolation, match="trace_context"):
        observer.execute(
            "INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, trace_context)"
            " VALUES ('r', 'q', 't', 'a', 'u', %s)",
            (value,),
        )


def test_a_claim_starts_a_consumer_span_in_a_new_trace_linked_to_the_producer(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    from opentelemetry.trace import SpanKind, StatusCode

    repo = AgentRunRepository(conn, telemetry=otel.telemetry())
    with otel.tracer.start_as_current_span("request"):
        run = new_run(repo, agent_slug="writer")
    with otel.tracer.start_as_current_span("claimer loop"):  # not a parent of the attempt
        claimed = repo.claim_next(worker_id="w:1", lease_seconds=30)
    assert claimed is not None and not otel.spans("process")  # open until its end
    repo.set_terminal_status(run.id, status="completed", worker_id="w:1")
    (producer,) = otel.spans("create_run")
    (process,) = otel.spans("process")
    assert process.name == "process writer" and process.kind == SpanKind.CONSUMER
    assert process.parent is None
    assert process.context.trace_id != producer.context.trace_id
    assert _ids(process.links) == [_id(producer)]
    assert dict(process.attributes or {}) == {
        "messaging.system": "agent_runs",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "writer",
        "messaging.message.id": run.id,
        "messaging.client.id": "w:1",
        "agent_runs.attempt": 1,
        "agent_runs.outcome": "completed",
    }
    assert process.status.status_code == StatusCode.UNSET


@pytest.mark.parametrize("relationship", ["child", "none"])
def test_span_relationship_child_or_none(
    conn: psycopg.Connection[Any], otel: Otel, relationship: str
) -> None:
    from opentelemetry.trace import StatusCode

    repo = AgentRunRepository(conn, telemetry=otel.telemetry(span_relationship=relationship))
    run = new_run(repo)
    for attempt in (1, 2):
        repo.claim_next(worker_id=f"w:{attempt}", lease_seconds=30)
        if attempt == 1:
            repo.release_lease_for_retry(run.id, worker_id="w:1", error_type="retryable_error")
    repo.set_terminal_status(run.id, status="completed", worker_id="w:2")
    (producer,) = otel.spans("create_run")
    first, second = otel.spans("process")
    assert attrs(first)["agent_runs.outcome"] == "retry_released"
    assert attrs(first)["error.type"] == "retryable_error"
    assert first.status.status_code == StatusCode.ERROR
    assert attrs(second)["agent_runs.attempt"] == 2
    assert second.parent is None
    if relationship == "child":
        assert first.parent is not None and first.parent.span_id == producer.context.span_id
        assert first.context.trace_id == producer.context.trace_id and not first.links
        assert _ids(second.links) == [_id(producer)]  # retries: links
    else:
        assert first.parent is None and not first.links and not second.links


def test_span_relationship_is_checked() -> None:
    from agent_runs.telemetry import Telemetry

    with pytest.raises(InvalidArgument, match="span_relationship"):
        Telemetry(span_relationship="sibling")


def test_finish_runs_ends_each_attempt_span_with_its_outcome(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    from opentelemetry.trace import StatusCode

    repo = AgentRunRepository(conn, telemetry=otel.telemetry())
    runs = [new_run(repo, agent_slug="a") for _ in range(3)]
    claimed = repo.claim_next_attempts(worker_ids=["w:1", "w:2", "w:3"], lease_seconds=30)
    assert [c.attempt_no for c in claimed] == [1, 1, 1]
    repo.request_cancel(runs[2].id)
    repo.finish_runs(
        [
            Finish(runs[0].id, "w:1", "completed"),
            Finish(runs[1].id, "w:2", "failed", "tool_crashed", "the tool said: uid=secret"),
            Finish(runs[2].id, "w:3", "cancelled"),
        ]
    )
    ended = {attrs(s)["messaging.message.id"]: s for s in otel.spans("process")}
    assert ended[runs[0].id].status.status_code == StatusCode.UNSET
    assert ended[runs[1].id].status.status_code == StatusCode.ERROR
    assert attrs(ended[runs[1].id])["error.type"] == "tool_crashed"
    assert attrs(ended[runs[2].id])["agent_runs.outcome"] == "cancelled"
    assert ended[runs[2].id].status.status_code == StatusCode.UNSET  # cancel is not an error
    assert "error.type" not in attrs(ended[runs[2].id])
    for span in ended.values():
        assert "secret" not in json.dumps(dict(span.attributes or {}))
    # An agent's own error_type labels the span and the metric (capped as agent slugs are).
    failed = otel.total(
        "agent_runs.attempt.duration",
        **{"agent_runs.outcome": "failed", "error.type": "tool_crashed"},
    )
    assert failed == 1


def test_the_reconciler_span_converges_lost_attempts_and_their_durations(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    from opentelemetry.trace import SpanKind

    repo = AgentRunRepository(conn, telemetry=otel.telemetry())
    assert repo.reconcile_expired_leases() == []
    assert not otel.spans("reconcile")  # a pass that converged nothing leaves no span
    runs = [new_run(repo, agent_slug="slow") for _ in range(2)]
    other = AgentRunRepository(conn)  # another worker process, without telemetry
    for n in (1, 2):
        other.claim_next(worker_id=f"w:{n}", lease_seconds=1)
    later = datetime.now(UTC) + timedelta(hours=1)
    converged = repo.reconcile_expired_leases(now=later)
    assert sorted(r.id for r in converged) == sorted(r.id for r in runs)
    (span,) = otel.spans("reconcile")
    assert span.name == "reconcile agent_runs" and span.kind == SpanKind.INTERNAL
    assert attrs(span)["agent_runs.reconciled.count"] == 2
    producers = {s.context.span_id for s in otel.spans("create_run")}
    assert {link.context.span_id for link in span.links} == producers
    assert otel.total("agent_runs.reconciler.converged") == 2
    lost = otel.total(
        "agent_runs.attempt.duration",
        **{"agent_runs.outcome": "lease_expired", "error.type": "worker_lease_expired"},
    )
    assert lost == 2


def test_a_refused_end_leaves_the_span_open_and_a_lost_lease_ends_it_as_an_error(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    from opentelemetry.trace import StatusCode

    telemetry = otel.telemetry()
    repo = AgentRunRepository(conn, telemetry=telemetry)
    run = new_run(repo)
    repo.claim_next(worker_id="w:1", lease_seconds=30)
    assert not repo.set_terminal_status(run.id, status="completed", worker_id="w:other").changed
    assert not otel.spans("process")
    telemetry.released("w:1")  # the worker let go without a committed end
    (span,) = otel.spans("process")
    assert span.status.status_code == StatusCode.ERROR
    assert attrs(span)["error.type"] == "worker_lease_expired"
    assert attrs(span)["agent_runs.outcome"] == "lease_expired"
    assert otel.total("agent_runs.lease.lost") == 1
    assert otel.total("agent_runs.worker.active") == 0


def test_telemetry_off_never_imports_opentelemetry(dsn: str) -> None:
    """A whole life of runs, worker included, without telemetry: opentelemetry stays unloaded."""
    script = textwrap.dedent(
        """
        import sys, agent_runs
        from agent_runs.worker import Worker
        from agent_runs.agents import ScriptedAgent
        conn = agent_runs.connect(sys.argv[1])
        repo = agent_runs.AgentRunRepository(conn)
        for n, script in enumerate((["ok"], ["retry", "ok"], ["fail:boom"])):
            repo.create_run(thread_id=f"t{n}", agent_slug="a", uid="u", request_id=f"r{n}",
                            input_payload={"script": script})
        repo.create_runs([  # one new run, one request seen before
            {"thread_id": "tb", "agent_slug": "a", "uid": "u", "request_id": "rb",
             "input_payload": {"script": ["ok"]}},
            {"thread_id": "t0", "agent_slug": "a", "uid": "u", "request_id": "r0"}])
        with agent_runs.create_pool(sys.argv[1], min_size=1, max_size=4) as pool:
            with Worker(pool, ScriptedAgent(), lease_seconds=5, max_tries=2) as worker:
                while worker.run_once() is not None:
                    pass
        repo.reconcile_expired_leases()
        from agent_runs.cli import main  # the CLI without --otel
        assert main(["enqueue", "--dsn", sys.argv[1], "--thread", "t", "--agent-slug", "a",
                     "--uid", "u", "--payload", '{"script": ["ok"]}']) == 0
        assert main(["reconcile", "--dsn", sys.argv[1]]) == 0
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
        print(loaded)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", script, dsn],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    with psycopg.connect(dsn, autocommit=True) as check:
        runs = AgentRunRepository(check).list_runs()
    assert sorted(r.status for r in runs) == sorted(
        [RunStatus.COMPLETED] * 3 + [RunStatus.FAILED, RunStatus.PENDING]
    )
