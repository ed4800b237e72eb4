-- oldest_waiting_run: the `waiting` CTE of a limit's change: the agent_slug of the key's oldest
-- run that waits to be claimed (pending, or cancel_requested without an owner), if any.
-- notes: sql/README.md (limits per key, wake-ups)

waiting AS (
    SELECT r.agent_slug FROM agent_runs r
    WHERE r.concurrency_key = %(concurrency_key)s::text
      AND r.status IN ('pending', 'running', 'cancel_requested')
      AND (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
    ORDER BY r.created_at, r.id
    LIMIT 1
)
