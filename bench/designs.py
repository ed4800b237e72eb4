"""What each schema design costs: `python -m bench.designs [--dsn URL] [--seconds S] [--threads
1 4] [--quick]`.

Every design (bench.designs_ddl) lives in its own schema of one fresh database, holds the same
10,000 finished runs with their attempts plus pending runs topped up between slices, and runs
its own hand-minimal floor statements (bench.designs_sql; bench.floor's and bench.lean_floor's
where the schema is theirs). A lifecycle = claim, 3 renewals, complete, each one prepared
autocommit statement. Designs take turns in short slices with a rotating order (this machine
drifts ±30 % within minutes: only ratios from one run count), at each thread count, one
connection per thread. Per design: lifecycles/s, WAL per lifecycle (LSN difference; record bytes
and B-tree tuple inserts from pg_waldump when it can read the server's pg_wal), the server CPU
of the design's backends (/proc), the HOT share of updates; each as a ratio to `lean`.
Without --dsn, an embedded PostgreSQL as `python -m bench` uses. Prints one table, writes
bench/results/designs.json.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, LiteralString

import psycopg

import agent_runs
from bench import designs_ddl, designs_sql, lean_floor, seed
from bench.cpu import TICKS_PER_SECOND
from bench.designs_crew import (
    WARMUP_LIFECYCLES,
    DesignCrew,
    FloorStatements,
    IndexWalMeter,
    SliceCost,
    set_search_path,
)
from bench.floor import FloorClient
from bench.lean_floor import LeanFloorClient
from bench.report import fmt, log, median, table, write_json
from bench.server import bench_server

RESULTS: Final = Path(__file__).resolve().parent / "results" / "designs.json"
Conn = psycopg.Connection[Any]


@dataclass(frozen=True)
class DesignSettings:
    seconds: float  # per design, thread count and repetition
    reps: int
    slices: int  # each repetition in this many turns
    threads: tuple[int, ...]
    history: int


FULL: Final = DesignSettings(seconds=6.0, reps=5, slices=6, threads=(1, 4), history=10_000)
QUICK: Final = DesignSettings(seconds=0.5, reps=1, slices=1, threads=(1,), history=1_000)


@dataclass(frozen=True)
class Design:
    name: str
    schema: str
    tables: tuple[str, str]  # the run table its lifecycle updates, and the attempts
    make_client: Callable[[Conn], FloorStatements]
    install: Callable[[Conn, int], None]  # schema and history (count)
    add_pending: Callable[[Conn, int], None]
    count_pending: Callable[[Conn], int]


def _scalar_count(query: LiteralString) -> Callable[[Conn], int]:
    def count(conn: Conn) -> int:
        row = conn.execute(query).fetchone()
        return int(row[0]) if row else 0

    return count


def _install(ddl: str, copy_history: str) -> Callable[[Conn, int], None]:
    def install(conn: Conn, history: int) -> None:
        conn.execute(ddl.encode())
        conn.execute(copy_history.encode())

    return install


def _named(statements: designs_sql.Statements) -> Callable[[Conn], FloorStatements]:
    return lambda conn: designs_sql.NamedStatementsClient(conn, statements)


def _seed_pending(conn: Conn, count: int) -> None:
    seed.seed_pending([conn], count)


def _queue_pending(conn: Conn, count: int) -> None:
    seed.seed_pending([conn], count)
    conn.execute(designs_sql.QUEUE_ENLIST)


def _tagged(query: LiteralString) -> Callable[[Conn, int], None]:
    def add(conn: Conn, count: int) -> None:
        conn.execute(query, {"tag": designs_sql.new_tag(), "count": count})

    return add


def _lean_install(conn: Conn, history: int) -> None:
    lean_floor.install(conn)
    lean_floor.seed_history(conn, history)


def _current_install(conn: Conn, history: int) -> None:
    seed.seed_history([conn], history)


_SPLIT_PENDING_COUNT: Final = "SELECT count(*) FROM agent_run_state WHERE status = 'pending'"

# In this order: lean and current first (the others copy their history).
DESIGNS: Final = (
    Design("lean", lean_floor.SCHEMA, lean_floor.TABLES, LeanFloorClient, _lean_install,
           lean_floor.seed_pending, lean_floor.count_pending),
    Design("current", "public", ("agent_runs", "agent_run_attempts"), FloorClient,
           _current_install, _seed_pending, seed.count_pending),
    Design("diet", "design_diet", ("design_diet.agent_runs", "design_diet.agent_run_attempts"),
           FloorClient, _install(designs_ddl.DIET, designs_sql.COPY_ONE_ROW_HISTORY),
           _seed_pending, seed.count_pending),
    Design("split", "design_split",
           ("design_split.agent_run_state", "design_split.agent_run_attempts"),
           _named(designs_sql.SPLIT),
           _install(designs_ddl.SPLIT, designs_sql.COPY_SPLIT_HISTORY),
           _tagged(designs_sql.SPLIT_PENDING), _scalar_count(_SPLIT_PENDING_COUNT)),
    Design("split_keys", "design_split_keys",
           ("design_split_keys.agent_run_state", "design_split_keys.agent_run_attempts"),
           _named(designs_sql.SPLIT),
           _install(designs_ddl.SPLIT_KEYS, designs_sql.COPY_SPLIT_HISTORY),
           _tagged(designs_sql.SPLIT_PENDING), _scalar_count(_SPLIT_PENDING_COUNT)),
    Design("queue", "design_queue",
           ("design_queue.agent_runs", "design_queue.agent_run_attempts"),
           _named(designs_sql.QUEUE),
           _install(designs_ddl.QUEUE, designs_sql.COPY_ONE_ROW_HISTORY),
           _queue_pending, _scalar_count("SELECT count(*) FROM agent_run_queue")),
    Design("lean_plus_checks", "design_lean_checks",
           ("design_lean_checks.runs", "design_lean_checks.attempts"),
           _named(designs_sql.LEAN_PLUS_CHECKS),
           _install(designs_ddl.LEAN_PLUS_CHECKS, designs_sql.COPY_LEAN_HISTORY),
           _tagged(designs_sql.LEAN_PLUS_CHECKS_PENDING),
           _scalar_count("SELECT count(*) FROM runs WHERE status = 'pending'")),
)  # fmt: skip


def prepare(url: str, settings: DesignSettings) -> dict[str, Conn]:
    """Every design's schema and history; one seeding connection per design, on its schema."""
    seeders: dict[str, Conn] = {}
    for design in DESIGNS:
        conn = agent_runs.connect(url)
        seeders[design.name] = conn
        if design.name == "current":
            conn.execute(designs_ddl.JSON_GUARD_HALVES.encode())
        set_search_path(conn, design.schema)
        design.install(conn, settings.history)
        set_search_path(conn, design.schema)  # a DDL script may have set it
        log(f"  {design.name}: schema {design.schema}, history seeded")
    seeders["lean"].execute("VACUUM (ANALYZE)")
    return seeders


def _top_up(design: Design, conn: Conn, lifecycles: float, threads: int) -> None:
    need = math.ceil(lifecycles * 2) + threads * 2 + 50
    short = need - design.count_pending(conn)
    if short > 0:
        design.add_pending(conn, short)


def measure(
    url: str,
    settings: DesignSettings,
    seeders: dict[str, Conn],
    observer: Conn,
    meter: IndexWalMeter,
) -> list[tuple[int, SliceCost]]:
    """Every design at every thread count, in slices taken in a rotating order."""
    costs: list[tuple[int, SliceCost]] = []
    slice_seconds = settings.seconds / settings.slices
    for threads in settings.threads:
        for design in DESIGNS:
            _top_up(design, seeders[design.name], threads * WARMUP_LIFECYCLES, threads)
        crews: dict[str, DesignCrew] = {}
        try:
            for design in DESIGNS:
                crews[design.name] = DesignCrew(
                    url, design.name, design.schema, design.make_client, threads
                )
            fastest: dict[str, float] = {}
            for rep in range(settings.reps):
                for turn in range(settings.slices):
                    shift = (rep * settings.slices + turn) % len(DESIGNS)
                    for design in DESIGNS[shift:] + DESIGNS[:shift]:
                        expected = fastest.get(design.name, 3_000.0) * slice_seconds
                        _top_up(design, seeders[design.name], expected, threads)
                        cost = crews[design.name].run(slice_seconds, observer, meter, design.tables)
                        if cost.exhausted:
                            log(f"  warning: {design.name} ran out of pending runs")
                        rate = cost.lifecycles / cost.seconds if cost.seconds > 0 else 0.0
                        fastest[design.name] = max(fastest.get(design.name, 1.0), rate)
                        costs.append((rep, cost))
                rates = _rep_rates(costs, rep, threads)
                line = ", ".join(f"{name} {rate:.0f}" for name, rate in rates.items())
                log(f"  rep {rep + 1}/{settings.reps}, {threads} threads: {line} lifecycles/s")
        finally:
            for crew in crews.values():
                crew.close()
    return costs


def _rep_rates(costs: Sequence[tuple[int, SliceCost]], rep: int, threads: int) -> dict[str, float]:
    rates: dict[str, float] = {}
    for design in DESIGNS:
        chosen = [
            c for r, c in costs if r == rep and c.threads == threads and c.design == design.name
        ]
        seconds = sum(c.seconds for c in chosen)
        rates[design.name] = sum(c.lifecycles for c in chosen) / seconds if seconds else math.nan
    return rates


def _per_lifecycle(values: Sequence[int | None], lifecycles: int) -> float:
    if not lifecycles or any(v is None for v in values):
        return math.nan
    return sum(v for v in values if v is not None) / lifecycles


def _hot_share(chosen: Sequence[SliceCost], table_name: str) -> float:
    updates = sum(c.tables[table_name].updates for c in chosen)
    hot = sum(c.tables[table_name].hot for c in chosen)
    return hot / updates if updates else math.nan


def summarize(costs: Sequence[tuple[int, SliceCost]], settings: DesignSettings) -> dict[str, Any]:
    by_threads: dict[str, Any] = {}
    for threads in settings.threads:
        per_rep = [_rep_rates(costs, rep, threads) for rep in range(settings.reps)]
        entry: dict[str, Any] = {}
        for design in DESIGNS:
            chosen = [c for _, c in costs if c.threads == threads and c.design == design.name]
            lifecycles = sum(c.lifecycles for c in chosen)
            ticks = _per_lifecycle([c.cpu_ticks for c in chosen], lifecycles)
            entry[design.name] = {
                "lifecycles_per_second": median([r[design.name] for r in per_rep]),
                "repetitions": [r[design.name] for r in per_rep],
                "ratio_to_lean": median([r[design.name] / r["lean"] for r in per_rep]),
                "ratio_to_lean_per_repetition": [r[design.name] / r["lean"] for r in per_rep],
                "lifecycles": lifecycles,
                "wal_lsn_bytes_per_lifecycle": _per_lifecycle(
                    [c.wal.lsn_bytes for c in chosen], lifecycles
                ),
                "wal_record_bytes_per_lifecycle": _per_lifecycle(
                    [c.wal.records for c in chosen], lifecycles
                ),
                "wal_fpi_bytes_per_lifecycle": _per_lifecycle(
                    [c.wal.fpi for c in chosen], lifecycles
                ),
                "index_tuples_per_lifecycle": _per_lifecycle(
                    [c.index_tuples for c in chosen], lifecycles
                ),
                "server_cpu_us_per_lifecycle": ticks * 1e6 / TICKS_PER_SECOND,
                "hot_share_runs": _hot_share(chosen, design.tables[0]),
                "hot_share_attempts": _hot_share(chosen, design.tables[1]),
                "ran_out_of_work": any(c.exhausted for c in chosen),
            }
        lean = entry["lean"]
        for design in DESIGNS:
            row = entry[design.name]
            wal_key = (
                "wal_record_bytes_per_lifecycle"
                if not math.isnan(row["wal_record_bytes_per_lifecycle"])
                else "wal_lsn_bytes_per_lifecycle"
            )
            row["wal_ratio_to_lean"] = row[wal_key] / lean[wal_key]
            row["cpu_ratio_to_lean"] = (
                row["server_cpu_us_per_lifecycle"] / lean["server_cpu_us_per_lifecycle"]
            )
        by_threads[str(threads)] = entry
    return by_threads


def _span(values: Sequence[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if values else "n/a"


def render(summary: dict[str, Any]) -> str:
    headers = [
        "design",
        "thr",
        "lc/s",
        "×lean",
        "reps ×lean",
        "WAL B/lc",
        "×lean",
        "LSN B/lc",
        "CPU µs/lc",
        "×lean",
        "idx/lc",
        "HOT runs",
        "HOT att",
    ]
    rows = []
    for threads, entry in summary.items():
        for design in DESIGNS:
            r = entry[design.name]
            rows.append(
                [
                    design.name,
                    threads,
                    fmt(r["lifecycles_per_second"]),
                    fmt(r["ratio_to_lean"], "x"),
                    _span(r["ratio_to_lean_per_repetition"]),
                    fmt(r["wal_record_bytes_per_lifecycle"]),
                    fmt(r["wal_ratio_to_lean"], "x"),
                    fmt(r["wal_lsn_bytes_per_lifecycle"]),
                    fmt(r["server_cpu_us_per_lifecycle"]),
                    fmt(r["cpu_ratio_to_lean"], "x"),
                    fmt(r["index_tuples_per_lifecycle"]),
                    fmt(r["hot_share_runs"], "%"),
                    fmt(r["hot_share_attempts"], "%"),
                ]
            )
    lines = [table(headers, rows), "", "  What each design changes:"]
    lines += [f"  - {name}: {text}" for name, text in designs_ddl.DIFFERENCES.items()]
    lines.append("  Pickup is FIFO by (created_at, id) in every design.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.designs", description=__doc__)
    parser.add_argument("--dsn", help="a PostgreSQL to create a scratch database on")
    parser.add_argument("--seconds", type=float, help="per design, thread count and repetition")
    parser.add_argument("--threads", type=int, nargs="+")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--quick", action="store_true", help="a smoke run (under a minute)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="the JSON file to write")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else FULL
    settings = DesignSettings(
        seconds=args.seconds or base.seconds,
        reps=args.reps or base.reps,
        slices=base.slices,
        threads=tuple(args.threads) if args.threads else base.threads,
        history=base.history,
    )
    started = time.perf_counter()
    with bench_server(args.dsn) as server:
        log(f"PostgreSQL {server.version} ({server.kind}); {len(DESIGNS)} designs")
        url = server.fresh_database("designs")
        seeders = prepare(url, settings)
        try:
            with agent_runs.connect(url) as observer:
                meter = IndexWalMeter(observer)
                try:
                    costs = measure(url, settings, seeders, observer, meter)
                finally:
                    meter.close()
        finally:
            for conn in seeders.values():
                conn.close()
        version, wal_method = server.version, meter.method
    summary = summarize(costs, settings)
    print(render(summary))
    write_json(
        args.output,
        {
            "finished_at": datetime.now(UTC).isoformat(),
            "server_version": version,
            "wal_method": wal_method,
            "settings": settings.__dict__,
            "seconds_total": time.perf_counter() - started,
            "differences": designs_ddl.DIFFERENCES,
            "by_threads": summary,
        },
    )
    log(f"wrote {args.output}")


if __name__ == "__main__":
    main()
