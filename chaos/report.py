"""The end-of-run summary: runs, attempts, faults by kind, invariant counts, violations."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from chaos.invariants import Violations

MAX_LISTED: int = 25  # violations printed with their reason (all ids are listed anyway)


@dataclass(frozen=True, slots=True)
class InvariantResult:
    name: str
    checked: str  # what was checked, e.g. "300 runs, 212 samples"
    violations: Violations

    @property
    def ok(self) -> bool:
        return not self.violations


@dataclass(frozen=True, slots=True)
class FaultLine:
    kind: str
    count: int
    detail: str


@dataclass(slots=True)
class Summary:
    seed: int
    runtime_seconds: float
    runs_enqueued: int
    runs_planned: int
    kinds: Counter[str]
    statuses: Counter[str]
    attempts: int
    outcomes: Counter[str]
    faults: list[FaultLine]
    processes: list[str]
    invariants: list[InvariantResult]
    problems: list[str] = field(default_factory=list)  # suite-level failures
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(inv.ok for inv in self.invariants)


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])))


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        return indent + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    out = [line(headers), indent + "  ".join("-" * w for w in widths)]
    out.extend(line(row) for row in rows)
    return out


def render(summary: Summary) -> str:
    """The summary table as printed at the end of `make chaos`."""
    lines = [
        "",
        f"chaos summary  (seed {summary.seed}, {summary.runtime_seconds:.1f}s)",
        "",
        f"  runs      {summary.runs_enqueued} enqueued of {summary.runs_planned} planned: "
        f"{_counts(summary.kinds)}",
        f"  statuses  {_counts(summary.statuses)}",
        f"  attempts  {summary.attempts}: {_counts(summary.outcomes)}",
        "",
    ]
    lines += _table(
        ("fault", "count", "detail"),
        [(f.kind, str(f.count), f.detail) for f in summary.faults],
    )
    lines.append("")
    lines += [f"  {p}" for p in summary.processes]
    lines.append("")
    lines += _table(
        ("invariant", "checked", "violations", "result"),
        [
            (inv.name, inv.checked, str(len(inv.violations)), "ok" if inv.ok else "FAIL")
            for inv in summary.invariants
        ],
    )
    for inv in summary.invariants:
        if inv.ok:
            continue
        lines.append("")
        lines.append(
            f"  FAIL {inv.name}: {len(inv.violations)} run(s): " + ", ".join(inv.violations)
        )
        for run_id, why in list(inv.violations.items())[:MAX_LISTED]:
            lines.append(f"    {run_id}: {why}")
        if len(inv.violations) > MAX_LISTED:
            lines.append(f"    ... and {len(inv.violations) - MAX_LISTED} more")
    if summary.notes:
        lines.append("")
        lines += [f"  note: {n}" for n in summary.notes]
    if summary.problems:
        lines.append("")
        lines += [f"  FAIL {p}" for p in summary.problems]
    lines.append("")
    verdict = "PASSED: every invariant holds" if summary.ok else "FAILED"
    lines.append(f"chaos {verdict}  (seed {summary.seed})")
    return "\n".join(lines)
