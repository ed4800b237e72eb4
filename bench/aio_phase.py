"""The asyncio repository beside the synchronous one: lifecycle rates and an awaited run.

Lifecycles (claim + renewals + complete, bench.workload's) of AgentRunRepository and of
agent_runs.aio.AsyncAgentRunRepository, one client each on one database, in interleaved slices
of the same run: the ratio is the price of the async face (a lone unprepared statement per
transition, psycopg's async I/O) against the sync face's pipelined, prepared transport. Then
the round trip an asyncio web handler sees: `await create_run(...)` then `await
aio.wait_for_run(...)` while an `agent-runs worker` process (scripted agent, woken by NOTIFY)
executes the run.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any, Final

import agent_runs
from agent_runs import RunStatus, aio
from bench import seed
from bench.pickup_phase import _workers
from bench.report import fmt, median, percentile
from bench.workload import (
    LEASE_SECONDS,
    RENEWALS_PER_LIFECYCLE,
    RepositoryClient,
    lifecycle,
    new_worker_id,
)

FACES: Final = ("sync", "async")
_LOW_WATER: Final = 3_000
_REFILL: Final = 6_000


async def _async_lifecycles(repo: aio.AsyncAgentRunRepository, seconds: float) -> int:
    """bench.workload.lifecycle's three transitions, awaited, for `seconds`."""
    worker = new_worker_id("repository", 0)
    done = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        run = await repo.claim_next(worker_id=worker, lease_seconds=LEASE_SECONDS)
        if run is None:
            raise AssertionError("async: the backlog ran out mid-slice")
        for _ in range(RENEWALS_PER_LIFECYCLE):
            assert await repo.renew_lease(run.id, worker_id=worker, lease_seconds=LEASE_SECONDS)
        ended = await repo.set_terminal_status(run.id, status=RunStatus.COMPLETED, worker_id=worker)
        assert ended.changed
        done += 1
    return done


def _sync_lifecycles(client: RepositoryClient, seconds: float) -> int:
    worker = new_worker_id("repository", 0)
    done = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        lifecycle(client, worker)
        done += 1
    return done


def _rates(url: str, slices: int, seconds: float) -> dict[str, Any]:
    counts = dict.fromkeys(FACES, 0)
    elapsed = dict.fromkeys(FACES, 0.0)
    with (
        asyncio.Runner() as runner,
        agent_runs.connect(url) as admin,
        agent_runs.connect(url) as conn,
    ):
        aconn = runner.run(aio.connect(url))
        try:
            arepo = aio.AsyncAgentRunRepository(aconn)
            client = RepositoryClient(conn)
            slice_of: dict[str, Callable[[float], int]] = {
                "sync": lambda s: _sync_lifecycles(client, s),
                "async": lambda s: runner.run(_async_lifecycles(arepo, s)),
            }
            seed.seed_pending([admin], _REFILL)
            for face in FACES:  # warm-up: statements, caches
                slice_of[face](0.2)
            for _ in range(slices):
                for face in FACES:
                    if seed.count_pending(admin) < _LOW_WATER:
                        seed.seed_pending([admin], _REFILL)
                    started = time.perf_counter()
                    counts[face] += slice_of[face](seconds)
                    elapsed[face] += time.perf_counter() - started
            admin.execute("DELETE FROM agent_runs WHERE status = 'pending'")  # none for below
        finally:
            runner.run(aconn.close())
    rates = {f: counts[f] / elapsed[f] if elapsed[f] else 0.0 for f in FACES}
    return {
        "lifecycles": counts,
        "per_second": rates,
        "async_over_sync": rates["async"] / rates["sync"] if rates["sync"] else 0.0,
    }


async def _round_trips(url: str, samples: int) -> list[float]:
    """Seconds from create_run's call to wait_for_run's answer, one run at a time."""
    async with await aio.connect(url) as conn, await aio.connect(url) as waiter:
        repo = aio.AsyncAgentRunRepository(conn)
        took = []
        for _ in range(samples):
            key = uuid.uuid4().hex
            started = time.perf_counter()
            run = await repo.create_run(
                thread_id=f"aio-{key}",
                agent_slug="bench-aio",
                uid="bench",
                request_id=f"aio-{key}",
                input_payload={"script": ["ok"]},
            )
            done = await aio.wait_for_run(waiter, run.id, timeout_seconds=30)
            took.append(time.perf_counter() - started)
            assert done.status == RunStatus.COMPLETED, done
        return took


def run_phase(url: str, quick: bool) -> dict[str, Any]:
    """Measure on `url`, a fresh migrated database this phase may fill."""
    slices, seconds, samples = (3, 0.3, 10) if quick else (8, 2.0, 100)
    result = {
        "renewals_per_lifecycle": RENEWALS_PER_LIFECYCLE,
        "slices": slices,
        "slice_seconds": seconds,
        **_rates(url, slices, seconds),
    }
    with _workers(url, 1, "aio"):
        asyncio.run(_round_trips(url, 3))  # warm-up: the worker is up and listening
        took = asyncio.run(_round_trips(url, samples))
    result["round_trip"] = {
        "samples": samples,
        "p50_ms": median(took) * 1000,
        "p95_ms": percentile(took, 95) * 1000,
        "max_ms": max(took) * 1000,
    }
    return result


def render_phase(result: dict[str, Any]) -> list[str]:
    """Human lines for the report."""
    trip = result["round_trip"]
    return [
        "asyncio repository beside the sync one (claim + "
        f"{result['renewals_per_lifecycle']} renewals + complete, one client each, "
        f"{result['slices']} interleaved slices of {result['slice_seconds']} s):",
        f"  sync   {result['per_second']['sync']:>9.0f} lifecycles/s",
        f"  async  {result['per_second']['async']:>9.0f} lifecycles/s"
        f"  x{result['async_over_sync']:.2f} of sync (no target)",
        f"  await create_run + aio.wait_for_run, one agent-runs worker: p50 "
        f"{fmt(trip['p50_ms'])} ms, p95 {fmt(trip['p95_ms'])} ms, max {fmt(trip['max_ms'])} ms "
        f"({trip['samples']} runs)",
    ]
