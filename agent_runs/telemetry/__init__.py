"""OpenTelemetry traces and metrics for agent runs (the `otel` extra), off unless asked for.

`Telemetry` (recorder) is what `AgentRunRepository(conn, telemetry=t)` and `Worker(...,
telemetry=t)` take. Its parts: trace_context (the stored W3C context, the option checks),
sdk_guard (the application's SDK kept at arm's length), metrics (instruments and their closed
attribute sets), queue_query (the read behind the queue gauges), log_filter (span ids on log
lines), sdk_setup (`--otel`: an SDK configured from the OTEL_* variables). Only this package
imports opentelemetry, and only once a Telemetry is made.
"""

from __future__ import annotations

from agent_runs.telemetry.recorder import SCHEMA_URL, SPAN_RELATIONSHIPS, Telemetry

__all__ = ["SCHEMA_URL", "SPAN_RELATIONSHIPS", "Telemetry"]
