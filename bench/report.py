"""Turning measurements into the stdout table, the targets' verdicts and the JSON file."""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


@dataclass(frozen=True)
class Target:
    """One benchmark target and whether this run met it."""

    name: str
    value: float
    threshold: float
    at_least: bool  # True: value >= threshold passes; False: value <= threshold passes
    unit: str = ""

    @property
    def passed(self) -> bool:
        if math.isnan(self.value):
            return False
        return self.value >= self.threshold if self.at_least else self.value <= self.threshold

    def line(self) -> str:
        sign = "≥" if self.at_least else "≤"
        verdict = "PASS" if self.passed else "FAIL"
        value, threshold = fmt(self.value, self.unit), fmt(self.threshold, self.unit)
        return f"  {verdict}  {self.name}: {value} ({sign} {threshold})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "threshold": self.threshold,
            "comparison": ">=" if self.at_least else "<=",
            "unit": self.unit,
            "passed": self.passed,
        }


def fmt(value: float, unit: str = "") -> str:
    if math.isnan(value):
        return "n/a"
    if unit == "%":
        return f"{value * 100:.1f} %"
    if unit == "x":
        return f"{value:.2f}"
    number = f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"
    return number + unit


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, indent: str = "  ") -> str:
    """A plain, right-aligned text table (first column left-aligned)."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def render(cells: Sequence[str]) -> str:
        out = [cells[0].ljust(widths[0])]
        out += [cell.rjust(widths[i + 1]) for i, cell in enumerate(cells[1:])]
        return indent + "  ".join(out).rstrip()

    rule = indent + "  ".join("-" * w for w in widths)
    return "\n".join([render(headers), rule, *(render(r) for r in rows)])


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")


def log(message: str) -> None:
    """A progress line on stderr (stdout carries the report)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
