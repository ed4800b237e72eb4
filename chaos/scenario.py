"""The seeded plan of a chaos run: which scripted runs, when they are enqueued, when faults fire.

Everything here derives from one `random.Random(seed)`, so a failing run reproduces from its
seed: the same runs, scripts, enqueue times, cancel requests and fault schedule. (Process timing
on a real machine still varies; the plan does not.)
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Final

# Kind of run -> relative weight in the mix. Every kind appears at least once.
KIND_WEIGHTS: Final[dict[str, int]] = {
    "ok": 26,  # ["ok"]
    "retry_ok": 14,  # ["retry", "ok"] or ["retry", "retry", "ok"]
    "retry_exhausted": 3,  # ["retry"]: failed / retries_exhausted after max_tries attempts
    "fail": 10,  # ["fail:<type>"]
    "interrupt": 8,  # ["interrupt"]
    "sleep": 14,  # ["sleep:<s>"], then ok
    "wait_cancel": 12,  # ["wait_cancel"] + a request_cancel issued by the suite
    "hang": 6,  # ["hang"]: heartbeat stopped, completion refused, reconciler fails it
    "crash": 5,  # ["crash"]: os._exit(137) mid-run, the whole worker process dies
}
FAIL_TYPES: Final = ("tool_error", "bad_input", "quota_exceeded")
AGENT_SLUG: Final = "scripted"
UID: Final = "chaos"


@dataclass(frozen=True, slots=True)
class PlannedRun:
    """One run the suite enqueues: its id, kind, script and times (seconds from the start)."""

    index: int
    run_id: str
    kind: str
    script: tuple[str, ...]
    enqueue_at: float
    cancel_at: float | None  # when the suite calls request_cancel (wait_cancel runs only)

    @property
    def request_id(self) -> str:
        return f"chaos-{self.index:04d}"

    @property
    def thread_id(self) -> str:
        return f"thread-{self.index:04d}"

    @property
    def all_ok(self) -> bool:
        return all(step == "ok" for step in self.script)


@dataclass(frozen=True, slots=True)
class PlannedFault:
    """A fault to inject at `at` seconds; `pick` in [0, 1) chooses its target among live ones."""

    at: float
    kind: str  # "sigkill" | "terminate" | "restart"
    pick: float
    burst: bool = False  # terminate: every backend of the chosen worker, not just one
    tries: int = 0  # how often it found no target yet (it is then retried a little later)


@dataclass(frozen=True, slots=True)
class Plan:
    seed: int
    runs: tuple[PlannedRun, ...]
    faults: tuple[PlannedFault, ...]

    def kind_counts(self) -> Counter[str]:
        return Counter(run.kind for run in self.runs)

    def fault_counts(self) -> Counter[str]:
        return Counter(fault.kind for fault in self.faults)


def _script(kind: str, rng: random.Random) -> tuple[str, ...]:
    if kind == "ok":
        return ("ok",)
    if kind == "retry_ok":
        return ("retry", "ok") if rng.random() < 0.7 else ("retry", "retry", "ok")
    if kind == "retry_exhausted":
        return ("retry",)
    if kind == "fail":
        return (f"fail:{rng.choice(FAIL_TYPES)}",)
    if kind == "interrupt":
        return ("interrupt",)
    if kind == "sleep":
        return (f"sleep:{rng.uniform(0.2, 1.5):.2f}",)
    if kind in ("wait_cancel", "hang", "crash"):
        return (kind,)
    raise ValueError(f"unknown run kind {kind!r}")


def make_plan(
    seed: int,
    *,
    runs: int,
    duration: float,
    terminations: int,
    kills: int,
    restarts: int,
) -> Plan:
    """The deterministic plan for `seed`: runs enqueued over the first 85% of `duration`,
    faults spread over [5%, 95%] of it, the restart(s) in its middle third."""
    if runs < len(KIND_WEIGHTS):
        raise ValueError(f"need at least {len(KIND_WEIGHTS)} runs, one of each kind")
    rng = random.Random(seed)
    kinds = list(KIND_WEIGHTS)
    weights = [KIND_WEIGHTS[k] for k in kinds]
    chosen = kinds + rng.choices(kinds, weights=weights, k=runs - len(kinds))
    rng.shuffle(chosen)
    enqueue_times = sorted(rng.uniform(0.0, 0.85 * duration) for _ in range(runs))
    planned: list[PlannedRun] = []
    for index, (kind, at) in enumerate(zip(chosen, enqueue_times, strict=True), start=1):
        cancel_at = at + rng.uniform(0.3, 4.0) if kind == "wait_cancel" else None
        planned.append(
            PlannedRun(
                index=index,
                run_id=f"run-{index:04d}-{kind}",
                kind=kind,
                script=_script(kind, rng),
                enqueue_at=round(at, 3),
                cancel_at=None if cancel_at is None else round(cancel_at, 3),
            )
        )

    faults: list[PlannedFault] = []
    for _ in range(terminations):
        faults.append(
            PlannedFault(
                at=rng.uniform(0.05, 0.95) * duration,
                kind="terminate",
                pick=rng.random(),
                burst=rng.random() < 0.25,
            )
        )
    for _ in range(kills):
        faults.append(
            PlannedFault(at=rng.uniform(0.1, 0.9) * duration, kind="sigkill", pick=rng.random())
        )
    for _ in range(restarts):
        faults.append(
            PlannedFault(at=rng.uniform(0.35, 0.65) * duration, kind="restart", pick=rng.random())
        )
    faults.sort(key=lambda f: f.at)
    return Plan(seed=seed, runs=tuple(planned), faults=tuple(faults))
