"""Drain rate: one idle `agent-runs worker` process (16 threads) and a burst, beside PgQueuer
and Procrastinate on the same server in the same run.

Each queue has its own database on the bench server, its schema installed by its own tool:
- agent-runs: `agent-runs worker --concurrency 16` with a no-op agent and a WARNING log, once
  per completion mode when the CLI has `--completion` (durable, the default, and async);
- agent-runs as a user runs it (bench.drain_cli): the same command with every other option at
  its default (the scripted agent, the INFO log to a file), its runs created by `create_runs`
  and released by one COMMIT; once per completion mode too;
- PgQueuer: `pgq run` with `--batch-size 16` (its fetch batching), the asyncpg driver and a
  no-op entrypoint (bench.drain_pgqueuer);
- Procrastinate: `procrastinate worker --concurrency 16` with a no-op async task
  (bench.drain_procrastinate).

The queues take turns, the order rotating with each repetition. In its turn a queue's worker
process is started, waits until it LISTENs, and settles (idle and ready); then all the jobs are
enqueued at once, in one transaction (agent-runs: INSERT … generate_series, which sends no
wake-ups, then one notification per claimer thread; as a user runs it: `create_runs` in
chunks of 1,000 in one transaction, whose commit wakes the worker once per agent slug; the
others through their own bulk enqueue, whose commit notifies their worker). The drain time
runs on the database clock from that commit to the completion time the queue records for its
last job (agent-runs: the run's `finished_at`; PgQueuer: its log row's `created`;
Procrastinate: its `succeeded` event's `at`); it is also polled every 50 ms. Then the worker
is stopped by its PID. Median of the repetitions. PgQueuer and Procrastinate come with
`pip install 'agent_runs[compare]'` (`make bench` installs them); where they are not
installed they are left out, with the reason.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from typing import Any, Final

from agent_runs import AgentRun
from agent_runs.worker import AgentResult, RunContext
from bench.drain_cli import user_queue
from bench.drain_queues import (
    CONCURRENCY,
    PGQUEUER_BATCH,
    ROOT,
    Queue,
    Sizes,
    agent_runs_queue,
    drop_database,
    other_queue,
    sibling_database,
    turn,
)
from bench.report import fmt, median, table

OTHERS: Final = ("pgqueuer", "procrastinate")
LABELS: Final = {
    "agent_runs": "agent-runs worker",
    "agent_runs_durable": "agent-runs worker, durable",
    "agent_runs_async": "agent-runs worker, async",
    "agent_runs_cli_durable": "agent-runs worker as a user runs it, durable",
    "agent_runs_cli_async": "agent-runs worker as a user runs it, async",
    "pgqueuer": "PgQueuer",
    "procrastinate": "Procrastinate",
}


# Five turns: the first of each queue runs on a cold server (a third slower, for every queue).
FULL: Final = Sizes(runs=3_000, reps=5, settle=1.0)
QUICK: Final = Sizes(runs=200, reps=1, settle=0.3)


def noop(run: AgentRun, ctx: RunContext) -> AgentResult:
    """The drain's agent: does nothing and completes."""
    return AgentResult.completed()


def run_phase(url: str, quick: bool) -> dict[str, Any]:
    """Measure on `url`, a fresh migrated database this phase may fill (postgresql:// URL); the
    other queues get databases of their own beside it, dropped afterwards."""
    sizes = QUICK if quick else FULL
    queues: list[Queue] = []
    skipped: dict[str, str] = {}
    siblings: list[str] = []
    modes = completion_modes()
    for mode in modes:
        queues.append(agent_runs_queue(url, mode))
    if modes[0] is not None:  # a CLI from before --completion: the first variant alone
        queues.extend(user_queue(url, mode) for mode in modes)
    try:
        for name in OTHERS:
            if importlib.util.find_spec(name) is None:
                skipped[name] = "not installed (pip install 'agent_runs[compare]')"
                continue
            try:
                sibling = sibling_database(url, name)
                siblings.append(sibling)
                queues.append(other_queue(name, sibling))
            except Exception as exc:  # another queue failing to set up keeps ours
                skipped[name] = f"not measured: {type(exc).__name__}: {exc}"
        for rep in range(sizes.reps):
            shift = rep % len(queues)
            for queue in queues[shift:] + queues[:shift]:
                if queue.key in skipped:
                    continue
                try:
                    queue.repetitions.append(turn(queue, sizes))
                except Exception as exc:
                    if queue.key not in OTHERS:
                        raise
                    skipped[queue.key] = f"failed: {type(exc).__name__}: {exc}"
        queues = [q for q in queues if q.key not in skipped]
    finally:
        for sibling in siblings:
            drop_database(url, sibling)
    return _summary(queues, skipped, sizes, modes)


def completion_modes() -> tuple[str | None, ...]:
    """The worker's `--completion` modes when its CLI has the option, else the default only."""
    out = subprocess.run(
        [sys.executable, "-m", "agent_runs", "worker", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    ).stdout
    return ("durable", "async") if "--completion" in out else (None,)


def _summary(
    queues: list[Queue], skipped: dict[str, str], sizes: Sizes, modes: tuple[str | None, ...]
) -> dict[str, Any]:
    measured: dict[str, dict[str, Any]] = {
        q.key: {
            "label": LABELS[q.key],
            "settings": q.settings,
            "runs_per_second": median([r["runs_per_second"] for r in q.repetitions]),
            "polled_runs_per_second": median([r["polled_runs_per_second"] for r in q.repetitions]),
            "server_cpu_us_per_job": _median_known(q.repetitions, "server_cpu_us_per_job"),
            "worker_cpu_us_per_job": _median_known(q.repetitions, "worker_cpu_us_per_job"),
            "repetitions": q.repetitions,
        }
        for q in queues
    }
    ours_key = "agent_runs_durable" if modes[0] else "agent_runs"
    ours = measured[ours_key]
    nan = float("nan")
    pgqueuer = measured.get("pgqueuer", {"runs_per_second": nan, "repetitions": []})
    ratios: dict[str, float] = {}
    per_repetition: dict[str, list[float]] = {}
    for key, name in (
        ("durable_over_pgqueuer", ours_key),
        ("async_over_pgqueuer", "agent_runs_async"),
        ("cli_durable_over_pgqueuer", "agent_runs_cli_durable"),
        ("cli_async_over_pgqueuer", "agent_runs_cli_async"),
    ):
        if name in measured:
            ratios[key] = measured[name]["runs_per_second"] / pgqueuer["runs_per_second"]
            per_repetition[key] = [  # within a repetition the queues ran back to back
                a["runs_per_second"] / b["runs_per_second"]
                for a, b in zip(
                    measured[name]["repetitions"], pgqueuer["repetitions"], strict=False
                )
            ]
    return {
        "runs": sizes.runs,
        "concurrency": CONCURRENCY,
        "pgqueuer_batch_size": PGQUEUER_BATCH,
        "completion_modes": [m or "default" for m in modes],
        "queues": measured,
        "skipped": skipped,
        "ratios": ratios,
        "ratios_per_repetition": per_repetition,
        # the durable worker's, as reported before the other queues were measured
        "runs_per_second": ours["runs_per_second"],
        "polled_runs_per_second": ours["polled_runs_per_second"],
        "repetitions": ours["repetitions"],
    }


def _median_known(repetitions: list[dict[str, Any]], key: str) -> float | None:
    known = [r[key] for r in repetitions if r.get(key) is not None]
    return median(known) if known else None


def render_phase(result: dict[str, Any]) -> list[str]:
    """The phase's lines for the bench report."""
    queues = result.get("queues")
    if queues is None:  # a result written before the other queues were measured
        queues = {"agent_runs": {**result, "label": LABELS["agent_runs"], "settings": ""}}
    rows = [
        [
            q["label"],
            fmt(q["runs_per_second"]),
            fmt(q["polled_runs_per_second"]),
            _us(q.get("server_cpu_us_per_job")),
            _us(q.get("worker_cpu_us_per_job")),
            ", ".join(fmt(r["runs_per_second"]) for r in q["repetitions"]),
            q["settings"],
        ]
        for q in queues.values()
    ]
    skipped = result.get("skipped", {}).items()
    rows += [[LABELS[name], "-", "-", "-", "-", "", why] for name, why in skipped]
    ratios = result.get("ratios", {})
    reps = max(len(q["repetitions"]) for q in queues.values())
    lines = [
        f"Drain: one idle worker process per queue, {result['runs']:,} jobs enqueued at once, "
        f"queues in turns (median of {reps}):",
        table(
            [
                "queue",
                "jobs/s (db clock)",
                "jobs/s (polled)",
                "server CPU µs/job",
                "worker CPU µs/job",
                "repetitions",
                "settings",
            ],
            rows,
        ),
        "  CPU per job: /proc of the worker process, and of its connections' backends (not of the"
        " enqueue, nor of this phase's own observing connection); '-' where not readable",
    ]
    for key, label in (
        ("durable_over_pgqueuer", "agent-runs (durable) ÷ PgQueuer"),
        ("async_over_pgqueuer", "agent-runs (async) ÷ PgQueuer"),
        ("cli_durable_over_pgqueuer", "agent-runs as a user runs it (durable) ÷ PgQueuer"),
        ("cli_async_over_pgqueuer", "agent-runs as a user runs it (async) ÷ PgQueuer"),
    ):
        if key in ratios:
            each = result.get("ratios_per_repetition", {}).get(key, [])
            by_rep = f" (by repetition: {', '.join(fmt(r, 'x') for r in each)})" if each else ""
            lines.append(f"  {label}: {fmt(ratios[key], 'x')}{by_rep}")
    pgqueuer_cpu = queues.get("pgqueuer", {}).get("server_cpu_us_per_job")
    for key, label in (
        ("agent_runs_durable", "agent-runs (durable)"),
        ("agent_runs_async", "agent-runs (async)"),
        ("agent_runs_cli_durable", "agent-runs as a user runs it (durable)"),
        ("agent_runs_cli_async", "agent-runs as a user runs it (async)"),
    ):
        ours_cpu = queues.get(key, {}).get("server_cpu_us_per_job")
        if ours_cpu and pgqueuer_cpu:
            lines.append(
                f"  server CPU per job, {label} ÷ PgQueuer: {fmt(ours_cpu / pgqueuer_cpu, 'x')}"
            )
    return lines


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
