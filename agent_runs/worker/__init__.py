"""Synchronous worker: claim a run, execute an agent, heartbeat the lease, record the end.

The package is a pipeline of parts, one job per module, wired together by `runtime` (the
Worker) and holding nothing of it: `claims` (the claim statements and the one search for claims
whose reply was lost) feed `claimer` (the claim source: free slots, the queue of claimed runs),
which feeds the run_forever threads (`loop`); each executes a run (`executor`: cancel checks,
the agent call, the end decided and handed) and hands its end to `flusher` (the writer thread),
which writes it through `completer` (a decision written while its lease can be proven) and gives
the slot back to the claim source. Beside them: `lease` (a lease held, a run claimed),
`heartbeat` (leases renewed in batches, cancel requests seen), `protocol` (what an agent is and
sees; `result`: AgentResult), `outcome` (the decision, a pure function), `batching` (group
commit: run_once's claims and ends), `reconciler`, `listening` (the wake-up listener),
`checkout` (a connection per call), `coroutines`, `subagents`.
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
