"""Telemetry through the asyncio face: AsyncAgentRunRepository(aconn, telemetry=t) records what
the sync face records, from the same plans (the producer span a child of the caller's current
span across awaits, the attempt's consumer span linked to it, its end)."""

from __future__ import annotations

import asyncio

import pytest

from agent_runs import aio
from tests.fix_telemetry import Otel

pytest.importorskip("opentelemetry.sdk")


def test_the_async_face_records_the_create_claim_and_end_spans(dsn: str, otel: Otel) -> None:
    from opentelemetry.trace import SpanKind

    async def scenario() -> tuple[str, str | None]:
        async with await aio.connect(dsn) as aconn:
            repo = aio.AsyncAgentRunRepository(aconn, telemetry=otel.telemetry())
            with otel.tracer.start_as_current_span("POST /chat") as request:
                run = await repo.create_run(
                    thread_id="t", agent_slug="writer", uid="u", request_id="r"
                )
            claimed = await repo.claim_next(worker_id="w:1", lease_seconds=30)
            assert claimed is not None and claimed.id == run.id
            ended = await repo.set_terminal_status(run.id, status="completed", worker_id="w:1")
            assert ended.changed
            traceparent = None if run.trace_context is None else run.trace_context["traceparent"]
            return f"{request.get_span_context().span_id:016x}", traceparent

    request_span, traceparent = asyncio.run(scenario())
    (producer,) = otel.spans("create_run")
    assert producer.name == "create_run writer" and producer.kind == SpanKind.PRODUCER
    assert producer.parent is not None and f"{producer.parent.span_id:016x}" == request_span
    assert traceparent is not None and f"{producer.context.span_id:016x}" in traceparent
    (process,) = otel.spans("process")
    assert process.kind == SpanKind.CONSUMER
    assert [link.context.span_id for link in process.links] == [producer.context.span_id]
    assert dict(process.attributes or {})["agent_runs.outcome"] == "completed"
    assert otel.total("agent_runs.run.created", **{"messaging.destination.name": "writer"}) == 1
