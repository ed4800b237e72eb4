"""Server-rendered SVG geometry: finished runs per minute, and one bar per attempt in time.

Only numbers leave this module (positions, sizes, counts); the templates draw them with CSS
classes, never style attributes (the Content-Security-Policy forbids those).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from agent_runs.dashboard.data import Minute
from agent_runs.models import RunAttempt

WIDTH: Final = 720
HEIGHT: Final = 160
_PAD_LEFT: Final = 40
_PAD_BOTTOM: Final = 20
_PAD_TOP: Final = 8


@dataclass(frozen=True, slots=True)
class Bar:
    x: float
    width: float
    y: float
    height: float
    css: str
    label: str


@dataclass(frozen=True, slots=True)
class Chart:
    width: int
    height: int
    bars: tuple[Bar, ...]
    peak: int
    total: int
    baseline: float
    ticks: tuple[tuple[float, str], ...]


def per_minute_chart(minutes: Sequence[Minute]) -> Chart:
    """Stacked bars (completed below, other endings above) per minute, scaled to the peak."""
    peak = max((m.completed + m.other for m in minutes), default=0)
    scale = (HEIGHT - _PAD_BOTTOM - _PAD_TOP) / max(peak, 1)
    slot = (WIDTH - _PAD_LEFT) / max(len(minutes), 1)
    baseline = float(HEIGHT - _PAD_BOTTOM)
    bars: list[Bar] = []
    ticks: list[tuple[float, str]] = []
    for i, minute in enumerate(minutes):
        x = _PAD_LEFT + i * slot + 1
        label = f"{minute.start:%H:%M} UTC: {minute.completed} completed, {minute.other} other"
        done = minute.completed * scale
        bars.append(Bar(x, slot - 2, baseline - done, done, "bar-completed", label))
        other = minute.other * scale
        bars.append(Bar(x, slot - 2, baseline - done - other, other, "bar-other", label))
        if i % 15 == 0:
            ticks.append((x, f"{minute.start:%H:%M}"))
    total = sum(m.completed + m.other for m in minutes)
    return Chart(
        WIDTH, HEIGHT, tuple(b for b in bars if b.height > 0), peak, total, baseline, tuple(ticks)
    )


@dataclass(frozen=True, slots=True)
class Span:
    attempt_no: int
    x: float
    width: float
    y: float
    css: str
    label: str


@dataclass(frozen=True, slots=True)
class Timeline:
    width: int
    height: int
    spans: tuple[Span, ...]
    start: datetime
    end: datetime


ROW_HEIGHT: Final = 22


def attempt_timeline(attempts: Sequence[RunAttempt], now: datetime) -> Timeline | None:
    """One bar per attempt from its start to its finish (an open one: to now)."""
    if not attempts:
        return None
    start = min(a.started_at for a in attempts)
    end = max(a.finished_at or now for a in attempts)
    total = max((end - start).total_seconds(), 0.001)
    usable = WIDTH - _PAD_LEFT - 8
    spans: list[Span] = []
    for row, attempt in enumerate(sorted(attempts, key=lambda a: a.attempt_no)):
        finish = attempt.finished_at or now
        x = _PAD_LEFT + (attempt.started_at - start).total_seconds() / total * usable
        width = max((finish - attempt.started_at).total_seconds() / total * usable, 2.0)
        outcome = attempt.outcome.value if attempt.outcome is not None else "open"
        seconds = max(finish - attempt.started_at, timedelta(0)).total_seconds()
        label = f"attempt {attempt.attempt_no}: {outcome}, {seconds:.1f}s"
        spans.append(
            Span(attempt.attempt_no, x, width, row * ROW_HEIGHT + 4, f"s-{outcome}", label)
        )
    return Timeline(WIDTH, len(spans) * ROW_HEIGHT + 8, tuple(spans), start, end)
