"""The benchmark's measurements other than throughput: protocol counts, heartbeats (HOT and
WAL), batched renewals, the reconciler, and claim latency as backlog and history grow."""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg

import agent_runs
from agent_runs import AgentRunRepository, RunStatus
from bench import seed
from bench.pgstats import TABLES, UpdateCounters, update_counters, wal_bytes_since, wal_lsn
from bench.protocol import traced
from bench.workload import LEASE_SECONDS, add_pending, make_client, new_worker_id

# -- statements per transition -----------------------------------------------------------------


def statement_counts(url: str, variant: str) -> dict[str, dict[str, Any]]:
    """Messages one steady-state call of each transition sends (after a warm-up lifecycle)."""
    with agent_runs.connect(url) as conn:
        add_pending(variant, conn, 2)
        client = make_client(variant, conn)
        worker = new_worker_id(variant, 0)
        run_id = client.claim(worker)  # warm-up: statements get prepared
        assert run_id is not None
        client.renew(run_id, worker)
        client.complete(run_id, worker)

        worker = new_worker_id(variant, 0)
        with traced(conn) as claim:
            run_id = client.claim(worker)
        assert run_id is not None
        with traced(conn) as renew:
            assert client.renew(run_id, worker)
        with traced(conn) as complete:
            assert client.complete(run_id, worker)
    return {"claim": claim.as_dict(), "renew": renew.as_dict(), "complete": complete.as_dict()}


def repository_extra_counts(url: str) -> dict[str, dict[str, Any]]:
    """Messages of renew_leases (a batch of 10) and of one reconcile_expired_leases batch."""
    with agent_runs.connect(url) as conn:
        repo = AgentRunRepository(conn)
        seed.seed_pending([conn], 10)
        leases = {}
        for _ in range(10):
            worker = new_worker_id("repository", 0)
            run = repo.claim_next(worker_id=worker, lease_seconds=LEASE_SECONDS)
            assert run is not None
            leases[run.id] = worker
        repo.renew_leases(leases, lease_seconds=LEASE_SECONDS)  # warm-up
        with traced(conn) as batch:
            renewed = repo.renew_leases(leases, lease_seconds=LEASE_SECONDS)
        assert len(renewed) == 10
        for run_id, worker in leases.items():
            repo.set_terminal_status(run_id, status=RunStatus.COMPLETED, worker_id=worker)
        seed.seed_expired_leases(conn, 5)
        with traced(conn) as reconcile:
            converged = repo.reconcile_expired_leases(limit=500)
        assert len(converged) == 5
    return {"renew_leases[10]": batch.as_dict(), "reconcile_batch": reconcile.as_dict()}


# -- heartbeats: HOT ratio and WAL of a renewal-only phase --------------------------------------


@dataclass
class HeartbeatResult:
    variant: str
    renewals: int
    seconds: float
    wal_bytes: int
    tables: dict[str, UpdateCounters]

    def as_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "renewals": self.renewals,
            "seconds": self.seconds,
            "wal_bytes_per_renewal": self.wal_bytes / self.renewals if self.renewals else None,
            "tables": {
                name: {
                    "updates": c.updates,
                    "hot_updates": c.hot,
                    "new_page_updates": c.new_page,
                    "hot_ratio": c.hot_ratio,
                }
                for name, c in self.tables.items()
            },
        }


def heartbeat_phase(
    url: str,
    variant: str,
    *,
    threads: int,
    held_per_thread: int,
    rounds: int,
    observer: psycopg.Connection[Any],
) -> HeartbeatResult:
    """Each thread claims runs and holds them, then renews every held lease `rounds` times.

    The update counters of both tables are read (every backend's stats flushed) right before
    and right after the renewals, so the deltas count lease renewals and nothing else.
    """
    seed.seed_pending([observer], threads * held_per_thread)
    gate = threading.Barrier(threads + 1)
    errors: list[BaseException] = []
    renewed = [0] * threads

    def work(index: int) -> None:
        try:
            with agent_runs.connect(url) as conn:
                client = make_client(variant, conn)
                held: list[tuple[str, str]] = []
                for _ in range(held_per_thread):
                    worker = new_worker_id(variant, index)
                    run_id = client.claim(worker)
                    assert run_id is not None, "the heartbeat phase ran out of pending runs"
                    held.append((run_id, worker))
                conn.execute("SELECT pg_stat_force_next_flush()")
                gate.wait()  # 1: counters read before
                gate.wait()  # 2: go
                for _ in range(rounds):
                    for run_id, worker in held:
                        if not client.renew(run_id, worker):
                            raise AssertionError(f"renewal of held run {run_id} refused")
                        renewed[index] += 1
                conn.execute("SELECT pg_stat_force_next_flush()")
                gate.wait()  # 3: renewals done, counters read after
                gate.wait()  # 4: release the runs
                for run_id, worker in held:
                    client.complete(run_id, worker)
        except BaseException as exc:
            errors.append(exc)
            gate.abort()

    workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    try:
        gate.wait()
        before = update_counters(observer)
        lsn = wal_lsn(observer)
        gate.wait()
        started = time.perf_counter()
        gate.wait()
        seconds = time.perf_counter() - started
        wal = wal_bytes_since(observer, lsn)
        after = update_counters(observer)
        gate.wait()
    except threading.BrokenBarrierError:
        for worker in workers:
            worker.join()
        raise errors[0] from None
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return HeartbeatResult(
        variant=variant,
        renewals=sum(renewed),
        seconds=seconds,
        wal_bytes=wal,
        tables={name: after[name].minus(before[name]) for name in TABLES},
    )


# -- renew_leases: renewals per second by batch size --------------------------------------------


def renew_batches(
    url: str, *, held: int, batch_sizes: tuple[int, ...], seconds: float
) -> list[dict[str, Any]]:
    """One connection holds `held` leases and renews all of them in batches, for `seconds` each."""
    results = []
    with agent_runs.connect(url) as conn:
        repo = AgentRunRepository(conn)
        seed.seed_pending([conn], held)
        leases: dict[str, str] = {}
        for _ in range(held):
            worker = new_worker_id("heartbeat", 0)
            run = repo.claim_next(worker_id=worker, lease_seconds=LEASE_SECONDS)
            assert run is not None
            leases[run.id] = worker
        items = list(leases.items())
        for size in batch_sizes:
            batches = [dict(items[i : i + size]) for i in range(0, len(items), size)]
            repo.renew_leases(batches[0], lease_seconds=LEASE_SECONDS)  # prepares the statement
            calls = renewals = 0
            latencies: list[float] = []
            started = time.perf_counter()
            deadline = started + seconds
            while time.perf_counter() < deadline:
                for batch in batches:
                    t0 = time.perf_counter()
                    renewed = repo.renew_leases(batch, lease_seconds=LEASE_SECONDS)
                    latencies.append(time.perf_counter() - t0)
                    if len(renewed) != len(batch):
                        raise AssertionError("a held lease was not renewed")
                    calls += 1
                    renewals += len(renewed)
            elapsed = time.perf_counter() - started
            results.append(
                {
                    "batch": size,
                    "calls": calls,
                    "renewals": renewals,
                    "seconds": elapsed,
                    "renewals_per_second": renewals / elapsed,
                    "calls_per_second": calls / elapsed,
                    "call_p50_ms": statistics.median(latencies) * 1000,
                }
            )
        for run_id, worker in items:
            repo.set_terminal_status(run_id, status=RunStatus.COMPLETED, worker_id=worker)
    return results


# -- the reconciler ------------------------------------------------------------------------------


def reconcile_phase(url: str, *, expired: int, limit: int = 500) -> dict[str, Any]:
    """Seed `expired` lost leases, then converge them with reconcile_expired_leases batches."""
    with agent_runs.connect(url) as conn:
        seed.seed_expired_leases(conn, expired)
        conn.execute("ANALYZE agent_runs")
        conn.execute("ANALYZE agent_run_attempts")
        repo = AgentRunRepository(conn)
        batch_seconds: list[float] = []
        converged = 0
        started = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            runs = repo.reconcile_expired_leases(limit=limit)
            batch_seconds.append(time.perf_counter() - t0)
            if not runs:
                break
            converged += len(runs)
        elapsed = time.perf_counter() - started
        row = conn.execute(
            "SELECT count(*) FROM agent_run_attempts WHERE finished_at IS NULL"
        ).fetchone()
        open_attempts = int(row[0]) if row else -1
    if converged != expired or open_attempts != 0:
        raise AssertionError(
            f"reconciler converged {converged} of {expired} runs, {open_attempts} attempts open"
        )
    work = batch_seconds[:-1] or batch_seconds  # the last call found nothing
    return {
        "expired_leases": expired,
        "limit": limit,
        "batches": len(work),
        "seconds": elapsed,
        "runs_per_second": converged / elapsed,
        "longest_batch_ms": max(work) * 1000,
        "median_batch_ms": statistics.median(work) * 1000,
    }


# -- claim_next latency as backlog and history grow -------------------------------------------


def seed_backlog(url: str, *, pending: int, finished: int, parallel: int = 2) -> float:
    """Bulk-seed history and a backlog (oldest first), then VACUUM ANALYZE; returns seconds."""
    started = time.perf_counter()
    conns = [agent_runs.connect(url) for _ in range(parallel)]
    try:
        seed.seed_history(conns, finished)
        seed.seed_pending(conns, pending, age_seconds=3600.0)
        # Settle the bulk load as autovacuum eventually would, so it does not run mid-measurement.
        conns[0].execute("VACUUM (ANALYZE) agent_runs")
        conns[0].execute("VACUUM (ANALYZE) agent_run_attempts")
    finally:
        for conn in conns:
            conn.close()
    return time.perf_counter() - started


def claim_latencies(
    urls: dict[str, str], *, claims: int, reps: int, warmup: int = 20
) -> dict[str, list[float]]:
    """Interleaved: claim_next timings on each database, `claims` at a time, `reps` times.

    Each claimed run is completed and a new pending run is queued (untimed), so the backlog
    keeps its size while it is measured.
    """
    timings: dict[str, list[float]] = {name: [] for name in urls}
    conns = {name: agent_runs.connect(url) for name, url in urls.items()}
    try:
        repos = {name: AgentRunRepository(conn) for name, conn in conns.items()}

        def one(name: str, record: bool) -> None:
            repo = repos[name]
            worker = new_worker_id("claim", 0)
            t0 = time.perf_counter()
            run = repo.claim_next(worker_id=worker, lease_seconds=LEASE_SECONDS)
            elapsed = time.perf_counter() - t0
            if run is None:
                raise AssertionError(f"the {name} backlog is empty")
            if record:
                timings[name].append(elapsed)
            repo.set_terminal_status(run.id, status=RunStatus.COMPLETED, worker_id=worker)
            key = uuid.uuid4().hex
            repo.create_run(
                thread_id=f"thread-{key}", agent_slug="agent-0", uid="user-0", request_id=key
            )

        for name in urls:
            for _ in range(warmup):
                one(name, record=False)
        for _ in range(reps):
            for name in urls:
                for _ in range(claims):
                    one(name, record=True)
    finally:
        for conn in conns.values():
            conn.close()
    return timings
