"""Claim latency with runs scheduled for later and runs over all ten priorities, against the
same backlog with nothing scheduled: a claim never reads runs that are not yet available.

Three databases, each with the same backlog of available runs:
- `plain`: the backlog at priority 0, nothing scheduled (the baseline), and as many finished
  runs as the others have scheduled ones (the same table size: only the schedule differs);
- `scheduled`: the backlog spread over priorities 0-9, plus `future` runs scheduled an hour
  ahead, spread over the ten priorities;
- `scheduled_top`: the backlog at priority 9 only, the future runs at 0-8: every claim passes
  nine priorities that hold only runs scheduled for later (the worst case of the order).
Each claimed run is completed and replaced by one of the same priority (untimed), so each
database keeps its shape while it is measured; the three are measured interleaved.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Final

import psycopg

import agent_runs
from agent_runs import AgentRunRepository, RunStatus
from bench.report import log, percentile
from bench.server import BenchServer

_SEED: Final = """
INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, priority, available_at,
                        created_at)
SELECT %(tag)s || i, %(tag)s || 'r' || i, %(tag)s || 't' || i, 'agent-0', 'user-0',
       CASE WHEN %(spread)s THEN mod(i, %(priorities)s) + %(lowest)s ELSE %(lowest)s END,
       now() + %(ahead)s * interval '1 second' + i * interval '1 millisecond',
       now() - interval '1 hour' + i * interval '1 millisecond'
FROM generate_series(1, %(count)s) AS i
"""

_FINISHED: Final = """
INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status, started_at,
                        finished_at, created_at)
SELECT 'done' || i, 'done-r' || i, 'done-t' || i, 'agent-0', 'user-0', 'completed',
       now() - interval '2 hours', now() - interval '2 hours',
       now() - interval '3 hours' + i * interval '1 millisecond'
FROM generate_series(1, %(count)s) AS i
"""

_SHAPES: Final = {
    # name: (backlog priorities (lowest, how many), future priorities (lowest, how many))
    "plain": ((0, 1), None),
    "scheduled": ((0, 10), (0, 10)),
    "scheduled_top": ((9, 1), (0, 9)),
}


def _seed(url: str, *, backlog: int, future: int, shape: Any) -> None:
    (low, count), scheduled = shape
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            _SEED,
            {"tag": "b", "spread": count > 1, "priorities": count, "lowest": low, "ahead": -3600,
             "count": backlog},
        )  # fmt: skip
        if scheduled is None:
            conn.execute(_FINISHED, {"count": future})
        else:
            flow, fcount = scheduled
            conn.execute(
                _SEED,
                {"tag": "f", "spread": True, "priorities": fcount, "lowest": flow, "ahead": 3600,
                 "count": future},
            )  # fmt: skip
        conn.execute("VACUUM (ANALYZE) agent_runs")


def schedule_phase(
    server: BenchServer, *, backlog: int, future: int, claims: int, reps: int
) -> dict[str, Any]:
    """p50/p99 claim latency of each shape and their ratios to `plain`."""
    urls = {}
    try:
        for name, shape in _SHAPES.items():
            log(f"schedule: seeding {name} ({backlog:,} available, {future:,} scheduled)")
            urls[name] = server.fresh_database(f"schedule_{name}")
            _seed(urls[name], backlog=backlog, future=future, shape=shape)
        timings = _measure(urls, claims=claims, reps=reps)
    finally:
        for url in urls.values():
            server.drop(url)
    out: dict[str, Any] = {"backlog": backlog, "future": future}
    for name, values in timings.items():
        out[name] = {
            "p50_ms": percentile(values, 50) * 1000,
            "p99_ms": percentile(values, 99) * 1000,
        }
    for name in ("scheduled", "scheduled_top"):
        out[f"ratio_p50_{name}"] = out[name]["p50_ms"] / out["plain"]["p50_ms"]
    return out


def _measure(urls: dict[str, str], *, claims: int, reps: int) -> dict[str, list[float]]:
    timings: dict[str, list[float]] = {name: [] for name in urls}
    conns = {name: agent_runs.connect(url) for name, url in urls.items()}
    try:
        repos = {name: AgentRunRepository(conn) for name, conn in conns.items()}

        def one(name: str, record: bool) -> None:
            repo = repos[name]
            worker = f"schedule:{uuid.uuid4().hex}"
            t0 = time.perf_counter()
            run = repo.claim_next(worker_id=worker, lease_seconds=60)
            elapsed = time.perf_counter() - t0
            if run is None:
                raise AssertionError(f"the {name} backlog is empty")
            if record:
                timings[name].append(elapsed)
            repo.set_terminal_status(run.id, status=RunStatus.COMPLETED, worker_id=worker)
            key = uuid.uuid4().hex
            repo.create_run(
                thread_id=f"thread-{key}",
                agent_slug="agent-0",
                uid="user-0",
                request_id=key,
                priority=run.priority,
            )

        for name in urls:
            for _ in range(20):
                one(name, record=False)
        for _ in range(reps):
            for name in urls:
                for _ in range(claims):
                    one(name, record=True)
    finally:
        for conn in conns.values():
            conn.close()
    return timings
