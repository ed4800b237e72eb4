"""OpenTelemetry for tests (a pytest plugin): `otel`, an SDK of the test's own whose spans and
metrics stay in memory (InMemorySpanExporter, InMemoryMetricReader), never the global one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

    from agent_runs.telemetry import Telemetry


class Otel:
    """A tracer and meter provider that keep what they record, and Telemetry objects on them."""

    def __init__(self) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        self.exporter = InMemorySpanExporter()
        self.reader = InMemoryMetricReader()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.tracer = self.tracer_provider.get_tracer("tests")

    def telemetry(self, **kwargs: Any) -> Telemetry:
        from agent_runs.telemetry import Telemetry

        return Telemetry(
            tracer_provider=self.tracer_provider, meter_provider=self.meter_provider, **kwargs
        )

    def spans(self, name_prefix: str = "") -> list[ReadableSpan]:
        return [
            s for s in self.exporter.get_finished_spans() if (s.name or "").startswith(name_prefix)
        ]

    def points(self) -> dict[str, list[Any]]:
        """Every data point recorded so far, by metric name (one collection)."""
        found: dict[str, list[Any]] = {}
        data = self.reader.get_metrics_data()
        if data is None:
            return found
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    found.setdefault(metric.name, []).extend(metric.data.data_points)
        return found

    def total(self, name: str, **attributes: Any) -> float:
        """The sum of a counter's (or count of a histogram's) points matching `attributes`."""
        total = 0.0
        for point in self.points().get(name, []):
            if all(point.attributes.get(k) == v for k, v in attributes.items()):
                total += point.count if hasattr(point, "count") else point.value
        return total

    def close(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


@pytest.fixture
def otel() -> Iterator[Otel]:
    found = Otel()
    yield found
    found.close()
