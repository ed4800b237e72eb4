-- Scheduling: agent_runs.available_at and agent_runs.priority, agent_run_attempts.retry_at, and
-- the claim index in the new claim order (priority, available_at, id).
--
-- available_at: a run is claimable once available_at <= now. A run inserted without one gets
-- its created_at (a trigger whose WHEN is false when the INSERT gives one, as create_run
-- does), so a run nobody delays keeps today's FIFO place; existing runs get their created_at. priority: 0 (first) to 9.
-- retry_at: when the transition that closed an attempt scheduled the next one, the time it set;
-- part of the attempt's immutable fact (the guard of 0014 refuses it on an open attempt).
--
-- On a populated database, step by step (no transaction around the whole; every step can be
-- run again):
-- - ADD COLUMN without a default: a catalog change under a brief ACCESS EXCLUSIVE lock, no
--   rewrite (a DEFAULT now() would stamp every existing run with this migration's time instead
--   of its created_at); the insert trigger then fills it for runs created meanwhile.
-- - the back-fill copies created_at in batches of 10,000 rows, each batch its own commit: row
--   locks only, for a batch at a time; renewals and claims go on between batches.
-- - NOT NULL: a CHECK added NOT VALID and validated (a scan that lets reads and writes go on),
--   after which SET NOT NULL uses it instead of scanning under ACCESS EXCLUSIVE.
-- - priority: ADD COLUMN with a constant default is a catalog change (no rewrite).
-- - the time-window CHECKs of 0012 now cover available_at and retry_at (same window, same
--   names): added NOT VALID, validated, swapped, as 0012 did.
-- - the claim index is built CONCURRENTLY under a new name, the old one dropped CONCURRENTLY,
--   and the new one renamed (a brief lock): claims always have one of the two.
-- Renewals stay HOT: no index names a column a renewal changes (available_at and priority are
-- written only by creation, release, retry and requeue).
-- transactional: false
-- depends: 0012_compact_time_checks

ALTER TABLE agent_runs ADD COLUMN IF NOT EXISTS available_at timestamptz;

-- A run inserted without available_at (an INSERT that does not name it) gets its created_at.
-- create_run and create_runs always name it, so the trigger's WHEN is false on their path.
CREATE OR REPLACE FUNCTION agent_runs_available_at_default() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.available_at := NEW.created_at;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS agent_runs_available_at_default ON agent_runs;

CREATE TRIGGER agent_runs_available_at_default
    BEFORE INSERT ON agent_runs
    FOR EACH ROW
    WHEN (NEW.available_at IS NULL)
    EXECUTE FUNCTION agent_runs_available_at_default();

ALTER TABLE agent_runs ADD COLUMN IF NOT EXISTS priority smallint NOT NULL DEFAULT 0;

ALTER TABLE agent_run_attempts ADD COLUMN IF NOT EXISTS retry_at timestamptz;

CREATE OR REPLACE PROCEDURE agent_runs_backfill_available_at()
LANGUAGE plpgsql AS $$
DECLARE
    touched bigint;
BEGIN
    LOOP
        UPDATE agent_runs r SET available_at = r.created_at
        WHERE r.id IN (SELECT id FROM agent_runs WHERE available_at IS NULL LIMIT 10000);
        GET DIAGNOSTICS touched = ROW_COUNT;
        COMMIT;
        EXIT WHEN touched = 0;
    END LOOP;
END
$$;

CALL agent_runs_backfill_available_at();

DROP PROCEDURE agent_runs_backfill_available_at();

ALTER TABLE agent_runs DROP CONSTRAINT IF EXISTS ck_agent_runs_available_at_not_null;

ALTER TABLE agent_runs ADD CONSTRAINT ck_agent_runs_available_at_not_null
    CHECK (available_at IS NOT NULL) NOT VALID;

ALTER TABLE agent_runs VALIDATE CONSTRAINT ck_agent_runs_available_at_not_null;

ALTER TABLE agent_runs ALTER COLUMN available_at SET NOT NULL;

ALTER TABLE agent_runs DROP CONSTRAINT ck_agent_runs_available_at_not_null;

ALTER TABLE agent_runs DROP CONSTRAINT IF EXISTS ck_agent_runs_priority;

ALTER TABLE agent_runs ADD CONSTRAINT ck_agent_runs_priority
    CHECK (priority BETWEEN 0 AND 9) NOT VALID;

ALTER TABLE agent_runs VALIDATE CONSTRAINT ck_agent_runs_priority;

ALTER TABLE agent_runs DROP CONSTRAINT IF EXISTS ck_agent_runs_timestamps_in_window;

ALTER TABLE agent_runs ADD CONSTRAINT ck_agent_runs_timestamps_in_window CHECK (
        '[2000-01-01 00:00Z,9000-01-01 00:00Z)'::tstzrange @> ALL (ARRAY[
            created_at, updated_at, heartbeat_at, lease_expires_at, manifest_recorded_at,
            started_at, finished_at, available_at])
    ) NOT VALID;

ALTER TABLE agent_runs VALIDATE CONSTRAINT ck_agent_runs_timestamps_in_window;

ALTER TABLE agent_run_attempts DROP CONSTRAINT IF EXISTS ck_agent_run_attempts_timestamps_in_window;

ALTER TABLE agent_run_attempts ADD CONSTRAINT ck_agent_run_attempts_timestamps_in_window CHECK (
        '[2000-01-01 00:00Z,9000-01-01 00:00Z)'::tstzrange @> ALL (ARRAY[
            started_at, created_at, updated_at, heartbeat_at, lease_expires_at, finished_at,
            retry_at])
    ) NOT VALID;

ALTER TABLE agent_run_attempts VALIDATE CONSTRAINT ck_agent_run_attempts_timestamps_in_window;

ALTER TABLE agent_runs DROP CONSTRAINT IF EXISTS ck_agent_runs_timestamps_in_range;

ALTER TABLE agent_runs RENAME CONSTRAINT ck_agent_runs_timestamps_in_window
    TO ck_agent_runs_timestamps_in_range;

ALTER TABLE agent_run_attempts DROP CONSTRAINT IF EXISTS ck_agent_run_attempts_timestamps_in_range;

ALTER TABLE agent_run_attempts RENAME CONSTRAINT ck_agent_run_attempts_timestamps_in_window
    TO ck_agent_run_attempts_timestamps_in_range;

-- Claims read it one priority at a time (priority = p AND available_at <= now): runs scheduled
-- for later sit after the available ones of their priority and are never read.
DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_claimable_next;

CREATE INDEX CONCURRENTLY ix_agent_runs_claimable_next
    ON agent_runs (priority, available_at, id)
    WHERE status = 'pending' OR (status = 'cancel_requested' AND worker_id IS NULL);

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_claimable;

ALTER INDEX ix_agent_runs_claimable_next RENAME TO ix_agent_runs_claimable;
