"""Threads that run one design's lifecycles in slices, and what each slice cost the server.

A slice's cost: lifecycles, WAL (LSN difference; with pg_waldump, record and page-image bytes
and the B-tree leaf insertions, i.e. index tuples written), the CPU time of the crew's own
backends (from /proc, bench.cpu) and the update counters of the design's tables.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import psycopg
from psycopg import sql

import agent_runs
from bench.cpu import backend_ticks
from bench.pgstats import UpdateCounters, flush_stats, update_counters
from bench.walstats import WalMeter, WalVolume

LEASE_SECONDS: Final = 60.0
RENEWALS_PER_LIFECYCLE: Final = 3
WARMUP_LIFECYCLES: Final = 5
# B-tree records that add one index tuple: a leaf insert, an insert into a posting list, and
# the insert that splits a page (logged as the split).
_INDEX_TUPLE_RECORDS: Final = ("INSERT_LEAF", "INSERT_POST", "SPLIT_L", "SPLIT_R")
_BTREE_LINE: Final = re.compile(r"^Btree/(\w+)\s+(\d+)\s", re.M)


class FloorStatements(Protocol):
    """bench.floor.FloorClient, bench.lean_floor.LeanFloorClient, NamedStatementsClient."""

    def claim(self, worker_id: str, lease_seconds: float) -> str | None: ...

    def renew(self, run_id: str, worker_id: str, lease_seconds: float) -> bool: ...

    def complete(self, run_id: str, worker_id: str) -> bool: ...


class BacklogExhausted(Exception):
    """claim found no pending run."""


def lifecycle(client: FloorStatements, worker_id: str) -> None:
    run_id = client.claim(worker_id, LEASE_SECONDS)
    if run_id is None:
        raise BacklogExhausted
    for _ in range(RENEWALS_PER_LIFECYCLE):
        if not client.renew(run_id, worker_id, LEASE_SECONDS):
            raise AssertionError(f"renewal of {run_id} by its owner was refused")
    if not client.complete(run_id, worker_id):
        raise AssertionError(f"completion of {run_id} by its owner was refused")


@dataclass(frozen=True)
class SliceCost:
    design: str
    threads: int
    lifecycles: int
    seconds: float
    wal: WalVolume
    index_tuples: int | None
    cpu_ticks: int | None
    tables: dict[str, UpdateCounters]
    exhausted: bool


class IndexWalMeter(WalMeter):
    """WalMeter that also counts the B-tree tuple insertions of an interval (pg_waldump)."""

    def measure_detail(self, start: str) -> tuple[WalVolume, int | None]:
        volume = self.measure(start)
        if self._waldump is None or self._wal_dir is None or volume.records is None:
            return volume, None
        # measure() has advanced the slot; a second read of the same range right after is
        # still on disk (WAL is recycled only at a checkpoint).
        end = self._conn.execute(
            "SELECT (%s::pg_lsn + %s::numeric)::text", (start, volume.lsn_bytes)
        ).fetchone()
        if end is None:
            return volume, None
        done = subprocess.run(
            [str(self._waldump), "-p", str(self._wal_dir), "-s", start, "-e", str(end[0]),
             "--stats=record"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            return volume, None
        counts = {name: int(n) for name, n in _BTREE_LINE.findall(done.stdout)}
        return volume, sum(counts.get(name, 0) for name in _INDEX_TUPLE_RECORDS)


class DesignCrew:
    """`threads` warm connections of one design, each on its own thread, run in slices."""

    def __init__(
        self,
        url: str,
        design: str,
        schema: str,
        make_client: Callable[[psycopg.Connection[Any]], FloorStatements],
        threads: int,
    ) -> None:
        self.design, self.threads = design, threads
        self._url, self._schema, self._make_client = url, schema, make_client
        self._start = threading.Barrier(threads + 1)
        self._end = threading.Barrier(threads + 1)
        self._running = threading.Event()
        self._exhausted = threading.Event()
        self._closing = False
        self._errors: list[BaseException] = []
        self._counts = [0] * threads
        self._ended = [0.0] * threads
        self.pids: list[int] = [0] * threads
        self._workers = [
            threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(threads)
        ]
        for worker in self._workers:
            worker.start()
        self._sync(self._end)  # connected and warmed up

    def _sync(self, barrier: threading.Barrier) -> None:
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            raise self._errors[0] if self._errors else RuntimeError("crew broke") from None

    def _worker_id(self, index: int) -> str:
        return f"bench-{self.design}-{index}:{uuid.uuid4().hex}"

    def _work(self, index: int) -> None:
        try:
            with agent_runs.connect(self._url) as conn:
                set_search_path(conn, self._schema)
                client = self._make_client(conn)
                self.pids[index] = conn.info.backend_pid
                for _ in range(WARMUP_LIFECYCLES):
                    lifecycle(client, self._worker_id(index))
                self._end.wait()
                while True:
                    self._start.wait()
                    if self._closing:
                        return
                    done = 0
                    try:
                        while self._running.is_set():
                            lifecycle(client, self._worker_id(index))
                            done += 1
                    except BacklogExhausted:
                        self._exhausted.set()
                    self._counts[index] = done
                    self._ended[index] = time.perf_counter()
                    flush_stats(conn)
                    self._end.wait()
        except BaseException as exc:
            self._errors.append(exc)
            for barrier in (self._start, self._end):
                barrier.abort()

    def run(
        self,
        seconds: float,
        observer: psycopg.Connection[Any],
        meter: IndexWalMeter,
        tables: Sequence[str],
    ) -> SliceCost:
        self._exhausted.clear()
        self._running.set()
        counters_before = update_counters(observer, tables)
        ticks_before = backend_ticks(observer, self.pids)
        lsn = meter.start()
        self._sync(self._start)
        started = time.perf_counter()
        time.sleep(seconds)
        self._running.clear()
        self._sync(self._end)
        ticks_after = backend_ticks(observer, self.pids)
        wal, index_tuples = meter.measure_detail(lsn)
        counters_after = update_counters(observer, tables)
        ticks = None if ticks_before is None or ticks_after is None else ticks_after - ticks_before
        return SliceCost(
            design=self.design,
            threads=self.threads,
            lifecycles=sum(self._counts),
            seconds=max(self._ended) - started,
            wal=wal,
            index_tuples=index_tuples,
            cpu_ticks=ticks,
            tables={t: counters_after[t].minus(counters_before[t]) for t in tables},
            exhausted=self._exhausted.is_set(),
        )

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(threading.BrokenBarrierError):
            self._start.wait(timeout=30)
        for worker in self._workers:
            worker.join(timeout=30)


def set_search_path(conn: psycopg.Connection[Any], schema: str) -> None:
    conn.execute(sql.SQL("SET search_path = {}, public").format(sql.Identifier(schema)))
