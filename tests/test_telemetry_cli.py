"""`agent-runs enqueue --otel` and `agent-runs worker --otel` as real processes exporting OTLP
over HTTP to a receiver in this test; producer and consumer are joined by the stored context."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from agent_runs import AgentRunRepository, RunStatus
from tests.helpers import wait_until

PRODUCER_KIND = 4  # opentelemetry.proto Span.SpanKind: SPAN_KIND_PRODUCER
CONSUMER_KIND = 5


class Receiver:
    """An OTLP/HTTP endpoint: what the processes export, decoded with opentelemetry-proto."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.metric_names: set[str] = set()
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.take(self.path, body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take(self, path: str, body: bytes) -> None:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceRequest,
        )
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        with self._lock:
            if path == "/v1/traces":
                request = ExportTraceServiceRequest.FromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        self.spans.extend(scope.spans)
            elif path == "/v1/metrics":
                metrics = ExportMetricsServiceRequest.FromString(body)
                for resource in metrics.resource_metrics:
                    for scope in resource.scope_metrics:
                        self.metric_names.update(m.name for m in scope.metrics)

    def named(self, prefix: str) -> list[Any]:
        with self._lock:
            return [s for s in self.spans if s.name.startswith(prefix)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    yield found
    found.close()


def _env(receiver: Receiver, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_METRIC_EXPORT_INTERVAL="500",
        OTEL_SERVICE_NAME="cli-test",
        PYTHONPATH=os.getcwd(),
    )
    env.update(extra)
    return env


def _attributes(span: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for kv in span.attributes:
        value = kv.value
        found[kv.key] = value.int_value if value.HasField("int_value") else value.string_value
    return found


def test_enqueue_and_worker_processes_join_producer_and_consumer_by_the_stored_context(
    dsn: str, repo: AgentRunRepository, receiver: Receiver
) -> None:
    caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    caller = f"00-{caller_trace}-00f067aa0ba902b7-01"
    enqueued = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_runs",
            "enqueue",
            "--otel",
            "--dsn",
            dsn,
            "--thread",
            "t",
            "--agent-slug",
            "cli-agent",
            "--uid",
            "u",
            "--payload",
            '{"script": ["retry", "ok"]}',
        ],
        env=_env(receiver, TRACEPARENT=caller),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert enqueued.returncode == 0, enqueued.stderr
    run_id = enqueued.stdout.strip()
    stored = repo.get_run(run_id)
    assert stored is not None and stored.trace_context is not None
    _, trace_id, span_id, _ = stored.trace_context["traceparent"].split("-")
    assert trace_id == caller_trace  # the enqueue joined the caller's trace (TRACEPARENT)
    (producer,) = receiver.named("create_run")  # exported before the process ended
    assert producer.name == "create_run cli-agent" and producer.kind == PRODUCER_KIND
    assert (producer.trace_id.hex(), producer.span_id.hex()) == (trace_id, span_id)
    assert producer.parent_span_id.hex() == "00f067aa0ba902b7"

    # A run this worker does not take (--agent-slug): the queue gauges have something to say.
    repo.create_run(thread_id="t2", agent_slug="other", uid="u", request_id="waiting")
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent_runs",
            "worker",
            "--otel",
            "--otel-observe-queue",
            "--dsn",
            dsn,
            "--lease-seconds",
            "5",
            "--poll-seconds",
            "0.1",
            "--name",
            "cli-w",
            "--agent-slug",
            "cli-agent",
        ],
        env=_env(receiver),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: (r := repo.get_run(run_id)) is not None and r.status == RunStatus.COMPLETED,
            timeout=30,
        )
        wait_until(lambda: len(receiver.named("process")) == 2, timeout=30)
    finally:
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=30)
    assert worker.returncode == 0, stderr
    first, second = sorted(
        receiver.named("process"), key=lambda s: _attributes(s)["agent_runs.attempt"]
    )
    for span in (first, second):
        assert span.name == "process cli-agent" and span.kind == CONSUMER_KIND
        assert not span.parent_span_id and span.trace_id.hex() != trace_id
        assert [(link.trace_id.hex(), link.span_id.hex()) for link in span.links] == [
            (trace_id, span_id)
        ]
        assert _attributes(span)["messaging.message.id"] == run_id
        assert _attributes(span)["messaging.client.id"].startswith("cli-w:")
    assert _attributes(first)["agent_runs.outcome"] == "retry_released"
    assert _attributes(second)["agent_runs.outcome"] == "completed"
    # The worker's log lines of an attempt carry its ids (here: the release for retry).
    ids = f"trace_id={first.trace_id.hex()} span_id={first.span_id.hex()}"
    assert any("released for retry" in line and ids in line for line in stderr.splitlines())
    assert {
        "agent_runs.attempt.started",
        "agent_runs.attempt.duration",
        "agent_runs.run.count",
        "agent_runs.pending.age",
    } <= receiver.metric_names


def test_otel_without_the_sdk_is_a_one_line_error_naming_the_packages(dsn: str) -> None:
    script = textwrap.dedent(
        """
        import sys
        class NoSdk:
            def find_spec(self, name, path=None, target=None):
                if name.startswith("opentelemetry.sdk"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, NoSdk())
        from agent_runs.cli import main
        sys.exit(main(sys.argv[1:]))
        """
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "enqueue",
            "--otel",
            "--dsn",
            dsn,
            "--thread",
            "t",
            "--agent-slug",
            "a",
            "--uid",
            "u",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "opentelemetry-sdk" in done.stderr and "agent_runs[otel-cli]" in done.stderr
    assert "Traceback" not in done.stderr


def test_reconcile_otel_exports_the_pass_that_converged_runs(
    dsn: str, repo: AgentRunRepository, receiver: Receiver
) -> None:
    import time

    run = repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r")
    repo.mark_running(run.id, worker_id="gone:1", lease_seconds=0.01)
    time.sleep(0.05)
    done = subprocess.run(
        [sys.executable, "-m", "agent_runs", "reconcile", "--otel", "--dsn", dsn],
        env=_env(receiver),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "reconciled 1 run(s)"
    (span,) = receiver.named("reconcile")
    assert span.name == "reconcile agent_runs"
    assert _attributes(span)["agent_runs.reconciled.count"] == 1
    assert "agent_runs.reconciler.converged" in receiver.metric_names
