-- finish_batch_runs: the runs of finish_batch_lock that their live owner holds end as decided
-- (`finished`), each with its owner's open attempt, and wake whoever waits for them.
-- notes: sql/README.md (CASE not IN, data-modifying CTEs, wake-ups)

finished AS (
    UPDATE agent_runs r
    SET (status, error_type, error_message, output) =
        (d.status, d.error_type, d.error_message, d.output::jsonb),
        (worker_id, heartbeat_at, lease_expires_at) = (NULL, NULL, NULL),
        finished_at = clock.now,
        updated_at = clock.now
    FROM locked, decided d, clock
    WHERE r.id = locked.id AND d.run_id = r.id
      AND r.worker_id = d.worker_id
      AND r.lease_expires_at > clock.now
      AND CASE r.status
          WHEN 'running' THEN d.status IN ('completed', 'failed', 'interrupted')
          WHEN 'cancel_requested' THEN d.status = 'cancelled'
          END
    RETURNING r.id, r.status, r.error_type, r.error_message, r.finished_at, d.worker_id
),
-- Each run's owner is the worker_id its guard matched.
-- include: close_attempt,
--   where: a.run_id = ANY ((SELECT run_ids FROM batch)::text[]) AND a.run_id = finished.id
--    AND a.finished_at IS NULL
--    AND a.worker_id = finished.worker_id
-- include: notify_finished
