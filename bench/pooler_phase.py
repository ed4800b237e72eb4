"""The repository through PgBouncer (transaction mode) beside the direct connection.

Three warm clients on one migrated database, measured in interleaved slices in the same run:
direct, through PgBouncer with default settings, and through PgBouncer with
`prepare_threshold=None`. Each lifecycle is claim + renewals + complete (bench.workload).
"""

from __future__ import annotations

import time
from typing import Any, Final

import psycopg

import agent_runs
from agent_runs.devtools.pgbouncer import pgbouncer, pgbouncer_binary
from bench import seed
from bench.workload import (
    RENEWALS_PER_LIFECYCLE,
    BacklogExhausted,
    RepositoryClient,
    lifecycle,
    new_worker_id,
)

VARIANTS: Final = ("direct", "pgbouncer", "pgbouncer, prepare_threshold=None")
_LOW_WATER: Final = 3_000
_REFILL: Final = 6_000


def _slice(client: RepositoryClient, variant: str, seconds: float) -> int:
    worker = new_worker_id("repository", 0)
    done = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        try:
            lifecycle(client, worker)
        except BacklogExhausted:  # pragma: no cover - refilled before every slice
            raise AssertionError(f"{variant}: the backlog ran out mid-slice") from None
        done += 1
    return done


def run_phase(direct_url: str, quick: bool) -> dict[str, Any]:
    """Lifecycles per second of each variant, interleaved slices; `direct_url` is a migrated
    database (its runs are consumed). Skipped (with the reason) without a pgbouncer binary."""
    if pgbouncer_binary() is None:
        return {"skipped": "pgbouncer is not installed"}
    slices, seconds = (3, 0.5) if quick else (8, 2.0)
    counts = dict.fromkeys(VARIANTS, 0)
    elapsed = dict.fromkeys(VARIANTS, 0.0)
    with pgbouncer(direct_url, mode="transaction", pool_size=2) as bouncer:
        through = bouncer.url_for(direct_url)
        conns: dict[str, psycopg.Connection[Any]] = {
            VARIANTS[0]: agent_runs.connect(direct_url),
            VARIANTS[1]: agent_runs.connect(through),
            VARIANTS[2]: agent_runs.connect(through, prepare_threshold=None),
        }
        try:
            with agent_runs.connect(direct_url) as admin:
                clients = {v: RepositoryClient(c) for v, c in conns.items()}
                seed.seed_pending([admin], _REFILL)
                for client in clients.values():  # warm-up: statements, caches
                    for _ in range(20):
                        lifecycle(client, new_worker_id("repository", 0))
                for _ in range(slices):
                    for variant, client in clients.items():
                        if seed.count_pending(admin) < _LOW_WATER:
                            seed.seed_pending([admin], _REFILL)
                        started = time.perf_counter()
                        counts[variant] += _slice(client, variant, seconds)
                        elapsed[variant] += time.perf_counter() - started
        finally:
            for conn in conns.values():
                conn.close()
    rates = {v: counts[v] / elapsed[v] if elapsed[v] else 0.0 for v in VARIANTS}
    direct = rates[VARIANTS[0]] or 1.0
    return {
        "renewals_per_lifecycle": RENEWALS_PER_LIFECYCLE,
        "slices": slices,
        "slice_seconds": seconds,
        "lifecycles": counts,
        "per_second": rates,
        "vs_direct": {v: rates[v] / direct for v in VARIANTS},
    }


def render_phase(result: dict[str, Any]) -> list[str]:
    """Human lines for the report."""
    if "skipped" in result:
        return [f"through PgBouncer: skipped ({result['skipped']})"]
    lines = [
        "repository through PgBouncer 1.x, transaction mode, default settings "
        f"(claim + {result['renewals_per_lifecycle']} renewals + complete, one client each, "
        f"{result['slices']} interleaved slices of {result['slice_seconds']} s):"
    ]
    for variant in VARIANTS:
        lines.append(
            f"  {variant:<36} {result['per_second'][variant]:>9.0f} lifecycles/s"
            f"  x{result['vs_direct'][variant]:.2f} of direct"
        )
    return lines
