"""Lifecycles per second of the repository and the floors, in alternating slices, with the WAL
and row updates of each slice."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from psycopg import sql

from bench import lean_floor
from bench.pgstats import TABLES
from bench.report import log, median, percentile
from bench.settings import TARGET_THREADS, Settings
from bench.wal_summary import WAL_VARIANTS, wal_entry
from bench.walstats import WalMeter
from bench.workload import (
    THROUGHPUT_VARIANTS,
    TRANSITIONS,
    WARMUP_LIFECYCLES,
    Crew,
    SegmentResult,
    add_pending,
    pending_count,
    tables_of,
)


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
