"""Recovery policy values: RunPolicy (what decides retries, back-off, lost leases and
deadlines for an agent slug) and RunRequeue (an operator's requeue of an ended run)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Final

# The policy of a slug with no row and no '*' row (the same constants are in sql/*.sql).
BUILT_IN_SOURCE: Final = "built-in"


@dataclass(frozen=True, slots=True)
class RunPolicy:
    """The effective recovery policy of `agent_slug`; `source` says where it comes from: the
    slug's own row, the default row `'*'`, or `"built-in"` (no row at all)."""

    agent_slug: str
    max_attempts: int = 3
    max_lost_leases: int = 0
    backoff_seconds: float = 0.0
    backoff_max_seconds: float = 3600.0
    backoff_jitter: float = 0.2
    deadline_seconds: float | None = None
    source: str = BUILT_IN_SOURCE
    updated_at: datetime | None = None

    def delay_seconds(self, n: int, u: float = 0.0) -> float:
        """The back-off before attempt n + 1 after attempt n (in budget) ended, for a uniform
        u in [0, 1): min(backoff_max, backoff × 2^(n−1)) × (1 − jitter × u)."""
        base = min(self.backoff_max_seconds, self.backoff_seconds * 2.0 ** min(n - 1, 60))
        return base * (1 - self.backoff_jitter * u)


@dataclass(frozen=True, slots=True)
class RunRequeue:
    """One row of agent_run_requeues: an ended run an operator sent back to the queue."""

    id: int
    run_id: str
    requeued_at: datetime
    previous_status: str
    previous_error_type: str | None
    reason: str | None
