"""Telemetry: the OpenTelemetry traces and metrics of agent runs, off unless asked for.

`Telemetry` is the one object the repository and the worker call where a fact commits: runs
created (`sending`, `sending_many`), attempts claimed (`claimed`), ends written (`ended`), a
worker letting go of an attempt (`released`), renewals, reconcile passes (`reconciled`). Only
the agent_runs.telemetry package imports opentelemetry, when a Telemetry is made: with
telemetry off it is never loaded and each of those points costs one `is None` check.

Spans follow the OpenTelemetry semantic conventions for messaging (v1.44.0, still Development):

- `create_run {agent_slug}`, PRODUCER, a child of the caller's current span (create_runs: one
  per item); its W3C context is stored with the run (agent_runs.trace_context) by the INSERT;
- `process {agent_slug}`, CONSUMER, one per attempt, from the claim to the committed end (or to
  the worker letting go of a lost lease), a new trace linked to the creating span
  (span_relationship "link"; "child": attempt 1 is its child, retries linked; "none": neither);
- `reconcile agent_runs`, INTERNAL, only for a pass that converged runs, linked to their
  creating spans.

Hooks are guarded (agent_runs.telemetry.sdk_guard): whatever the SDK raises, a call answers what
committed. An attempt's span is kept here by its owner token: it travels explicitly from the
claiming thread to the executing (`executing`) and writing ones, never in a thread's context.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any, Final

from agent_runs.telemetry.sdk_guard import guarded, safely
from agent_runs.telemetry.trace_context import (
    SPAN_RELATIONSHIPS,
    check_options,
    package_version,
    qualified,
    storable,
)

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import Span, TracerProvider

    from agent_runs.models import AgentRun
    from agent_runs.telemetry.metrics import Instruments, QueueGauges

__all__ = ["SPAN_RELATIONSHIPS", "Telemetry"]

SCHEMA_URL: Final = "https://opentelemetry.io/schemas/1.44.0"
# Ends that are errors on a span; cancelled and completed are not.
_ERROR_OUTCOMES: Final = frozenset({"failed", "interrupted", "retry_released", "lease_expired"})
_LOST: Final = ("lease_expired", "worker_lease_expired")
_MAX_LINKS: Final = 128  # of a reconcile span
_MAX_OPEN: Final = 100_000  # open attempt spans kept (a caller that never ends them is bounded)


@dataclass(slots=True)
class _Attempt:
    """One open `process` span, between its claim and its end."""

    span: Span
    context: Context
    run_id: str
    agent_slug: str
    started: float  # monotonic, for attempt.duration


class Telemetry:
    """Spans and metrics for `AgentRunRepository(conn, telemetry=t)` and `Worker(...,
    telemetry=t)`; providers default to the global ones (the application configures its SDK).

    `observe_queue=True` (on one process) adds the observable gauges agent_runs.run.count and
    agent_runs.pending.age, read by one grouped query per collection through the Worker's pool
    (or the first repository's connection) with a statement timeout of its own. Agent slugs, and
    agents' own error types, label metrics up to `max_agent_slugs` distinct ones each; later
    ones count as `_OTHER`.
    """

    def __init__(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        span_relationship: str = "link",
        observe_queue: bool = False,
        max_agent_slugs: int = 100,
        queue_statement_timeout_seconds: float = 2.0,
    ) -> None:
        check_options(span_relationship, max_agent_slugs, queue_statement_timeout_seconds)
        # opentelemetry is loaded here, and only here: telemetry off never imports it.
        try:
            from opentelemetry import metrics, trace
        except ImportError:
            raise ImportError(
                "agent_runs.telemetry needs opentelemetry-api: pip install 'agent_runs[otel]'"
            ) from None
        from opentelemetry.context import Context
        from opentelemetry.trace import Link, SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from agent_runs.telemetry.metrics import Instruments

        version = package_version()
        self.span_relationship = span_relationship
        self.tracer = trace.get_tracer(
            "agent_runs", version, tracer_provider=tracer_provider, schema_url=SCHEMA_URL
        )
        self.meter = metrics.get_meter(
            "agent_runs", version, meter_provider=meter_provider, schema_url=SCHEMA_URL
        )
        self.instruments: Instruments = Instruments(self.meter, max_agent_slugs=max_agent_slugs)
        self._trace = trace
        self._empty = Context
        self._link = Link
        self._kind = SpanKind
        self._error = Status(StatusCode.ERROR)
        self._propagator = TraceContextTextMapPropagator()
        self._open: dict[str, _Attempt] = {}  # owner token -> its attempt's span
        self._lock = threading.Lock()
        self._observe_queue = observe_queue
        self._queue_timeout = queue_statement_timeout_seconds
        self.queue_gauges: QueueGauges | None = None
        from agent_runs.telemetry.log_filter import install_log_filter

        install_log_filter(trace)

    # -- creating a run ----------------------------------------------------------------------

    @contextmanager
    def sending(self, agent_slug: str, run_id: str) -> Iterator[_Sending]:
        """The `create_run {agent_slug}` PRODUCER span around create_run's statements, current
        while they run; `.trace_context` is what the INSERT stores."""
        with (
            self.sending_many([(agent_slug, run_id)]) as (sending,),
            self._trace.use_span(
                sending.span, record_exception=False, set_status_on_exception=False
            ),
        ):
            yield sending

    @contextmanager
    def sending_many(self, messages: Sequence[tuple[str, str]]) -> Iterator[list[_Sending]]:
        """A `create_run {agent_slug}` PRODUCER span per (agent_slug, run_id), children of the
        caller's current span (none made current), ended after the block; errors if it raises."""
        spans = [self._start_producer(agent_slug, run_id) for agent_slug, run_id in messages]
        try:
            yield [_Sending(self, span) for span in spans]
        except Exception as exc:
            # No exception event or status text: an error's message may hold a uid or a payload.
            self._failed(spans, qualified(type(exc)))
            raise
        finally:
            for span in spans:
                safely("sending", span.end)

    def _start_producer(self, agent_slug: str, run_id: str) -> Span:
        """The PRODUCER span, or an invalid one (no context stored) when the SDK fails."""
        attributes = {
            "messaging.system": "agent_runs",
            "messaging.operation.type": "send",
            "messaging.operation.name": "create_run",
            "messaging.destination.name": agent_slug,
            "messaging.message.id": run_id,
        }
        kind, name = self._kind.PRODUCER, f"create_run {agent_slug}"
        start = partial(self.tracer.start_span, name, kind=kind, attributes=attributes)
        span: Span = safely("sending", start, self._trace.INVALID_SPAN)
        return span

    def _failed(self, spans: list[Span], error_type: str) -> None:
        def mark() -> None:
            for span in spans:
                span.set_attribute("error.type", error_type)
                span.set_status(self._error)

        safely("sending", mark)

    def _carrier(self, span: Span) -> dict[str, str] | None:
        """The span's W3C context as the INSERT stores it (cut as W3C allows), or None."""
        if not span.get_span_context().is_valid:
            return None
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return storable(carrier)

    # -- one attempt ---------------------------------------------------------------------------

    @guarded
    def claimed(
        self,
        claims: Sequence[tuple[AgentRun, int | None]],
        released: Mapping[str, datetime],
    ) -> None:
        """Attempts just claimed (committed): a `process` span each, and their metrics;
        `released`: when the attempt before each retry ended (run id -> finished_at)."""
        instruments = self.instruments
        now = time.monotonic()
        for run, attempt_no in claims:
            token = run.worker_id
            if token is None or token in self._open:  # a lost claim reply found: known already
                continue
            span = self._start_process(run, attempt_no, token)
            base = instruments.base(run.agent_slug)
            instruments.attempt_started.add(1, base)
            instruments.worker_active.add(1, base)
            ready = run.created_at if attempt_no == 1 else released.get(run.id)
            if ready is not None and run.heartbeat_at is not None:
                # Both from the database's clock: creation or release -> the claim's now.
                waited = (run.heartbeat_at - ready).total_seconds()
                instruments.pickup_duration.record(max(0.0, waited), base)
            opened = _Attempt(
                span, self._trace.set_span_in_context(span), run.id, run.agent_slug, now
            )
            with self._lock:  # one never ended by its caller: the oldest goes (ended unlocked)
                full = len(self._open) >= _MAX_OPEN
                oldest = self._open.pop(next(iter(self._open))) if full else None
                self._open[token] = opened
            if oldest is not None:
                oldest.span.end()

    def _start_process(self, run: AgentRun, attempt_no: int | None, token: str) -> Span:
        producer = self._producer(run)
        relationship = self.span_relationship
        parent = self._empty()  # a new trace, whatever is current in the claiming thread
        links = []
        if producer is not None:
            if relationship == "child" and attempt_no == 1:
                parent = self._trace.set_span_in_context(self._trace.NonRecordingSpan(producer))
            elif relationship != "none":
                links.append(self._link(producer))
        attributes: dict[str, Any] = {
            "messaging.system": "agent_runs",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": run.agent_slug,
            "messaging.message.id": run.id,
            "messaging.client.id": token,
        }
        if attempt_no is not None:
            attributes["agent_runs.attempt"] = attempt_no
        return self.tracer.start_span(
            f"process {run.agent_slug}",
            context=parent,
            kind=self._kind.CONSUMER,
            links=links,
            attributes=attributes,
        )

    def _producer(self, run: AgentRun) -> Any:
        """The creating span's context, from the run's stored trace_context (None if absent)."""
        carried = run.trace_context
        if not carried:
            return None
        context = self._propagator.extract(carried, context=self._empty())
        producer = self._trace.get_current_span(context).get_span_context()
        return producer if producer.is_valid else None

    @contextmanager
    def executing(self, worker_id: str) -> Iterator[None]:
        """Make the attempt's span current in the executing thread (the agent's own spans become
        its children, log lines carry its ids); carried there by its owner token."""
        with self._lock:
            found = self._open.get(worker_id)
        if found is None:
            yield
            return
        from opentelemetry import context

        token = context.attach(found.context)  # the API's own context: no SDK code runs
        try:
            yield
        finally:
            context.detach(token)

    @guarded
    def ended(self, worker_id: str, outcome: str, error_type: str | None) -> None:
        """The attempt's end committed: its span ends with the outcome."""
        with self._lock:
            attempt = self._open.pop(worker_id, None)
        if attempt is None:
            return
        if outcome in _ERROR_OUTCOMES and error_type is None:
            error_type = outcome
        seconds = time.monotonic() - attempt.started
        self.instruments.ended(attempt.agent_slug, outcome, error_type, seconds)
        self._end(attempt, outcome, error_type)

    @guarded
    def released(self, worker_id: str) -> None:
        """The worker let go of the attempt. If no end was written for it, its lease is lost
        (refused, or it could not be proven): the span ends ERROR worker_lease_expired. Its
        duration is recorded by the reconciler that converges it."""
        with self._lock:
            attempt = self._open.pop(worker_id, None)
        if attempt is not None:
            self._lost(attempt)

    def _lost(self, attempt: _Attempt) -> None:
        self.instruments.lease_lost.add(1, self.instruments.base(attempt.agent_slug))
        self._end(attempt, *_LOST)

    def _end(self, attempt: _Attempt, outcome: str, error_type: str | None) -> None:
        # The metric first, the span last: an SDK failing in its end costs neither.
        self.instruments.worker_active.add(-1, self.instruments.base(attempt.agent_slug))
        span = attempt.span
        span.set_attribute("agent_runs.outcome", outcome)
        if outcome in _ERROR_OUTCOMES:
            span.set_attribute("error.type", error_type or outcome)
            span.set_status(self._error)
        span.end()

    @guarded
    def renewed(self, count: int) -> None:
        self.instruments.lease_renewals.add(count, self.instruments.system)

    # -- the reconciler ------------------------------------------------------------------------

    def clock_ns(self) -> int:
        return time.time_ns()

    @guarded
    def reconciled(
        self,
        converged: Sequence[AgentRun],
        closed: Sequence[tuple[str, int, datetime, datetime]],
        started_ns: int,
    ) -> None:
        """A reconcile pass converged runs: one INTERNAL span, and their metrics; the attempts
        it closed are recorded in attempt.duration (outcome lease_expired)."""
        links = []
        for run in converged[:_MAX_LINKS]:
            producer = self._producer(run)
            if producer is not None:
                links.append(self._link(producer, {"messaging.message.id": run.id}))
        span = self.tracer.start_span(
            "reconcile agent_runs",
            context=self._empty(),
            kind=self._kind.INTERNAL,
            links=links,
            start_time=started_ns,
            attributes={
                "messaging.system": "agent_runs",
                "agent_runs.reconciled.count": len(converged),
            },
        )
        span.end()
        instruments = self.instruments
        slugs = {}
        for run in converged:
            slugs[run.id] = run.agent_slug
            instruments.reconciler_converged.add(1, instruments.base(run.agent_slug))
            with self._lock:  # an attempt of this process whose lease it lost: ends now
                tokens = [t for t, a in self._open.items() if a.run_id == run.id]
                gone = [self._open.pop(t) for t in tokens]
            for attempt in gone:
                self._lost(attempt)
        for run_id, _attempt_no, started_at, finished_at in closed:
            seconds = (finished_at - started_at).total_seconds()
            instruments.ended(slugs[run_id], *_LOST, seconds)

    # -- the queue gauges ----------------------------------------------------------------------

    def observe_through(self, source: Any) -> None:
        """With observe_queue: read the gauges through `source`, the first one given: a
        ConnectionPool (a Worker gives its own), or a connection of yours that stays open (a
        repository gives its connection unless it came from a pool); otherwise nothing."""
        if not self._observe_queue or self.queue_gauges is not None:
            return
        with self._lock:
            if self.queue_gauges is not None:
                return
            from agent_runs.telemetry.queue_query import queue_reader

            read = queue_reader(source, timeout_seconds=self._queue_timeout)
            self.queue_gauges = self.instruments.observe_queue(self.meter, read)


class _Sending:
    """A PRODUCER span of create_run (or of one item of create_runs) while the statements run."""

    __slots__ = ("_telemetry", "span", "trace_context")

    def __init__(self, telemetry: Telemetry, span: Span) -> None:
        self._telemetry = telemetry
        self.span = span
        self.trace_context: dict[str, str] | None = safely(
            "sending", lambda: telemetry._carrier(span)
        )

    @guarded
    def sent(self, run: AgentRun, *, created: bool) -> None:
        self.span.set_attribute("messaging.message.id", run.id)
        if created:
            instruments = self._telemetry.instruments
            instruments.run_created.add(1, instruments.base(run.agent_slug))
