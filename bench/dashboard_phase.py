"""The dashboard phase: server time per page at 1,000,000 finished runs and 10,000 live ones.

Seeds the operator phase's 30-day history (falling back to its smaller size when seeding would
take too long here) plus 10,000 running runs with open attempts and a sub-agent tree, then
requests every page and the common filters through the ASGI app in process (Starlette's
TestClient: routing, the READ ONLY transaction, the queries, rendering; no network) and
reports p50 and p99 per page. Targets: p50 <= 50 ms, p99 <= 200 ms.
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any, Final, LiteralString

import agent_runs
from bench import operator_phase

LIVE_RUNS: Final = 10_000
QUICK_LIVE_RUNS: Final = 200
REPEAT: Final = 40
QUICK_REPEAT: Final = 3
P50_TARGET_MS: Final = 50.0
P99_TARGET_MS: Final = 200.0

_LIVE: Final[LiteralString] = """
WITH live AS (
    INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status, worker_id,
                            heartbeat_at, lease_expires_at, started_at, created_at,
                            created_by_run_id)
    SELECT 'dash-live-' || i, 'dash-live-req-' || i, 'dash-live-' || i, 'agent-' || mod(i, 4),
           'user-' || mod(i, 101), 'running',
           'host-' || mod(i, 8) || ':live' || i, now(), now() + interval '5 minutes',
           now() - interval '1 minute', now() - interval '2 minutes' + i * interval '1 ms',
           CASE WHEN i > 1 AND i <= 200 THEN 'dash-live-' || (i / 2) END
    FROM generate_series(1, %(count)s::int) AS i
    RETURNING id, worker_id, heartbeat_at, lease_expires_at, started_at
)
INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at, heartbeat_at,
                                lease_expires_at)
SELECT id, 1, worker_id, started_at, heartbeat_at, lease_expires_at FROM live
"""


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_phase(url: str, quick: bool) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Starlette's notice that it prefers httpx2 to httpx
        from starlette.testclient import TestClient

    from agent_runs.dashboard import create_app

    seeded, seed_seconds = operator_phase._seed(url, quick)
    live = QUICK_LIVE_RUNS if quick else LIVE_RUNS
    with agent_runs.connect(url) as conn:
        conn.execute(_LIVE, {"count": live})
        conn.execute("VACUUM ANALYZE agent_runs")
        conn.execute("VACUUM ANALYZE agent_run_attempts")
        repo = agent_runs.AgentRunRepository(conn)
        finished = repo.list_runs(statuses=["failed"], limit=1)[0].id
        second_page = agent_runs.runs_cursor(repo.list_runs(limit=50)[-1])
    repeat = QUICK_REPEAT if quick else REPEAT
    pages = {
        "overview": "/",
        "runs": "/runs",
        "runs page 2": f"/runs?before={second_page}",
        "runs status=failed": "/runs?status=failed",
        "runs status=running": "/runs?status=running",
        "runs agent_slug": "/runs?agent_slug=agent-2",
        "runs worker": "/runs?worker=host-7",
        "runs stuck": "/runs?stuck=1",
        "runs since=1h": "/runs?since=1h",
        "run (finished)": f"/runs/{finished}",
        "run (live, tree)": "/runs/dash-live-2",
        "workers": "/workers",
        "healthz": "/healthz",
    }
    timings: dict[str, dict[str, float]] = {}
    with (
        agent_runs.create_pool(url, min_size=2, max_size=4) as pool,
        TestClient(create_app(pool), raise_server_exceptions=True) as client,
    ):
        for name, path in pages.items():
            response = client.get(path)  # warm-up: caches, the pool
            assert response.status_code == 200, (name, response.status_code)
            samples = []
            for _ in range(repeat):
                started = time.perf_counter()
                client.get(path)
                samples.append((time.perf_counter() - started) * 1000)
            timings[name] = {
                "p50_ms": statistics.median(samples),
                "p99_ms": _percentile(samples, 0.99),
                "bytes": len(response.content),
            }
    return {"runs": seeded, "live": live, "seed_seconds": seed_seconds, "pages": timings}


def render_phase(result: dict[str, Any]) -> list[str]:
    lines = [
        f"dashboard phase: {result['runs']:,} finished + {result['live']:,} live runs "
        f"(seeded in {result['seed_seconds']:.1f} s); server time per page, in process "
        f"(targets: p50 <= {P50_TARGET_MS:.0f} ms, p99 <= {P99_TARGET_MS:.0f} ms)",
    ]
    for name, t in result["pages"].items():
        ok = t["p50_ms"] <= P50_TARGET_MS and t["p99_ms"] <= P99_TARGET_MS
        lines.append(
            f"  {name:<20} p50 {t['p50_ms']:7.2f} ms  p99 {t['p99_ms']:7.2f} ms  "
            f"{t['bytes'] / 1024:6.1f} KiB  {'ok' if ok else 'OVER'}"
        )
    return lines
