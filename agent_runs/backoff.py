"""Capped exponential back-off with jitter, for retries against an unavailable database."""

from __future__ import annotations

import random

# A generator of its own: the jitter must not touch (or depend on) the global random state.
_jitter = random.Random()


class Backoff:
    """Delays of initial, 2 x initial, … up to `cap`, each scaled by a random 0.5–1.0."""

    def __init__(self, *, initial: float = 0.1, cap: float = 5.0) -> None:
        self.initial = initial
        self.cap = cap
        self.failures = 0

    def next_delay(self) -> float:
        delay = min(self.cap, self.initial * 2.0 ** min(self.failures, 30))
        self.failures += 1
        return delay * _jitter.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.failures = 0
