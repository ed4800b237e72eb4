"""`--otel` of the CLI: an OpenTelemetry SDK configured from the standard OTEL_* variables.

What an application does for itself, done for `agent-runs worker` and `agent-runs enqueue`:
a TracerProvider and a MeterProvider with the resource of OTEL_SERVICE_NAME /
OTEL_RESOURCE_ATTRIBUTES (default service.name: the command's), made global (so an agent's own
spans share them), exporting as OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER say:

- `otlp` (the default): OTLP over HTTP/protobuf (opentelemetry-exporter-otlp-proto-http), or
  gRPC with OTEL_EXPORTER_OTLP_PROTOCOL=grpc (opentelemetry-exporter-otlp-proto-grpc); the
  exporters read their OTEL_EXPORTER_OTLP_* endpoint, headers and timeout themselves;
- `console`: JSON on standard error (standard output stays what the command prints, e.g.
  the run id of `enqueue`); `none`: nothing.

Batching and intervals follow OTEL_BSP_* and OTEL_METRIC_EXPORT_INTERVAL (the SDK reads them).
OTEL_SDK_DISABLED=true turns it off. Missing packages raise MissingPackages, whose message the
CLI prints as its one line (exit 2).

A collector that is down costs one line on standard error, once per process (the SDK's own
retry and failure records are kept from the console), and at most SHUTDOWN_SECONDS at exit:
`shutdown()` flushes in a thread of its own and stops waiting for it then.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from agent_runs.errors import InvalidArgument
from agent_runs.telemetry.recorder import Telemetry

INSTALL_HINT: Final = (
    "pip install 'agent_runs[otel-cli]' (opentelemetry-api, opentelemetry-sdk, "
    "opentelemetry-exporter-otlp-proto-http)"
)
_EXPORTERS: Final = frozenset({"otlp", "console", "none"})
# The longest `shutdown()` waits for the last export (a collector that is down never holds the
# exit longer); and the SDK's loggers whose records become that one line.
SHUTDOWN_SECONDS: Final = 2.0
_SDK_LOGGERS: Final = ("opentelemetry.exporter", "opentelemetry.sdk")


class MissingPackages(InvalidArgument):
    """--otel without the packages it needs; the message names them."""


@dataclass(frozen=True, slots=True)
class OtelSetup:
    """The configured SDK: the Telemetry to pass on, and `shutdown()` to flush at exit."""

    telemetry: Telemetry | None
    shutdown: Callable[[], None]


def configure_from_env(
    service_name: str, *, parent_from_env: bool = False, **telemetry_options: Any
) -> OtelSetup:
    """Providers from the OTEL_* environment, made global; a Telemetry on them.

    `parent_from_env`: a W3C context in TRACEPARENT / TRACESTATE (the OpenTelemetry convention
    for environment carriers) becomes the current context, so that a script's `enqueue` joins
    the trace of whatever called it."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return OtelSetup(None, lambda: None)
    try:
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise MissingPackages(
            f"--otel needs the OpenTelemetry SDK ({exc.name}): {INSTALL_HINT}"
        ) from None
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": service_name}))
    one_line = OneLine.install("agent-runs")
    # shutdown_on_exit=False: no exit handler of the SDK's waits for the collector unbounded.
    tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    for exporter in _span_exporters():
        tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
    readers = [PeriodicExportingMetricReader(e) for e in _metric_exporters()]
    meter_provider = MeterProvider(
        resource=resource, metric_readers=readers, shutdown_on_exit=False
    )
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)

    def flush() -> None:
        tracer_provider.shutdown()
        meter_provider.shutdown(timeout_millis=int(SHUTDOWN_SECONDS * 1000))

    def shutdown() -> None:
        flushing = threading.Thread(target=flush, name="otel-shutdown", daemon=True)
        flushing.start()
        flushing.join(SHUTDOWN_SECONDS)
        if flushing.is_alive():
            one_line.say(f"could not export within {SHUTDOWN_SECONDS:g}s at exit; dropped")

    telemetry = Telemetry(
        tracer_provider=tracer_provider, meter_provider=meter_provider, **telemetry_options
    )
    if parent_from_env and os.environ.get("TRACEPARENT"):
        from opentelemetry import context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier = {"traceparent": os.environ["TRACEPARENT"]}
        if os.environ.get("TRACESTATE"):
            carrier["tracestate"] = os.environ["TRACESTATE"]
        context.attach(TraceContextTextMapPropagator().extract(carrier))
    return OtelSetup(telemetry, shutdown)


class OneLine(logging.Handler):
    """The SDK's warnings and errors (an unreachable collector's retries, a failed batch) as
    one line on standard error, the first time only; the records themselves stay quiet."""

    def __init__(self, prog: str) -> None:
        super().__init__(logging.WARNING)
        self._prog = prog
        self._said = threading.Event()

    @classmethod
    def install(cls, prog: str) -> OneLine:
        handler = cls(prog)
        for name in _SDK_LOGGERS:
            sdk_log = logging.getLogger(name)
            for old in [h for h in sdk_log.handlers if isinstance(h, OneLine)]:
                sdk_log.removeHandler(old)
            sdk_log.addHandler(handler)
            sdk_log.propagate = False
        return handler

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = " ".join(record.getMessage().split())
        except Exception:  # a record that cannot format itself
            text = record.msg if isinstance(record.msg, str) else "export failed"
        self.say(f"could not export ({text[:200]})")

    def say(self, text: str) -> None:
        if self._said.is_set():
            return
        self._said.set()
        print(
            f"{self._prog}: --otel: {text}; telemetry is dropped while the collector is "
            "unreachable (further export errors are not shown)",
            file=sys.stderr,
            flush=True,
        )


def _chosen(variable: str) -> list[str]:
    names = [n.strip().lower() for n in os.environ.get(variable, "otlp").split(",") if n.strip()]
    unknown = sorted(set(names) - _EXPORTERS)
    if unknown:
        raise InvalidArgument(
            f"{variable}: unsupported exporter {', '.join(unknown)} (otlp, console or none)"
        )
    return [n for n in names if n != "none"]


def _protocol(signal: str) -> str:
    protocol = os.environ.get(
        f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL",
        os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
    )
    if protocol not in ("http/protobuf", "grpc"):
        raise InvalidArgument(
            f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not supported (http/protobuf, grpc)"
        )
    return protocol


def _otlp_module(signal: str) -> Any:
    import importlib

    kind = "trace" if signal == "TRACES" else "metric"
    protocol = _protocol(signal)
    package = "grpc" if protocol == "grpc" else "http"
    name = f"opentelemetry.exporter.otlp.proto.{package}.{kind}_exporter"
    try:
        return importlib.import_module(name)
    except ImportError:
        wanted = f"opentelemetry-exporter-otlp-proto-{package}"
        hint = INSTALL_HINT if package == "http" else f"pip install {wanted}"
        raise MissingPackages(f"--otel with OTLP over {protocol} needs {wanted}: {hint}") from None


def _span_exporters() -> list[Any]:
    found: list[Any] = []
    for name in _chosen("OTEL_TRACES_EXPORTER"):
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            found.append(ConsoleSpanExporter(out=sys.stderr))
        else:
            found.append(_otlp_module("TRACES").OTLPSpanExporter())
    return found


def _metric_exporters() -> list[Any]:
    found: list[Any] = []
    for name in _chosen("OTEL_METRICS_EXPORTER"):
        if name == "console":
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

            found.append(ConsoleMetricExporter(out=sys.stderr))
        else:
            found.append(_otlp_module("METRICS").OTLPMetricExporter())
    return found
