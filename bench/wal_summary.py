"""WAL per lifecycle: pooled per variant, the repository's ratios to both floors, their targets
and their table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

from bench.pgstats import UpdateCounters
from bench.report import Target, fmt, table
from bench.settings import TARGET_THREADS
from bench.walstats import WalVolume
from bench.workload import RENEWALS_PER_LIFECYCLE, SegmentResult, tables_of

# The variants whose WAL is compared: the repository, the same-schema floor, the lean floor.
WAL_VARIANTS: Final = ("repository", "floor", "lean")
# Targets: WAL per lifecycle, repository ÷ lean floor, without page images and
# with them (a CHECKPOINT every `checkpoint_every_lifecycles`).
WAL_TARGETS: Final = {"without_fpi": 1.6, "with_fpi": 2.0}


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


def wal_targets(results: dict[str, Any]) -> list[Target]:
    """WAL per lifecycle against the lean floor, with and without full-page images."""
    ratios = results["wal"]["repository_over_lean"]
    every = f"a CHECKPOINT every {results['wal']['checkpoint_every_lifecycles']:,} lifecycles"
    return [
        Target(
            f"WAL per lifecycle, repository ÷ lean floor, {label}",
            ratios[kind],
            WAL_TARGETS[kind],
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
