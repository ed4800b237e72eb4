-- retry_or_fail: the live owner reports a transient failure; the run's policy decides.
-- from: running, same worker_id, lease_expires_at > now
-- to:   attempts in budget < max_attempts and deadline not passed: pending, available_at =
--       now + delay (kept when the delay is 0), attempt -> retry_released with the error and
--       retry_at; else failed / retries_exhausted | deadline_exceeded, attempt -> failed with
--       it, the message keeping the original error. Wakes agent_runs_claimable (retried) or
--       agent_runs_finished (failed, for a run someone waits for)
-- returns: the run as it is now with changed, the locked run unchanged when refused
-- notes: sql/README.md (clock, CASE not IN, data-modifying CTEs, wake-ups, policies)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
locked AS (
    SELECT r.id, r.agent_slug, r.created_at
    FROM agent_runs r, clock
    WHERE r.id = %(run_id)s
      AND CASE r.status WHEN 'running' THEN true END
      AND r.worker_id = %(worker_id)s::text
      AND r.lease_expires_at > clock.now
    FOR UPDATE OF r
),
policy AS (
    -- The slug's row, else the '*' row, else the built-in policy (3, 0, 0 s, 3600 s, 0.2,
    -- no deadline); a worker's max_tries caps max_attempts.
    SELECT coalesce(least(p.max_attempts, %(max_attempts)s::int), %(max_attempts)s::int, 3)
               AS max_attempts,
           -- include: policy_defaults
    FROM locked
    -- include: run_policy
    --   run: locked
),
budget AS (
    -- Attempts in budget: started at or after the latest requeue, the open one included.
    SELECT count(*) AS n
    FROM agent_run_attempts a
    WHERE a.run_id = %(run_id)s
      -- include: in_budget
      --   run: %(run_id)s
),
decision AS (
    SELECT locked.id, budget.n, policy.max_attempts, policy.deadline_seconds,
           CASE WHEN budget.n >= policy.max_attempts THEN 'retries_exhausted'
                WHEN clock.now > locked.created_at
                                 + make_interval(secs => policy.deadline_seconds)
                    THEN 'deadline_exceeded'
           END AS exhausted,
           CASE WHEN %(retry_after_seconds)s::float8 IS NOT NULL
                    THEN least(%(retry_after_seconds)s::float8, policy.backoff_max_seconds)
                ELSE
                    -- include: backoff_delay
                    --   policy: policy
                    --   n: budget.n
           END AS delay
    FROM locked, policy, budget, clock
),
ended AS (
    UPDATE agent_runs r
    SET status = CASE WHEN d.exhausted IS NULL THEN 'pending' ELSE 'failed' END,
        error_type = d.exhausted,
        error_message = CASE d.exhausted
            WHEN 'retries_exhausted' THEN
                'attempt ' || d.n || ' of ' || d.max_attempts
                || ' failed with a retryable error: ' || %(shown_error)s::text
            WHEN 'deadline_exceeded' THEN
                'attempt ' || d.n || ' failed with a retryable error after the deadline ('
                || d.deadline_seconds || ' s after creation) passed: ' || %(shown_error)s::text
            END,
    -- include: apply_decision
    WHERE r.id = d.id
    RETURNING r.*
),
attempt AS (
    UPDATE agent_run_attempts a
    SET (finished_at, updated_at) = (ended.updated_at, ended.updated_at),
        outcome = CASE ended.status WHEN 'pending' THEN 'retry_released' ELSE 'failed' END,
        error_type = coalesce(ended.error_type, %(error_type)s::text),
        error_message = coalesce(ended.error_message, %(error_message)s::text),
        retry_at = CASE ended.status WHEN 'pending' THEN ended.available_at END
    FROM ended
    WHERE a.run_id = %(run_id)s AND a.run_id = ended.id AND a.finished_at IS NULL
      AND a.worker_id = %(worker_id)s::text
    RETURNING a.id
),
refused AS (
    SELECT r.*
    FROM agent_runs r
    WHERE r.id = %(run_id)s AND NOT EXISTS (SELECT FROM locked)
),
-- include: notify_retried_or_finished
--   run: ended
SELECT true AS changed, ended.* FROM ended
WHERE (SELECT count(*) FROM notified) >= 0 AND (SELECT count(*) FROM attempt) >= 0
UNION ALL
SELECT false AS changed, refused.* FROM refused
