"""The lifecycle under test (claim → 3 × renew → complete) and the threaded segment runner.

Two clients implement the same three calls: the real AgentRunRepository, and the floor's
hand-minimal statements. Each benchmark thread owns one autocommit connection.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import psycopg

import agent_runs
from agent_runs import AgentRunRepository, RunStatus
from bench.floor import FloorClient, FloorInTransactionClient
from bench.pgstats import wal_bytes_since, wal_lsn

LEASE_SECONDS: Final = 60.0
RENEWALS_PER_LIFECYCLE: Final = 3
TRANSITIONS: Final = ("claim", "renew", "complete")
VARIANTS: Final = ("repository", "floor")
# Throughput also runs a diagnostic: the floor's statements in explicit transactions.
THROUGHPUT_VARIANTS: Final = ("repository", "floor", "floor_tx")


class LifecycleClient(Protocol):
    """The three transitions of the benchmark lifecycle, over one connection."""

    conn: psycopg.Connection[Any]

    def claim(self, worker_id: str) -> str | None: ...

    def renew(self, run_id: str, worker_id: str) -> bool: ...

    def complete(self, run_id: str, worker_id: str) -> bool: ...


class RepositoryClient:
    """The real thing: claim_next, renew_lease, set_terminal_status(completed)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.repo = AgentRunRepository(conn)

    def claim(self, worker_id: str) -> str | None:
        run = self.repo.claim_next(worker_id=worker_id, lease_seconds=LEASE_SECONDS)
        return None if run is None else run.id

    def renew(self, run_id: str, worker_id: str) -> bool:
        return self.repo.renew_lease(run_id, worker_id=worker_id, lease_seconds=LEASE_SECONDS)

    def complete(self, run_id: str, worker_id: str) -> bool:
        result = self.repo.set_terminal_status(
            run_id, status=RunStatus.COMPLETED, worker_id=worker_id
        )
        return result.changed


class FloorLifecycleClient:
    """The floor's single prepared autocommit statements (or, with in_transaction, the same
    statements each in BEGIN … COMMIT sent as one message: a diagnostic)."""

    def __init__(self, conn: psycopg.Connection[Any], *, in_transaction: bool = False) -> None:
        self.conn = conn
        self.floor: FloorClient | FloorInTransactionClient = (
            FloorInTransactionClient(conn) if in_transaction else FloorClient(conn)
        )

    def claim(self, worker_id: str) -> str | None:
        return self.floor.claim(worker_id, LEASE_SECONDS)

    def renew(self, run_id: str, worker_id: str) -> bool:
        return self.floor.renew(run_id, worker_id, LEASE_SECONDS)

    def complete(self, run_id: str, worker_id: str) -> bool:
        return self.floor.complete(run_id, worker_id)


def make_client(variant: str, conn: psycopg.Connection[Any]) -> LifecycleClient:
    if variant == "repository":
        return RepositoryClient(conn)
    if variant == "floor":
        return FloorLifecycleClient(conn)
    if variant == "floor_tx":
        return FloorLifecycleClient(conn, in_transaction=True)
    raise ValueError(f"unknown variant {variant!r}")


def new_worker_id(variant: str, thread: int) -> str:
    """A stable worker name plus a fresh token per claim, as agent_runs.worker does."""
    return f"bench-{variant}-{thread}:{uuid.uuid4().hex}"


class BacklogExhausted(Exception):
    """claim found no pending run: the segment ran out of seeded work."""


@dataclass
class Latencies:
    """Seconds per call, by transition."""

    claim: list[float] = field(default_factory=list)
    renew: list[float] = field(default_factory=list)
    complete: list[float] = field(default_factory=list)

    def extend(self, other: Latencies) -> None:
        self.claim.extend(other.claim)
        self.renew.extend(other.renew)
        self.complete.extend(other.complete)

    def by_transition(self) -> dict[str, list[float]]:
        return {"claim": self.claim, "renew": self.renew, "complete": self.complete}


def lifecycle(client: LifecycleClient, worker_id: str, latencies: Latencies | None = None) -> None:
    """One full lifecycle; raises BacklogExhausted when there is nothing to claim."""
    clock = time.perf_counter
    started = clock()
    run_id = client.claim(worker_id)
    claimed = clock()
    if run_id is None:
        raise BacklogExhausted
    renew_times = []
    before = claimed
    for _ in range(RENEWALS_PER_LIFECYCLE):
        if not client.renew(run_id, worker_id):
            raise AssertionError(f"renewal of {run_id} by its owner was refused")
        after = clock()
        renew_times.append(after - before)
        before = after
    if not client.complete(run_id, worker_id):
        raise AssertionError(f"completion of {run_id} by its owner was refused")
    finished = clock()
    if latencies is not None:
        latencies.claim.append(claimed - started)
        latencies.renew.extend(renew_times)
        latencies.complete.append(finished - before)


@dataclass
class SegmentResult:
    """One timed segment: one variant at one concurrency."""

    variant: str
    threads: int
    lifecycles: int
    seconds: float
    wal_bytes: int
    exhausted: bool
    latencies: Latencies

    @property
    def per_second(self) -> float:
        return self.lifecycles / self.seconds if self.seconds > 0 else 0.0

    @property
    def wal_per_lifecycle(self) -> float:
        return self.wal_bytes / self.lifecycles if self.lifecycles else 0.0


def run_segment(
    url: str,
    variant: str,
    threads: int,
    seconds: float,
    observer: psycopg.Connection[Any],
    *,
    warmup_lifecycles: int = 2,
) -> SegmentResult:
    """`threads` threads run lifecycles of `variant` for `seconds`; count and time them."""
    ready = threading.Barrier(threads + 1)
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = [0] * threads
    per_thread = [Latencies() for _ in range(threads)]
    ended = [0.0] * threads
    exhausted = threading.Event()

    def work(index: int) -> None:
        try:
            with agent_runs.connect(url) as conn:
                client = make_client(variant, conn)
                for _ in range(warmup_lifecycles):  # prepares the statements, warms caches
                    lifecycle(client, new_worker_id(variant, index))
                ready.wait()
                latencies = per_thread[index]
                done = 0
                while not stop.is_set():
                    lifecycle(client, new_worker_id(variant, index), latencies)
                    done += 1
                counts[index] = done
                ended[index] = time.perf_counter()
        except BacklogExhausted:
            exhausted.set()
            counts[index] = len(per_thread[index].complete)
            ended[index] = time.perf_counter()
        except BaseException as exc:
            errors.append(exc)
            ready.abort()
            ended[index] = time.perf_counter()

    workers = [
        threading.Thread(target=work, args=(i,), name=f"bench-{variant}-{i}", daemon=True)
        for i in range(threads)
    ]
    for worker in workers:
        worker.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        for worker in workers:
            worker.join()
        raise errors[0] from None
    lsn = wal_lsn(observer)
    started = time.perf_counter()
    stop.wait(seconds)
    stop.set()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    elapsed = max(ended) - started
    latencies = Latencies()
    for one in per_thread:
        latencies.extend(one)
    return SegmentResult(
        variant=variant,
        threads=threads,
        lifecycles=sum(counts),
        seconds=elapsed,
        wal_bytes=wal_bytes_since(observer, lsn),
        exhausted=exhausted.is_set(),
        latencies=latencies,
    )
