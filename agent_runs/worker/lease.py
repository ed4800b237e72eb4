"""What the process holds: a lease it proves by its heartbeat, and a run claimed under one."""

from __future__ import annotations

import time
from dataclasses import dataclass

from agent_runs.models import AgentRun


class Lease:
    """What this process knows about one lease it holds; written by the heartbeat thread.

    A lease is proven live until `deadline` (monotonic): the moment a successful claim or renewal
    was *sent* plus the lease, so it never outlives the database's own expiry."""

    def __init__(self, run_id: str, worker_id: str, lease_seconds: float, deadline: float) -> None:
        self.run_id = run_id
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.deadline = deadline
        self.lost = False  # a renewal was refused: someone else decides this run's fate now
        self.cancel_requested = False
        self.heartbeat_stopped = False  # the agent opted out (ctx.stop_heartbeat)
        self.finishing = False  # the final write is under way: a refusal may be our own write
        self.written_later = False  # handed to the writer thread, which untracks it

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def provable(self) -> bool:
        return not self.lost and not self.expired()


@dataclass(frozen=True, slots=True)
class Claimed:
    """A run claimed under its own lease (already tracked by the heartbeat)."""

    run: AgentRun
    lease: Lease
    attempt_no: int | None  # None: found after a lost reply, its executor reads its attempt
