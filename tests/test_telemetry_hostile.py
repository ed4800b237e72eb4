"""An OpenTelemetry SDK that misbehaves (a processor raising in on_start or on_end, a sampler
raising or answering garbage, an id generator of garbage, a synchronous exporter that blocks)
never costs a fact, a caller's answer or a lease; a caller's trace context is stored cut as
W3C allows; agents' own error types label the attempt metric, capped."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, Finish, RunStatus, aio, create_pool
from agent_runs.telemetry import Telemetry
from agent_runs.telemetry.trace_context import cut_tracestate, storable
from agent_runs.worker import AgentResult, RunContext, Worker
from tests.fix_telemetry import Otel
from tests.helpers import enqueue, new_run, wait_until

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


class Blocking:
    """A span processor that blocks `seconds` in on_start of spans whose name starts with
    `prefix` (a processor that calls out to something slow)."""

    def __init__(self, seconds: float, prefix: str) -> None:
        self.seconds = seconds
        self.prefix = prefix

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if span.name.startswith(self.prefix):
            time.sleep(self.seconds)

    def _on_ending(self, span: Any) -> None:
        pass

    def on_end(self, span: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class Raising:
    """A span processor that raises in on_start and/or on_end for spans whose name starts with
    `prefix` (a buggy processor of the application)."""

    def __init__(self, *, on_start: bool = False, on_end: bool = False, prefix: str = "") -> None:
        self.raise_on_start = on_start
        self.raise_on_end = on_end
        self.prefix = prefix
        self.calls = 0

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if self.raise_on_start and span.name.startswith(self.prefix):
            self.calls += 1
            raise RuntimeError("processor bug in on_start")

    def _on_ending(self, span: Any) -> None:
        pass

    def on_end(self, span: Any) -> None:
        if self.raise_on_end and span.name.startswith(self.prefix):
            self.calls += 1
            raise RuntimeError("processor bug in on_end")

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def blocking_exporter(seconds: float) -> Any:
    """A synchronous exporter that blocks for `seconds` per export (a collector that is down);
    `.exported` counts the spans it took."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Blocking(SpanExporter):
        exported = 0

        def export(self, spans: Any) -> SpanExportResult:
            time.sleep(seconds)
            self.exported += len(spans)
            return SpanExportResult.SUCCESS

    return Blocking()


def telemetry_with(*processors: Any, **provider: Any) -> Telemetry:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    tracer_provider = TracerProvider(**provider)
    for processor in processors:
        tracer_provider.add_span_processor(processor)
    return Telemetry(tracer_provider=tracer_provider, meter_provider=MeterProvider())


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=1, max_size=8) as p:
        yield p


# -- the repository: every commit point answers what committed ---------------------------------


def _garbage_sampler() -> Any:
    from opentelemetry.sdk.trace.sampling import Sampler

    class Garbage(Sampler):
        def should_sample(self, *args: Any, **kwargs: Any) -> Any:
            return "not a sampling result"

        def get_description(self) -> str:
            return "garbage"

    return Garbage()


def _huge_ids() -> Any:
    from opentelemetry.sdk.trace.id_generator import IdGenerator

    class Huge(IdGenerator):
        def generate_span_id(self) -> int:
            return 2**70  # 18 hex digits: not a W3C span id

        def generate_trace_id(self) -> int:
            return 2**130

    return Huge()


HOSTILE = {
    "on_start raises": lambda: telemetry_with(Raising(on_start=True)),
    "on_end raises": lambda: telemetry_with(Raising(on_end=True)),
    "both raise": lambda: telemetry_with(Raising(on_start=True, on_end=True)),
    "sampler answers garbage": lambda: telemetry_with(sampler=_garbage_sampler()),
    "ids of garbage": lambda: telemetry_with(id_generator=_huge_ids()),
}


@pytest.mark.parametrize("hostile", list(HOSTILE))
def test_every_commit_point_answers_what_it_committed_whatever_the_sdk_does(
    conn: psycopg.Connection[Any], hostile: str
) -> None:
    repo = AgentRunRepository(conn, telemetry=HOSTILE[hostile]())
    plain = AgentRunRepository(conn)
    run = new_run(repo, agent_slug="a")
    assert plain.get_run(run.id) == run
    batch = repo.create_runs([_item("b1"), _item("b2")])
    assert [plain.get_run(r.id) for r in batch] == batch
    assert all(r.trace_context is None or len(r.trace_context["traceparent"]) == 55 for r in batch)

    claimed = repo.claim_next(worker_id="w:1", lease_seconds=30)
    assert claimed is not None and claimed.status == RunStatus.RUNNING
    assert repo.renew_lease(claimed.id, worker_id="w:1", lease_seconds=30)
    assert repo.release_lease_for_retry(claimed.id, worker_id="w:1")
    many = repo.claim_next_attempts(worker_ids=["w:2", "w:3", "w:4"], lease_seconds=30)
    assert len(many) == 3  # the released run again (attempt 2) and the batch's two
    assert {c.attempt_no for c in many} == {1, 2}
    finished = repo.finish_runs([Finish(many[0].run.id, "w:2", "completed")])
    assert set(finished) == {many[0].run.id}
    ends, next_claims = repo.finish_runs_and_claim(
        [Finish(many[1].run.id, "w:3", "failed", "tool_error", "boom")],
        worker_ids=["w:5"],
        lease_seconds=30,
    )
    assert set(ends) == {many[1].run.id} and next_claims == []
    transition = repo.set_terminal_status(
        many[2].run.id, status="failed", worker_id="w:4", error_type="x"
    )
    assert transition.changed
    lost = new_run(repo, agent_slug="a")
    assert repo.mark_running(lost.id, worker_id="w:6", lease_seconds=0.001).acquired
    time.sleep(0.01)
    converged = repo.reconcile_expired_leases()
    assert [r.id for r in converged] == [lost.id]
    assert plain.get_run(lost.id).status == RunStatus.FAILED  # type: ignore[union-attr]


def test_the_async_face_answers_what_it_committed_whatever_the_sdk_does(dsn: str) -> None:
    async def scenario() -> tuple[AgentRun, AgentRun | None, bool]:
        async with await aio.connect(dsn) as aconn:
            telemetry = telemetry_with(Raising(on_start=True, on_end=True))
            repo = aio.AsyncAgentRunRepository(aconn, telemetry=telemetry)
            run = await repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r")
            claimed = await repo.claim_next(worker_id="w:1", lease_seconds=30)
            ended = await repo.set_terminal_status(run.id, status="completed", worker_id="w:1")
            return run, claimed, ended.changed

    run, claimed, changed = asyncio.run(scenario())
    assert run.trace_context is None  # no span could start: nothing to store
    assert claimed is not None and claimed.id == run.id and changed


def _item(key: str) -> dict[str, Any]:
    return {"thread_id": key, "agent_slug": "a", "uid": "u", "request_id": f"req-{key}"}


# -- the worker: every claim tracked, every lease renewed ---------------------------------------


def _completed(run: AgentRun, ctx: RunContext) -> AgentResult:
    return AgentResult.completed()


def test_run_once_executes_its_claim_when_the_process_span_cannot_start(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    run = new_run(repo, agent_slug="a")
    telemetry = telemetry_with(Raising(on_start=True, prefix="process"))
    with Worker(pool, _completed, name="hostile", lease_seconds=2, telemetry=telemetry) as worker:
        ended = worker.run_once()
    assert ended is not None and ended.id == run.id
    assert ended.status == RunStatus.COMPLETED
    assert repo.get_run(run.id).status == RunStatus.COMPLETED  # type: ignore[union-attr]


def test_a_claim_is_renewed_while_a_processor_blocks_in_on_start(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    run = new_run(repo, agent_slug="a")
    telemetry = telemetry_with(Blocking(2.5, prefix="process"))
    with Worker(
        pool, _completed, name="slow", lease_seconds=1.5, heartbeat_seconds=0.2, telemetry=telemetry
    ) as worker:
        ended = worker.run_once()
    assert ended is not None and ended.status == RunStatus.COMPLETED
    assert [a.outcome for a in repo.list_run_attempts(run.id)] == ["completed"]


def _run_forever(worker: Worker, threads: int, done: Any, timeout: float) -> None:
    stop = threading.Event()
    running = [threading.Thread(target=worker.run_forever, args=(stop,)) for _ in range(threads)]
    for thread in running:
        thread.start()
    try:
        wait_until(done, timeout=timeout)
    finally:
        stop.set()
        for thread in running:
            thread.join(30)


def test_the_writer_goes_on_claiming_when_a_processor_raises_in_on_end(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    runs = [enqueue(repo, agent_slug="a") for _ in range(8)]
    processor = Raising(on_end=True, prefix="process")
    telemetry = telemetry_with(processor)
    ids = [r.id for r in runs]

    def all_completed() -> bool:
        return all(repo.get_run(i).status == RunStatus.COMPLETED for i in ids)  # type: ignore[union-attr]

    with Worker(
        pool, _completed, name="hostile", lease_seconds=2, poll_seconds=0.05, telemetry=telemetry
    ) as worker:
        _run_forever(worker, 2, all_completed, timeout=20)
    assert processor.calls >= len(runs)
    for run_id in ids:
        (attempt,) = repo.list_run_attempts(run_id)
        assert attempt.outcome == "completed"


def test_a_blocking_exporter_never_costs_a_lease(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    # Four threads end their runs together: the writer's batches carry several ends, each span
    # end blocking 2 s, while the runs claimed in the same commit wait for their heartbeat.
    runs = [enqueue(repo, agent_slug="a") for _ in range(8)]
    ids = [r.id for r in runs]
    exporter = blocking_exporter(2.0)
    telemetry = telemetry_with(SimpleSpanProcessor(exporter))

    def all_ended() -> bool:
        return all(repo.get_run(i).status in ("completed", "failed") for i in ids)  # type: ignore[union-attr]

    with Worker(
        pool,
        _completed,
        name="hostile",
        lease_seconds=4,
        heartbeat_seconds=0.5,
        poll_seconds=0.05,
        telemetry=telemetry,
    ) as worker:
        _run_forever(worker, 4, all_ended, timeout=90)
    statuses = {i: repo.get_run(i).status for i in ids}  # type: ignore[union-attr]
    counts = sorted(Counter(str(s) for s in statuses.values()).items())
    assert counts == [("completed", len(ids))], counts
    for run_id in ids:
        assert [a.outcome for a in repo.list_run_attempts(run_id)] == ["completed"]
    assert exporter.exported >= len(ids)


# -- the trace context: cut as W3C allows, never the run's cost ---------------------------------


def _tracestate(members: int, value_length: int) -> str:
    return ",".join(f"k{n:02d}={'v' * value_length}" for n in range(members))


def test_a_long_tracestate_is_cut_by_whole_members_from_the_right_and_the_run_created(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    from opentelemetry import context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    tracestate = _tracestate(32, 40)  # 32 members of 44 characters: valid W3C, 1,439 long
    caller = TraceContextTextMapPropagator().extract(
        {"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01", "tracestate": tracestate}
    )
    repo = AgentRunRepository(conn, telemetry=otel.telemetry())
    token = context.attach(caller)
    try:
        run = new_run(repo, agent_slug="a")
        (batch,) = repo.create_runs([_item("one")])
    finally:
        context.detach(token)
    for created in (run, batch):
        assert created.trace_context is not None
        stored = created.trace_context["tracestate"]
        assert len(stored) <= 512
        assert tracestate.startswith(stored + ",")  # whole members, from the left
        assert len(stored.split(",")) == 11  # 11 * 44 + 10 = 494; one more would be 539
        assert created.trace_context["traceparent"].split("-")[1] == TRACE


def test_cut_tracestate_and_storable_follow_w3c() -> None:
    assert cut_tracestate("a=1,b=2") == "a=1,b=2"
    assert cut_tracestate(_tracestate(32, 256)) == "k00=" + "v" * 256  # 260: only one fits
    assert cut_tracestate("a=" + "x" * 600) == ""  # not even one member fits: dropped
    assert cut_tracestate("a=1 , ,b=" + "x" * 600, limit=10) == "a=1"
    good = f"00-{TRACE}-00f067aa0ba902b7-01"
    assert storable({"traceparent": good}) == {"traceparent": good}
    assert storable({"traceparent": good, "tracestate": "a=" + "x" * 600}) == {"traceparent": good}
    assert storable({"traceparent": good, "tracestate": "a=\x00"}) == {"traceparent": good}
    for bad in ("", "00-xyz", good.upper(), good + "-extra", f"00-{TRACE}0-00f067aa0ba902b7-01"):
        assert storable({"traceparent": bad, "tracestate": "a=1"}) is None
    assert storable({}) is None


# -- error.type on the attempt metric -----------------------------------------------------------


def test_agents_error_types_label_the_attempt_metric_capped_as_agent_slugs_are(
    conn: psycopg.Connection[Any], otel: Otel
) -> None:
    repo = AgentRunRepository(conn, telemetry=otel.telemetry(max_agent_slugs=2))
    kinds = ["tool_error", "rate_limited", "tool_error", "context_overflow", "agent_error"]
    runs = [new_run(repo, agent_slug="a") for _ in kinds]
    tokens = [f"w:{n}" for n in range(len(kinds))]
    claimed = repo.claim_next_attempts(worker_ids=tokens, lease_seconds=30)
    owner = {c.run.id: c.run.worker_id for c in claimed}
    repo.finish_runs(
        [
            Finish(run.id, str(owner[run.id]), "failed", kind, "message")
            for run, kind in zip(runs, kinds, strict=True)
        ]
    )
    by_type: dict[str, int] = {}
    for point in otel.points()["agent_runs.attempt.duration"]:
        kind = point.attributes["error.type"]
        by_type[kind] = by_type.get(kind, 0) + point.count
    # The worker's own classifications always; agents' own: the first two, then _OTHER.
    assert by_type == {"tool_error": 2, "rate_limited": 1, "_OTHER": 1, "agent_error": 1}
