-- release_lease_for_retry: hand a running run back to the queue, by its live owner.
-- from: running, same worker_id, lease_expires_at > now
-- to:   pending, lease cleared, available_at = now + retry_after_seconds when given (else
--       kept); the owner's open attempt -> retry_released with the error
--       that made it retry, if any (the next claim opens attempt n + 1); wakes
--       agent_runs_claimable with the run's agent_slug
-- returns: the run's id when released, no row when refused
-- notes: sql/README.md (clock, CASE not IN, data-modifying CTEs, wake-ups)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
released AS (
    UPDATE agent_runs r
    SET status = 'pending',
        (worker_id, heartbeat_at, lease_expires_at) = (NULL, NULL, NULL),
        -- without a delay the run keeps its place in the queue
        available_at = coalesce(
            clock.now + make_interval(secs => %(retry_after_seconds)s::float8), r.available_at),
        updated_at = clock.now
    FROM clock
    WHERE r.id = %(run_id)s
      AND CASE r.status WHEN 'running' THEN true END
      AND r.worker_id = %(worker_id)s::text
      AND r.lease_expires_at > clock.now
    RETURNING r.id, r.agent_slug, r.updated_at,
              CASE WHEN %(retry_after_seconds)s::float8 IS NOT NULL THEN r.available_at END
              AS retry_at
),
finished AS (
    UPDATE agent_run_attempts a
    SET (finished_at, updated_at, outcome, error_type, error_message) =
        (released.updated_at, released.updated_at, 'retry_released', %(error_type)s::text,
         %(error_message)s::text),
        retry_at = released.retry_at
    FROM released
    WHERE a.run_id = %(run_id)s AND a.run_id = released.id AND a.finished_at IS NULL
      AND a.worker_id = %(worker_id)s::text
    RETURNING a.id
),
notified AS (
    SELECT pg_notify('agent_runs_claimable', released.agent_slug) FROM released
)
SELECT id FROM released
WHERE (SELECT count(*) FROM notified) >= 0
