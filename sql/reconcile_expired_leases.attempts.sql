-- reconcile_expired_leases.attempts: the attempts a reconcile pass closed (telemetry only).
-- from: the converged runs, by id and the finished_at the pass gave them
-- to:   nothing (read only; in the pass's own transaction, which sees its writes)
-- returns: (run_id, attempt_no, started_at, finished_at) of each attempt closed lease_expired
SELECT a.run_id, a.attempt_no, a.started_at, a.finished_at
FROM unnest(%(run_ids)s::text[], %(finished_ats)s::timestamptz[]) AS c (run_id, finished_at)
JOIN agent_run_attempts a ON a.run_id = c.run_id AND a.finished_at = c.finished_at
WHERE a.outcome = 'lease_expired'
