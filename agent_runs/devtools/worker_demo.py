"""`agent-runs demo`: real worker processes on a scripted mix of runs, then every run's history.

Without a DSN it starts an embedded PostgreSQL in a temporary directory. Short leases make a
crashed worker converge in seconds. Every process it starts, and the server, is stopped on the
way out, also on Ctrl-C, SIGTERM or an error.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Any

from agent_runs.db import connect
from agent_runs.explain import explain_run
from agent_runs.migrate import apply_migrations
from agent_runs.models import AgentRun, RunStatus
from agent_runs.report import render_history
from agent_runs.repository import AgentRunRepository


@dataclass(frozen=True)
class Scenario:
    label: str
    script: list[str]
    expect: str  # final status, with `/error_type` when it matters
    cancel_when_running: bool = False


SCENARIOS = (
    Scenario("success", ["ok"], "completed"),
    Scenario("retry then success", ["retry", "ok"], "completed"),
    Scenario("retries exhausted", ["retry"], "failed/retries_exhausted"),
    Scenario("permanent failure", ["fail:invalid_input"], "failed/invalid_input"),
    Scenario("crash mid-run", ["crash"], "failed/worker_lease_expired"),
    Scenario("cancel", ["wait_cancel"], "cancelled", cancel_when_running=True),
    Scenario("interrupt", ["interrupt"], "interrupted"),
    Scenario("hang (late result refused)", ["hang"], "failed/worker_lease_expired"),
    Scenario("slow success", ["sleep:1.5"], "completed"),
)


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[bytes]
    replaced: bool = False


@dataclass
class Children:
    """The worker and reconciler processes the demo started; all stopped on exit."""

    dsn: str
    stream: IO[Any] | int
    started: list[_Child] = field(default_factory=list)

    def start(self, name: str, args: list[str]) -> _Child:
        process = subprocess.Popen(
            [sys.executable, "-m", "agent_runs", *args, "--dsn", self.dsn],
            stdin=subprocess.DEVNULL,
            stdout=self.stream,
            stderr=self.stream,
        )
        child = _Child(name, process)
        self.started.append(child)
        return child

    def stop_all(self, grace: float) -> None:
        live = [c for c in self.started if c.process.poll() is None]
        for child in live:
            child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in live:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()


def run_demo(
    dsn: str | None,
    *,
    lease_seconds: float = 2.0,
    workers: int = 3,
    timeout: float = 60.0,
    show_worker_logs: bool = False,
) -> int:
    """Run the demo; 0 when every run ended as its script says, 1 otherwise."""
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:5.1f}s] {message}", flush=True)

    with ExitStack() as stack:
        stack.enter_context(sigterm_as_interrupt())
        dsn = demo_database(stack, dsn, say, prefix="agent_runs-demo-")
        conn = stack.enter_context(connect(dsn))
        repo = AgentRunRepository(conn)

        slug = f"demo-{uuid.uuid4().hex[:8]}"  # our workers only claim the demo's own runs
        runs: dict[str, Scenario] = {}
        for i, scenario in enumerate(SCENARIOS, 1):
            run = repo.create_run(
                thread_id=f"{slug}-thread-{i}",
                agent_slug=slug,
                uid="demo-user",
                request_id=f"{slug}-{i}",
                input_payload={"script": scenario.script, "scenario": scenario.label},
            )
            runs[run.id] = scenario
        say(f"enqueued {len(runs)} runs (agent slug {slug}, lease {lease_seconds:g}s)")

        children = Children(
            dsn=dsn,
            stream=sys.stderr if show_worker_logs else subprocess.DEVNULL,
        )
        stack.callback(children.stop_all, lease_seconds + 3.0)
        children.start(
            "reconciler",
            ["reconcile", "--every", f"{lease_seconds / 2:g}", "--log-level", "WARNING"],
        )
        worker_args = [
            "--agent",
            "scripted",
            "--agent-slug",
            slug,
            "--lease-seconds",
            f"{lease_seconds:g}",
            "--poll-seconds",
            "0.2",
            "--max-tries",
            "3",
        ]
        serial = 0

        def start_worker() -> None:
            nonlocal serial
            serial += 1
            name = f"demo-w{serial}"
            children.start(name, ["worker", "--name", name, *worker_args])
            say(f"started worker process {name}")

        for _ in range(workers):
            start_worker()

        seen: dict[str, tuple[RunStatus, int]] = {}
        cancelled: set[str] = set()
        deadline = started + timeout
        while True:
            current = {run_id: repo.get_run(run_id) for run_id in runs}
            for run_id, maybe_run in current.items():
                if maybe_run is None:
                    continue
                run = maybe_run
                n = len(repo.list_run_attempts(run_id))
                if seen.setdefault(run_id, (RunStatus.PENDING, 0)) != (run.status, n):
                    seen[run_id] = (run.status, n)
                    say(f"{runs[run_id].label:<28} {_describe(run, n)}")
                if (
                    runs[run_id].cancel_when_running
                    and run.status == RunStatus.RUNNING
                    and run_id not in cancelled
                ):
                    repo.request_cancel(run_id)
                    cancelled.add(run_id)
                    say(f"{runs[run_id].label:<28} cancel requested")
            for child in list(children.started):
                code = child.process.poll()
                if code is not None and not child.replaced and child.name != "reconciler":
                    child.replaced = True
                    say(f"worker process {child.name} died (exit code {code}); replacing it")
                    start_worker()
            if all(r is not None and r.is_terminal for r in current.values()):
                break
            if time.monotonic() > deadline:
                say(f"gave up after {timeout:g}s with runs still in flight")
                break
            time.sleep(0.2)

        say("every run is terminal; stopping the workers and the reconciler")
        children.stop_all(lease_seconds + 3.0)
        return _report(repo, runs, say)
    return 1  # pragma: no cover - ExitStack does not swallow exceptions


def _report(repo: AgentRunRepository, runs: dict[str, Scenario], say: Callable[[str], None]) -> int:
    print()
    mismatches = 0
    summary: list[tuple[str, str, str, str]] = []
    for run_id, scenario in runs.items():
        run = repo.get_run(run_id)
        assert run is not None
        attempts = repo.list_run_attempts(run_id)
        explanation = explain_run(run, attempts)
        got = f"{run.status}/{run.error_type}" if "/" in scenario.expect else str(run.status)
        ok = got == scenario.expect and explanation.explained
        mismatches += not ok
        summary.append(
            (scenario.label, " ".join(scenario.script), got, "ok" if ok else "UNEXPECTED")
        )
        print(f"== {scenario.label}: script {scenario.script} -> {got}")
        print(render_history(run, attempts, explanation))
        print()
    width = max(len(row[0]) for row in summary)
    for label, script, got, verdict in summary:
        print(f"  {label:<{width}}  {script:<20}  {got:<30}  {verdict}")
    print()
    say("done" if not mismatches else f"{mismatches} run(s) did not end as scripted")
    return 0 if not mismatches else 1


def _describe(run: AgentRun, attempts: int) -> str:
    if run.status in (RunStatus.RUNNING, RunStatus.CANCEL_REQUESTED):
        owner, _, token = (run.worker_id or "").rpartition(":")
        return f"{run.status} (attempt {attempts}, {owner}:{token[:6]})"
    if run.error_type:
        return f"{run.status} ({run.error_type}) after {attempts} attempt(s)"
    return f"{run.status} after {attempts} attempt(s)"


def demo_database(
    stack: ExitStack, dsn: str | None, say: Callable[[str], None], prefix: str
) -> str:
    """`dsn`, or an embedded PostgreSQL in a temporary directory (`prefix`) that `stack` stops;
    migrated either way."""
    if dsn is None:
        from agent_runs.devtools.embedded import embedded_postgres

        say("starting an embedded PostgreSQL in a temporary directory")
        with _signals_held():
            dsn = stack.enter_context(embedded_postgres(prefix=prefix)).url
    say("migrating: " + (", ".join(apply_migrations(dsn)) or "already up to date"))
    return dsn


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the children and the server are always stopped."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM while the server starts: an interrupt then cannot orphan a half-started
    server; it is delivered once the server's cleanup is registered. Child processes started
    meanwhile (initdb, pg_ctl) inherit the mask, so a Ctrl-C to the group cannot kill them halfway.
    """
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
