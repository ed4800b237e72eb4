"""agent_runs.telemetry on create_runs: a `create_run {agent_slug}` PRODUCER span per item, each
a child of the caller's span, each new run's trace context stored by the batch's one INSERT,
agent_runs.run.created for the runs created, the worker's process spans linked to them; through
both faces."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, ThreadBusy, aio, create_pool
from agent_runs.agents import ScriptedAgent
from agent_runs.worker import Worker
from tests.fix_telemetry import Otel
from tests.helpers import new_run

pytest.importorskip("opentelemetry.sdk")


def attrs(span: Any) -> dict[str, Any]:
    return dict(span.attributes or {})


def item(agent_slug: str, **overrides: Any) -> dict[str, Any]:
    key = uuid.uuid4().hex
    return {
        "thread_id": f"t-{key}",
        "agent_slug": agent_slug,
        "uid": "u",
        "request_id": key,
        "input_payload": {"script": ["ok"]},
    } | overrides


def traceparent(span: Any) -> str:
    context = span.context
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def assert_one_producer_per_item(
    otel: Otel, request_span_id: int, runs: list[AgentRun], slugs: list[str]
) -> list[Any]:
    """The create_run spans, in the items' order: create_run's kind, parent and attributes."""
    from opentelemetry.trace import SpanKind, StatusCode

    producers = otel.spans("create_run")
    assert [s.name for s in producers] == [f"create_run {slug}" for slug in slugs]
    for span, run, slug in zip(producers, runs, slugs, strict=True):
        assert span.kind == SpanKind.PRODUCER
        assert span.parent is not None and span.parent.span_id == request_span_id
        assert span.status.status_code == StatusCode.UNSET
        assert attrs(span) == {
            "messaging.system": "agent_runs",
            "messaging.operation.type": "send",
            "messaging.operation.name": "create_run",
            "messaging.destination.name": slug,
            "messaging.message.id": run.id,
        }
    return producers


def test_each_item_has_its_producer_span_and_each_new_run_its_context(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    existing = new_run(AgentRunRepository(conn), agent_slug="c")  # created without telemetry
    repo = AgentRunRepository(conn, telemetry=otel.telemetry())
    items = [item("a"), item("c", request_id=existing.request_id), item("b")]
    with otel.tracer.start_as_current_span("POST /fan-out") as request:
        runs = repo.create_runs(items)
    assert runs[1].id == existing.id
    producers = assert_one_producer_per_item(
        otel, request.get_span_context().span_id, runs, ["a", "c", "b"]
    )
    assert len({s.context.span_id for s in producers}) == 3
    stored = {r.id: r for r in AgentRunRepository(conn).list_runs()}
    for run, span in ((runs[0], producers[0]), (runs[2], producers[2])):
        assert run.trace_context == {"traceparent": traceparent(span)}
        assert stored[run.id].trace_context == run.trace_context
    assert runs[1].trace_context is None and stored[existing.id].trace_context is None
    assert otel.total("agent_runs.run.created") == 2
    assert otel.total("agent_runs.run.created", **{"messaging.destination.name": "a"}) == 1
    assert otel.total("agent_runs.run.created", **{"messaging.destination.name": "c"}) == 0


def test_the_same_batch_again_counts_nothing_and_keeps_the_first_contexts(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    """Items that name their run_id, sent twice (a retried request): the runs are the same, so
    is the stored context; an item repeating an earlier item's request_id counts once."""
    repo = AgentRunRepository(conn, telemetry=otel.telemetry())
    first_item = item("a", run_id="chosen-1")
    items = [first_item, item("a", run_id="chosen-2"), dict(first_item, run_id="chosen-3")]
    first = repo.create_runs(items)
    assert [r.id for r in first] == ["chosen-1", "chosen-2", "chosen-1"]
    assert otel.total("agent_runs.run.created") == 2
    again = repo.create_runs(items)
    assert again == first
    assert otel.total("agent_runs.run.created") == 2
    spans = otel.spans("create_run")
    assert [attrs(s)["messaging.message.id"] for s in spans] == [r.id for r in first + again]
    assert first[0].trace_context == {"traceparent": traceparent(spans[0])}


def test_a_refused_batch_marks_every_span_an_error_without_the_message(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    from opentelemetry.trace import StatusCode

    repo = AgentRunRepository(conn, telemetry=otel.telemetry())
    busy = new_run(repo, uid="secret-uid", agent_slug="a")
    otel.exporter.clear()
    with pytest.raises(ThreadBusy, match=r"items\[1\]"):
        repo.create_runs([item("a"), item("a", uid="secret-uid", thread_id=busy.thread_id)])
    refused = otel.spans("create_run")
    assert len(refused) == 2
    for span in refused:
        assert span.status.status_code == StatusCode.ERROR
        assert span.status.description is None and not span.events
        assert attrs(span)["error.type"] == "agent_runs.errors.ThreadBusy"
        assert "secret-uid" not in json.dumps(attrs(span))
    assert otel.total("agent_runs.run.created") == 1  # the busy run's create_run alone
    assert len(AgentRunRepository(conn).list_runs()) == 1


def test_without_telemetry_or_a_valid_span_the_contexts_are_null(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    from opentelemetry.trace import NoOpTracerProvider

    no_op = otel.telemetry()
    no_op.tracer = NoOpTracerProvider().get_tracer("agent_runs")
    for repo in (AgentRunRepository(conn), AgentRunRepository(conn, telemetry=no_op)):
        runs = repo.create_runs([item("a"), item("b")])
        assert [r.trace_context for r in runs] == [None, None]
    assert all(r.trace_context is None for r in AgentRunRepository(conn).list_runs())
    assert otel.total("agent_runs.run.created") == 2  # the no-op tracer's repository


@pytest.mark.parametrize("relationship", ["link", "child"])
def test_the_worker_links_each_attempt_to_its_items_producer_span(
    dsn: str, conn: psycopg.Connection[Any], otel: Otel, relationship: str
) -> None:
    producer_repo = AgentRunRepository(conn, telemetry=otel.telemetry())
    with otel.tracer.start_as_current_span("POST /fan-out"):
        runs = producer_repo.create_runs([item("a"), item("b"), item("a")])
    pool: ConnectionPool
    with (
        create_pool(dsn, min_size=1, max_size=8) as pool,
        Worker(
            pool,
            ScriptedAgent(),
            telemetry=otel.telemetry(span_relationship=relationship),
            lease_seconds=5,
            poll_seconds=0.05,
        ) as worker,
    ):
        while worker.run_once() is not None:
            pass
    producers = {attrs(s)["messaging.message.id"]: s for s in otel.spans("create_run")}
    processes = {attrs(s)["messaging.message.id"]: s for s in otel.spans("process")}
    assert set(processes) == set(producers) == {r.id for r in runs}
    for run in runs:
        process, producer = processes[run.id], producers[run.id]
        assert attrs(process)["agent_runs.outcome"] == "completed"
        assert process.name == f"process {run.agent_slug}"
        if relationship == "child":
            assert process.parent is not None
            assert process.parent.span_id == producer.context.span_id
            assert process.context.trace_id == producer.context.trace_id and not process.links
        else:
            assert process.parent is None
            assert [(link.context.trace_id, link.context.span_id) for link in process.links] == [
                (producer.context.trace_id, producer.context.span_id)
            ]


def test_the_async_face_records_the_same_spans_and_contexts(dsn: str, otel: Otel) -> None:
    existing_item = item("c")
    with psycopg.connect(dsn, autocommit=True) as conn:
        AgentRunRepository(conn).create_runs([existing_item])

    async def scenario() -> tuple[int, list[AgentRun]]:
        async with await aio.connect(dsn) as aconn:
            repo = aio.AsyncAgentRunRepository(aconn, telemetry=otel.telemetry())
            with otel.tracer.start_as_current_span("POST /fan-out") as request:
                await asyncio.sleep(0)
                runs = await repo.create_runs([item("a"), existing_item, item("b")])
            return request.get_span_context().span_id, runs

    request_span_id, runs = asyncio.run(scenario())
    producers = assert_one_producer_per_item(otel, request_span_id, runs, ["a", "c", "b"])
    assert runs[0].trace_context == {"traceparent": traceparent(producers[0])}
    assert runs[2].trace_context == {"traceparent": traceparent(producers[2])}
    assert runs[1].trace_context is None
    assert otel.total("agent_runs.run.created") == 2
