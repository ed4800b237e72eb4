-- record_resumed_from: write, once, the checkpoint the owner's open attempt resumed from.
-- from: running, of worker_id with a live lease (lease_expires_at > now); its open attempt
--       with no resume point yet
-- to:   the attempt's resumed_from and resumed_step (write-once: a trigger refuses a change)
-- returns: one row when written, none when refused (not the owner, or already recorded)
-- notes: sql/README.md (clock); the run row is locked first, as by every transition
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
owned AS (
    SELECT r.id
    FROM agent_runs r, clock
    WHERE r.id = %(run_id)s
      AND r.worker_id = %(worker_id)s::text
      AND r.status = 'running'
      AND r.lease_expires_at > clock.now
    FOR UPDATE OF r
)
UPDATE agent_run_attempts a
SET (resumed_from, resumed_step) = (%(checkpoint_id)s::text, %(step)s::integer)
FROM owned
WHERE a.run_id = owned.id AND a.finished_at IS NULL AND a.worker_id = %(worker_id)s::text
  AND a.resumed_from IS NULL
RETURNING a.id
