"""create_runs: runs created per second in batches of 1, 10 and 100, beside create_run.

One warm client on a migrated database, sizes measured in interleaved slices in the same run.
Every item is a new run on a thread of its own (the fan-out of a parent to its sub-agents).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Final

import agent_runs
from agent_runs import AgentRunRepository

SIZES: Final = (1, 10, 100)
SINGLE: Final = "create_run"


def _items(count: int) -> list[dict[str, Any]]:
    key = uuid.uuid4().hex
    return [
        {
            "thread_id": f"fan-{key}-{i}",
            "agent_slug": "fanout",
            "uid": "bench",
            "request_id": f"fan-{key}-{i}",
            "input_payload": {"step": i},
        }
        for i in range(count)
    ]


def _slice(repo: AgentRunRepository, size: int | str, seconds: float) -> int:
    made = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if size == SINGLE:
            repo.create_run(**_items(1)[0])
            made += 1
        else:
            assert isinstance(size, int)
            made += len(repo.create_runs(_items(size)))
    return made


def run_phase(url: str, quick: bool) -> dict[str, Any]:
    """Runs per second of create_run and of create_runs at each size, interleaved slices."""
    slices, seconds = (2, 0.3) if quick else (6, 1.0)
    variants: list[int | str] = [SINGLE, *SIZES]
    made = {str(v): 0 for v in variants}
    elapsed = {str(v): 0.0 for v in variants}
    with agent_runs.connect(url) as conn:
        repo = AgentRunRepository(conn)
        for variant in variants:  # warm-up: statements, caches
            _slice(repo, variant, 0.1)
        for _ in range(slices):
            for variant in variants:
                started = time.perf_counter()
                made[str(variant)] += _slice(repo, variant, seconds)
                elapsed[str(variant)] += time.perf_counter() - started
    rates = {v: made[v] / elapsed[v] if elapsed[v] else 0.0 for v in made}
    single = rates[SINGLE] or 1.0
    return {
        "slices": slices,
        "slice_seconds": seconds,
        "runs": made,
        "runs_per_second": rates,
        "vs_create_run": {v: rates[v] / single for v in rates},
    }


def render_phase(result: dict[str, Any]) -> list[str]:
    """Human lines for the report."""
    lines = [
        "fan-out: create_runs in one statement per batch (one client, "
        f"{result['slices']} interleaved slices of {result['slice_seconds']} s):"
    ]
    for variant, rate in result["runs_per_second"].items():
        label = SINGLE if variant == SINGLE else f"create_runs, batch {variant}"
        lines.append(
            f"  {label:<24} {rate:>9.0f} runs/s  x{result['vs_create_run'][variant]:.2f} "
            "of create_run"
        )
    return lines
