"""The lifecycle under test (claim → 3 × renew → complete) and the threaded segment runner.

Three clients implement the same three calls: the real AgentRunRepository, the floor's
hand-minimal statements on the same schema, and the lean floor's on its own lean schema. Each
benchmark thread owns one autocommit connection.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import psycopg

import agent_runs
from agent_runs import AgentRunRepository, Finish, RunStatus
from bench import lean_floor, seed
from bench.floor import FloorClient, FloorInTransactionClient
from bench.lean_floor import LeanFloorClient
from bench.pgstats import TABLES, UpdateCounters, flush_stats, update_counters
from bench.walstats import WalMeter, WalVolume

LEASE_SECONDS: Final = 60.0
RENEWALS_PER_LIFECYCLE: Final = 3
TRANSITIONS: Final = ("claim", "renew", "complete")
VARIANTS: Final = ("repository", "floor")
# Throughput also runs the lean floor (its own schema), a diagnostic (the floor's statements in
# explicit transactions) and the repository's calls as its worker makes them.
THROUGHPUT_VARIANTS: Final = ("repository", "floor", "lean", "floor_tx", "repository_lean")
WARMUP_LIFECYCLES: Final = 5  # per thread of a crew, before anything is measured


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


class RepositoryLeanClient(RepositoryClient):
    """The repository's calls as its worker makes them: claim_next_attempt (the run and
    its attempt_no), renew_lease, finish_runs of one run (answers finished_at only)."""

    def claim(self, worker_id: str) -> str | None:
        claimed = self.repo.claim_next_attempt(worker_id=worker_id, lease_seconds=LEASE_SECONDS)
        return None if claimed is None else claimed.run.id

    def complete(self, run_id: str, worker_id: str) -> bool:
        finished = self.repo.finish_runs([Finish(run_id, worker_id, RunStatus.COMPLETED)])
        return run_id in finished


class FloorLifecycleClient:
    """The floor's single prepared autocommit statements (or, with in_transaction, the same
    statements each in BEGIN … COMMIT over the repository's transport: a diagnostic)."""

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


class LeanLifecycleClient:
    """The lean floor's statements on its own schema (bench.lean_floor)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.floor = LeanFloorClient(conn)

    def claim(self, worker_id: str) -> str | None:
        return self.floor.claim(worker_id, LEASE_SECONDS)

    def renew(self, run_id: str, worker_id: str) -> bool:
        return self.floor.renew(run_id, worker_id, LEASE_SECONDS)

    def complete(self, run_id: str, worker_id: str) -> bool:
        return self.floor.complete(run_id, worker_id)


def make_client(variant: str, conn: psycopg.Connection[Any]) -> LifecycleClient:
    if variant == "repository":
        return RepositoryClient(conn)
    if variant == "repository_lean":
        return RepositoryLeanClient(conn)
    if variant == "floor":
        return FloorLifecycleClient(conn)
    if variant == "floor_tx":
        return FloorLifecycleClient(conn, in_transaction=True)
    if variant == "lean":
        return LeanLifecycleClient(conn)
    raise ValueError(f"unknown variant {variant!r}")


def tables_of(variant: str) -> tuple[str, str]:
    """The (runs, attempts) tables a variant writes."""
    return lean_floor.TABLES if variant == "lean" else TABLES


def add_pending(variant: str, conn: psycopg.Connection[Any], count: int) -> None:
    """`count` more pending runs where `variant` claims them."""
    if variant == "lean":
        lean_floor.seed_pending(conn, count)
    else:
        seed.seed_pending([conn], count)


def pending_count(variant: str, conn: psycopg.Connection[Any]) -> int:
    return lean_floor.count_pending(conn) if variant == "lean" else seed.count_pending(conn)


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
    wal: WalVolume
    exhausted: bool
    latencies: Latencies
    tables: dict[str, UpdateCounters]  # update counters of the variant's two tables

    @classmethod
    def combined(cls, parts: list[SegmentResult]) -> SegmentResult:
        """Slices of one variant at one concurrency, measured in turns with the others, as one."""
        latencies = Latencies()
        wal = WalVolume(0, 0, 0)
        tables = dict(parts[0].tables)
        for part in parts:
            latencies.extend(part.latencies)
            wal = wal.plus(part.wal)
        for part in parts[1:]:
            tables = {name: c.plus(part.tables[name]) for name, c in tables.items()}
        return cls(
            variant=parts[0].variant,
            threads=parts[0].threads,
            lifecycles=sum(p.lifecycles for p in parts),
            seconds=sum(p.seconds for p in parts),
            wal=wal,
            exhausted=any(p.exhausted for p in parts),
            latencies=latencies,
            tables=tables,
        )

    @property
    def per_second(self) -> float:
        return self.lifecycles / self.seconds if self.seconds > 0 else 0.0

    @property
    def wal_per_lifecycle(self) -> float:
        """LSN difference per lifecycle (page headers and alignment included)."""
        return self.wal.lsn_bytes / self.lifecycles if self.lifecycles else 0.0


class Crew:
    """`threads` threads of one variant, each with its own warm connection, run in slices.

    The threads and their connections live across slices: a slice measures steady-state
    lifecycles, never connection set-up, cold server caches or thread start-up. Between slices
    the crew waits, so variants can take turns on the same server.
    """

    def __init__(self, url: str, variant: str, threads: int) -> None:
        self.variant = variant
        self.threads = threads
        self._url = url
        self._ready = threading.Barrier(threads + 1)
        self._start = threading.Barrier(threads + 1)
        self._end = threading.Barrier(threads + 1)
        self._running = threading.Event()
        self._closing = False
        self._errors: list[BaseException] = []
        self._exhausted = threading.Event()
        self._counts = [0] * threads
        self._latencies = [Latencies() for _ in range(threads)]
        self._ended = [0.0] * threads
        self._quota: int | None = None  # lifecycles per slice, when a slice is counted
        self._tickets = itertools.count()
        self._workers = [
            threading.Thread(target=self._work, args=(i,), name=f"bench-{variant}-{i}", daemon=True)
            for i in range(threads)
        ]
        for worker in self._workers:
            worker.start()
        self._sync(self._ready)  # connected and warmed up

    def _sync(self, barrier: threading.Barrier) -> None:
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            raise self._errors[0] if self._errors else RuntimeError("crew broke") from None

    def _work(self, index: int) -> None:
        try:
            with agent_runs.connect(self._url) as conn:
                client = make_client(self.variant, conn)
                for _ in range(WARMUP_LIFECYCLES):  # prepares statements, warms caches
                    lifecycle(client, new_worker_id(self.variant, index))
                self._ready.wait()
                while True:
                    self._start.wait()
                    if self._closing:
                        return
                    done = 0
                    latencies = Latencies()
                    try:
                        while self._running.is_set() and self._ticket():
                            lifecycle(client, new_worker_id(self.variant, index), latencies)
                            done += 1
                    except BacklogExhausted:
                        self._exhausted.set()
                    self._counts[index] = done
                    self._latencies[index] = latencies
                    self._ended[index] = time.perf_counter()
                    flush_stats(conn)  # this slice's update counters, for the observer
                    self._end.wait()
        except BaseException as exc:
            self._errors.append(exc)
            for barrier in (self._ready, self._start, self._end):
                barrier.abort()

    def _ticket(self) -> bool:
        return self._quota is None or next(self._tickets) < self._quota

    def run(
        self,
        seconds: float,
        observer: psycopg.Connection[Any],
        meter: WalMeter,
        *,
        lifecycles: int | None = None,
    ) -> SegmentResult:
        """One slice: every thread runs lifecycles for `seconds` (or until the crew has run
        `lifecycles` of them); count and time them, and the WAL and row updates they wrote."""
        self._exhausted.clear()
        self._quota, self._tickets = lifecycles, itertools.count()
        self._running.set()
        tables = tables_of(self.variant)
        before = update_counters(observer, tables)
        lsn = meter.start()
        self._sync(self._start)
        started = time.perf_counter()
        if lifecycles is None:
            time.sleep(seconds)
            self._running.clear()
        self._sync(self._end)
        self._running.clear()
        wal = meter.measure(lsn)
        after = update_counters(observer, tables)
        latencies = Latencies()
        for one in self._latencies:
            latencies.extend(one)
        return SegmentResult(
            variant=self.variant,
            threads=self.threads,
            lifecycles=sum(self._counts),
            seconds=max(self._ended) - started,
            wal=wal,
            exhausted=self._exhausted.is_set(),
            latencies=latencies,
            tables={name: after[name].minus(before[name]) for name in tables},
        )

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(threading.BrokenBarrierError):
            self._start.wait(timeout=30)
        for worker in self._workers:
            worker.join(timeout=30)
