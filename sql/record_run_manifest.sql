-- record_run_manifest: record the run's manifest once, by the owner of the running run.
-- from: running, same worker_id, lease_expires_at > now, no fingerprint recorded yet
-- to:   manifest, manifest_fingerprint, manifest_recorded_at = now (a recorded one stays)
-- returns: no row for a missing run, else `changed`, `is_owner` and the run as it is now
-- notes: sql/README.md (clock, data-modifying CTEs)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
locked AS (
    SELECT r.*,
           (r.status = 'running'
            AND r.worker_id = %(worker_id)s::text
            AND r.lease_expires_at > clock.now) AS is_owner
    FROM agent_runs r, clock
    WHERE r.id = %(run_id)s
    FOR UPDATE OF r
),
recorded AS (
    UPDATE agent_runs r
    SET manifest = %(manifest)s::jsonb,
        manifest_fingerprint = %(fingerprint)s::text,
        manifest_recorded_at = clock.now,
        updated_at = clock.now
    FROM locked, clock
    WHERE r.id = locked.id AND locked.is_owner AND locked.manifest_fingerprint IS NULL
    RETURNING r.*, locked.is_owner
)
SELECT true AS changed, recorded.* FROM recorded
UNION ALL
SELECT false AS changed, locked.* FROM locked WHERE NOT EXISTS (SELECT FROM recorded)
