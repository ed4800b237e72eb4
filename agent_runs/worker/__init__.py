"""Synchronous worker runtime: claim a run, execute an agent, heartbeat the lease, record the end.

The package, one job per module: `protocol` (what an agent is and sees), `heartbeat` (leases
held, renewed in batches, cancel requests seen), `outcome` (the decision, a pure function),
`completer` (writing it with a proven lease), `claimer` (run_forever's claims, one statement for
the free slots), `flusher` (the writer thread for handed-over ends), `batching` (run_once's group
commit), `claims` (the claim statements, the lost-reply search), `executor` (one claimed run:
cancel checks, the agent call, the end decided and handed), `reconciler` (the reconcile pass),
`loop` (a run_forever thread), `runtime` (the Worker: construction, lifecycle, run_once).
"""

from __future__ import annotations

from agent_runs.backoff import Backoff
from agent_runs.errors import LeaseLost, RetryableError
from agent_runs.worker.heartbeat import HeartbeatService
from agent_runs.worker.protocol import Agent, AgentResult, RunContext
from agent_runs.worker.runtime import Worker

__all__ = [
    "Agent",
    "AgentResult",
    "Backoff",
    "HeartbeatService",
    "LeaseLost",
    "RetryableError",
    "RunContext",
    "Worker",
]
