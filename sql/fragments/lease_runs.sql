-- lease_runs: the claim's UPDATE of its runs: running (a cancel_requested run stays so), owned,
-- leased until lease.expires_at, started once.
-- slots: owner (the worker_id), from, where, attempt_no (the opened attempt's number)
-- notes: sql/README.md (data-modifying CTEs)

UPDATE agent_runs r
SET status = CASE WHEN r.status = 'pending' THEN 'running' ELSE r.status END,
    worker_id = {{owner}},
    heartbeat_at = lease.now,
    lease_expires_at = lease.expires_at,
    started_at = coalesce(r.started_at, lease.now),
    updated_at = lease.now
FROM {{from}}
WHERE {{where}}
RETURNING r.*, {{attempt_no}}
