"""The sizes and durations of one `make bench` run: FULL, or QUICK for a smoke run."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

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
