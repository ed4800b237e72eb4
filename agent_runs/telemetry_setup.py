"""`--otel` of the CLI: an OpenTelemetry SDK configured from the standard OTEL_* variables.

What an application does for itself, done for `agent-runs worker` and `agent-runs enqueue`:
a TracerProvider and a MeterProvider with the resource of OTEL_SERVICE_NAME /
OTEL_RESOURCE_ATTRIBUTES (default service.name: the command's), made global (so an agent's own
spans share them), exporting as OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER say:

- `otlp` (the default): OTLP over HTTP/protobuf (opentelemetry-exporter-otlp-proto-http), or
  gRPC with OTEL_EXPORTER_OTLP_PROTOCOL=grpc (opentelemetry-exporter-otlp-proto-grpc); the
  exporters read their OTEL_EXPORTER_OTLP_* endpoint, headers and timeout themselves;
- `console`: JSON on standard output; `none`: nothing.

Batching and intervals follow OTEL_BSP_* and OTEL_METRIC_EXPORT_INTERVAL (the SDK reads them).
OTEL_SDK_DISABLED=true turns it off. Missing packages raise MissingPackages, whose message the
CLI prints as its one line (exit 2).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from agent_runs.errors import InvalidArgument
from agent_runs.telemetry import Telemetry

INSTALL_HINT: Final = (
    "pip install 'agent_runs[otel-cli]' (opentelemetry-api, opentelemetry-sdk, "
    "opentelemetry-exporter-otlp-proto-http)"
)
_EXPORTERS: Final = frozenset({"otlp", "console", "none"})


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
    tracer_provider = TracerProvider(resource=resource)
    for exporter in _span_exporters():
        tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
    readers = [PeriodicExportingMetricReader(e) for e in _metric_exporters()]
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)

    def shutdown() -> None:
        tracer_provider.shutdown()
        meter_provider.shutdown(timeout_millis=5_000)

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

            found.append(ConsoleSpanExporter())
        else:
            found.append(_otlp_module("TRACES").OTLPSpanExporter())
    return found


def _metric_exporters() -> list[Any]:
    found: list[Any] = []
    for name in _chosen("OTEL_METRICS_EXPORTER"):
        if name == "console":
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

            found.append(ConsoleMetricExporter())
        else:
            found.append(_otlp_module("METRICS").OTLPMetricExporter())
    return found
