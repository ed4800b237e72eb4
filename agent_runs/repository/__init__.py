"""AgentRunRepository, over one psycopg connection, and the parts it is assembled from.

runs (the class: one run's creation, reads and transitions), worker_transitions (the worker's
claims, renewals and ends, batched), run_batches (create_runs), operator_queries (listings,
statistics, cancel trees, retention), recovery_transitions (retries, requeues, policies),
key_limits (limits per key), claim_plans (what every claim shares).
"""

from __future__ import annotations

from agent_runs.ids import new_run_id
from agent_runs.repository.claim_plans import LEASE_EXPIRED_MESSAGE
from agent_runs.repository.runs import AgentRunRepository

__all__ = ["LEASE_EXPIRED_MESSAGE", "AgentRunRepository", "new_run_id"]
