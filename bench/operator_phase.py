"""The operator phase: listings, statistics and retention over a large finished history.

Seeds finished runs with their attempts (INSERT … SELECT generate_series, in chunks), a small
backlog and a few lost leases, then times through the repository: `runs` by status, agent,
worker and --stuck, `stats --since 1h`, and a prune (runs/s and the longest batch) while a
claimer claims and completes a backlog (claim_next p50 during the prune vs before it).
Targets: every listing <= 20 ms, stats <= 200 ms, prune >= 5,000 runs/s, no batch over 500 ms,
claim_next p50 during a prune within 1.5x of before.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Final, LiteralString

import agent_runs
from agent_runs import AgentRunRepository

FULL_RUNS: Final = 1_000_000
QUICK_RUNS: Final = 2_000
CHUNK: Final = 100_000
SEED_BUDGET_SECONDS: Final = 120.0
REPEAT: Final = 15
PRUNE_OLDER_THAN: Final = timedelta(days=25)  # the oldest sixth of a 30-day history
PRUNE_BATCH: Final = 1000

# Finished runs over the last 30 days (one in ten failed after a retry: two attempts), by eight
# worker identities (host-7 loses leases). Parameters: first, last, total.
_HISTORY: Final[LiteralString] = """
WITH span AS (
    SELECT now() - interval '30 days' AS start, interval '30 days' / %(total)s AS step
),
runs AS (
    INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status, error_type,
                            started_at, finished_at, created_at, updated_at)
    SELECT 'op-' || i, 'op-req-' || i, 'thread-' || mod(i, 997), 'agent-' || mod(i, 4),
           'user-' || mod(i, 101),
           CASE WHEN mod(i, 10) = 0 THEN 'failed' ELSE 'completed' END,
           CASE WHEN mod(i, 10) = 0 THEN 'agent_error' END,
           span.start + i * span.step + interval '1 second',
           span.start + i * span.step + interval '30 seconds',
           span.start + i * span.step,
           span.start + i * span.step + interval '30 seconds'
    FROM generate_series(%(first)s::int, %(last)s::int) AS i, span
    RETURNING id, status, started_at, finished_at
),
retried AS (
    INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at, finished_at,
                                    outcome, error_type)
    SELECT id, 1, 'host-7:' || md5(id), started_at, started_at + interval '8 seconds',
           'lease_expired', 'worker_lease_expired'
    FROM runs WHERE status = 'failed'
)
INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at, finished_at,
                                outcome, error_type)
SELECT id, CASE WHEN status = 'failed' THEN 2 ELSE 1 END,
       'host-' || mod(hashtext(id), 8)::int::text || ':' || md5(id),
       started_at + interval '9 seconds', finished_at, status,
       CASE WHEN status = 'failed' THEN 'agent_error' END
FROM runs
"""

_LIVE: Final[LiteralString] = """
INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, created_at)
SELECT 'op-pending-' || i, 'op-pending-req-' || i, 'op-pending-' || i, 'agent-1', 'user-1',
       now() - i * interval '1 minute'
FROM generate_series(1, 200) AS i;
INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status, worker_id,
                        heartbeat_at, lease_expires_at, started_at)
SELECT 'op-lost-' || i, 'op-lost-req-' || i, 'op-lost-' || i, 'agent-2', 'user-2', 'running',
       'host-7:lost' || i, now() - interval '10 minutes', now() - interval '9 minutes',
       now() - interval '10 minutes'
FROM generate_series(1, 20) AS i
"""


def _seed(url: str, quick: bool) -> tuple[int, float]:
    """Seed the history; returns (runs seeded, seconds)."""
    target = QUICK_RUNS if quick else FULL_RUNS
    started = time.monotonic()
    seeded = 0
    with agent_runs.connect(url) as conn:
        conn.execute("SET synchronous_commit = off")
        while seeded < target:
            last = min(seeded + CHUNK, target)
            conn.execute(_HISTORY, {"first": seeded + 1, "last": last, "total": target})
            seeded = last
            elapsed = time.monotonic() - started
            # Too slow for the full size on this machine: settle for the first chunk.
            if not quick and seeded == CHUNK and elapsed * FULL_RUNS / CHUNK > SEED_BUDGET_SECONDS:
                break
        conn.execute(_LIVE)
        conn.execute("VACUUM ANALYZE agent_runs")
        conn.execute("VACUUM ANALYZE agent_run_attempts")
    return seeded, time.monotonic() - started


def _timed(call: Callable[[], object], repeat: int) -> dict[str, float]:
    call()  # warm-up: statements prepared, pages cached
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1000)
    return {"p50_ms": statistics.median(samples), "max_ms": max(samples)}


def run_phase(url: str, quick: bool) -> dict[str, Any]:
    """Seed `url` (a migrated, empty database) and measure; see the module docstring."""
    seeded, seed_seconds = _seed(url, quick)
    repeat = 3 if quick else REPEAT
    result: dict[str, Any] = {"runs": seeded, "seed_seconds": seed_seconds, "listings": {}}
    with agent_runs.connect(url) as conn:
        repo = AgentRunRepository(conn)
        listings: dict[str, Callable[[], object]] = {
            "status": lambda: repo.list_runs(statuses=["failed"]),
            "agent": lambda: repo.list_runs(agent_slug="agent-2"),
            "worker": lambda: repo.list_runs(worker="host-7"),
            "worker+status": lambda: repo.list_runs(worker="host-3", statuses=["completed"]),
            "stuck": lambda: repo.list_runs(stuck=True),
            "since 1h": lambda: repo.list_runs(since=timedelta(hours=1)),
        }
        for name, call in listings.items():
            result["listings"][name] = _timed(call, repeat)
        result["stats_1h"] = _timed(lambda: repo.run_stats(since=timedelta(hours=1)), repeat)

        conn.execute(_BACKLOG, {"count": 2_000 if quick else 20_000})
        with agent_runs.connect(url) as claimer_conn:
            claimer = AgentRunRepository(claimer_conn)
            _claims_for(claimer, 0.2)  # warm: prepared statements, caches
            before = _claims_for(claimer, 0.5 if quick else 2.0)
            result["claims_before_prune"] = _summary(before)
            during: list[float] = []
            stop = threading.Event()
            thread = threading.Thread(target=_claim_until, args=(claimer, stop, during))
            thread.start()
            try:
                result["prune"] = _prune(repo)
            finally:
                stop.set()
                thread.join()
            result["claims_during_prune"] = _summary(during)
    return result


def _prune(repo: AgentRunRepository) -> dict[str, Any]:
    batches: list[float] = []
    pruned = 0
    started = time.perf_counter()
    batch_started = started
    for batch in repo.prune_batches(older_than=PRUNE_OLDER_THAN, batch_size=PRUNE_BATCH):
        now = time.perf_counter()
        batches.append((now - batch_started) * 1000)
        batch_started = now
        pruned += batch.runs
    seconds = time.perf_counter() - started
    return {
        "runs": pruned,
        "seconds": seconds,
        "runs_per_s": pruned / seconds if seconds else 0.0,
        "batches": len(batches),
        "longest_batch_ms": max(batches, default=0.0),
    }


# Pending runs for the claim-latency comparison (recent: no prune ever takes them).
_BACKLOG: Final[LiteralString] = """
INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, created_at)
SELECT 'pend-' || i, 'pend-req-' || i, 'pend-thread-' || i, 'agent-9', 'user',
       now() - interval '1 minute' + i * interval '1 millisecond'
FROM generate_series(1, %(count)s::int) AS i
"""


def _claim_until(repo: AgentRunRepository, stop: threading.Event, latencies: list[float]) -> None:
    """claim_next + completion in a loop until `stop`; each claim's latency in ms."""
    while not stop.is_set():
        started = time.perf_counter()
        run = repo.claim_next(worker_id="bench-claimer:1", lease_seconds=60)
        if run is None:
            return
        latencies.append((time.perf_counter() - started) * 1000)
        repo.set_terminal_status(run.id, status="completed", worker_id="bench-claimer:1")


def _claims_for(repo: AgentRunRepository, seconds: float) -> list[float]:
    latencies: list[float] = []
    stop = threading.Event()
    thread = threading.Thread(target=_claim_until, args=(repo, stop, latencies))
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join()
    return latencies


def _summary(latencies: list[float]) -> dict[str, Any]:
    if not latencies:
        return {"claims": 0, "p50_ms": float("nan")}
    return {"claims": len(latencies), "p50_ms": statistics.median(latencies)}


def render_phase(result: dict[str, Any]) -> list[str]:
    lines = [
        f"operator phase: {result['runs']:,} finished runs seeded in "
        f"{result['seed_seconds']:.1f} s (targets: listings <= 20 ms, stats <= 200 ms, "
        "prune >= 5,000 runs/s, batches <= 500 ms)",
    ]
    for name, timing in result["listings"].items():
        ok = "ok" if timing["p50_ms"] <= 20 else "OVER"
        lines.append(
            f"  runs {name:<14} p50 {timing['p50_ms']:7.2f} ms  max {timing['max_ms']:7.2f} ms"
            f"  {ok}"
        )
    stats = result["stats_1h"]
    ok = "ok" if stats["p50_ms"] <= 200 else "OVER"
    lines.append(
        f"  stats --since 1h    p50 {stats['p50_ms']:7.2f} ms  max {stats['max_ms']:7.2f} ms  {ok}"
    )
    prune = result["prune"]
    ok = "ok" if prune["runs_per_s"] >= 5000 and prune["longest_batch_ms"] <= 500 else "OVER"
    lines.append(
        f"  prune               {prune['runs']:,} runs in {prune['seconds']:.1f} s = "
        f"{prune['runs_per_s']:,.0f} runs/s, {prune['batches']} batches, longest "
        f"{prune['longest_batch_ms']:.0f} ms  {ok}"
    )
    before, during = result["claims_before_prune"], result["claims_during_prune"]
    ratio = during["p50_ms"] / before["p50_ms"]
    lines.append(
        f"  claim_next p50      {before['p50_ms']:.2f} ms before a prune ({before['claims']} "
        f"claims), {during['p50_ms']:.2f} ms during it ({during['claims']} claims): "
        f"{ratio:.2f}x  {'ok' if ratio <= 1.5 else 'OVER'}"
    )
    return lines
