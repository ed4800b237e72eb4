"""The command line of `python -m chaos`, resolved."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Options:
    """The command line of `python -m chaos`, resolved."""

    seed: int
    runs: int
    workers: int
    concurrency: int
    lease_seconds: float
    heartbeat_seconds: float
    max_tries: int
    poll_seconds: float
    completion: str
    duration: float
    drain_seconds: float
    deadline: float
    terminations: int
    kills: int
    restarts: int
    restart_downtime: float
    keep_logs: bool
    quiet: bool
    # The scripted agent's recovery policy: lost leases tolerated, first back-off delay.
    max_lost_leases: int = 0
    backoff_seconds: float = 0.0
