-- oldest_waiting_run: the `waiting` CTE of a limit's change: the agent_slug of the key's next
-- run to claim (pending, or cancel_requested without an owner), available now, in claim order;
-- else of its oldest waiting run; none when the key has no waiting run.
-- notes: sql/README.md (limits per key, wake-ups)

waiting AS (
    -- The first run in claim order that is available now, parked or not (each read in its
    -- key's index), else the key's oldest waiting run.
    SELECT w.agent_slug FROM (
        (SELECT r.agent_slug, 0 AS later, r.priority, r.available_at, r.id FROM agent_runs r
         WHERE r.concurrency_key = %(concurrency_key)s::text AND r.key_waiting
           AND (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
           AND r.available_at <= now()
         ORDER BY r.priority, r.available_at, r.id
         LIMIT 1)
        UNION ALL
        (SELECT r.agent_slug, 0, r.priority, r.available_at, r.id FROM agent_runs r
         WHERE r.concurrency_key = %(concurrency_key)s::text AND NOT r.key_waiting
           AND (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
           AND r.available_at <= now()
         ORDER BY r.priority, r.available_at, r.id
         LIMIT 1)
        UNION ALL
        (SELECT r.agent_slug, 1, r.priority, r.available_at, r.id FROM agent_runs r
         WHERE r.concurrency_key = %(concurrency_key)s::text
           AND r.status IN ('pending', 'running', 'cancel_requested')
           AND (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
         ORDER BY r.created_at, r.id
         LIMIT 1)
    ) w
    ORDER BY w.later, w.priority, w.available_at, w.id
    LIMIT 1
)
