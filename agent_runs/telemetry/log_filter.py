"""Worker log lines that carry the current span's ids (agent_runs.telemetry, when on).

Takes the `opentelemetry.trace` module from Telemetry, so that it imports nothing itself.
"""

from __future__ import annotations

import logging
from typing import Any


class TraceLogFilter(logging.Filter):
    """Adds the current span's ids to the worker's log records: as attributes (`trace_id`,
    `span_id`, and `otelTraceID`, `otelSpanID` as OpenTelemetry's logging instrumentation names
    them, so a format may use either) and at the end of the message (`trace_id=… span_id=…`),
    when a span is current."""

    def __init__(self, trace: Any) -> None:
        super().__init__("agent_runs.telemetry")
        self._trace = trace

    def filter(self, record: logging.LogRecord) -> bool:
        found = self._trace.get_current_span().get_span_context()
        if found.is_valid and not hasattr(record, "otelTraceID"):
            trace_id = format(found.trace_id, "032x")
            span_id = format(found.span_id, "016x")
            record.otelTraceID = record.trace_id = trace_id
            record.otelSpanID = record.span_id = span_id
            record.msg = f"{record.msg} trace_id={trace_id} span_id={span_id}"
        return True


def install_log_filter(trace: Any) -> None:
    """Once per process: the worker's logger gets a TraceLogFilter."""
    worker_log = logging.getLogger("agent_runs.worker")
    if not any(isinstance(f, TraceLogFilter) for f in worker_log.filters):
        worker_log.addFilter(TraceLogFilter(trace))
