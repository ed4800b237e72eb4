-- Back to 0012: the FIFO claim index (created_at, id), 0012's time-window CHECKs, and no
-- available_at, priority or retry_at (their values go; the attempts' other facts stay).
-- transactional: false

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_claimable_fifo;

CREATE INDEX CONCURRENTLY ix_agent_runs_claimable_fifo
    ON agent_runs (created_at, id)
    WHERE status = 'pending' OR (status = 'cancel_requested' AND worker_id IS NULL);

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_claimable;

ALTER INDEX ix_agent_runs_claimable_fifo RENAME TO ix_agent_runs_claimable;

ALTER TABLE agent_runs DROP CONSTRAINT IF EXISTS ck_agent_runs_timestamps_in_window;

ALTER TABLE agent_runs ADD CONSTRAINT ck_agent_runs_timestamps_in_window CHECK (
        '[2000-01-01 00:00Z,9000-01-01 00:00Z)'::tstzrange @> ALL (ARRAY[
            created_at, updated_at, heartbeat_at, lease_expires_at, manifest_recorded_at,
            started_at, finished_at])
    ) NOT VALID;

ALTER TABLE agent_runs VALIDATE CONSTRAINT ck_agent_runs_timestamps_in_window;

ALTER TABLE agent_run_attempts DROP CONSTRAINT IF EXISTS ck_agent_run_attempts_timestamps_in_window;

ALTER TABLE agent_run_attempts ADD CONSTRAINT ck_agent_run_attempts_timestamps_in_window CHECK (
        '[2000-01-01 00:00Z,9000-01-01 00:00Z)'::tstzrange @> ALL (ARRAY[
            started_at, created_at, updated_at, heartbeat_at, lease_expires_at, finished_at])
    ) NOT VALID;

ALTER TABLE agent_run_attempts VALIDATE CONSTRAINT ck_agent_run_attempts_timestamps_in_window;

ALTER TABLE agent_runs DROP CONSTRAINT IF EXISTS ck_agent_runs_timestamps_in_range;

ALTER TABLE agent_runs RENAME CONSTRAINT ck_agent_runs_timestamps_in_window
    TO ck_agent_runs_timestamps_in_range;

ALTER TABLE agent_run_attempts DROP CONSTRAINT IF EXISTS ck_agent_run_attempts_timestamps_in_range;

ALTER TABLE agent_run_attempts RENAME CONSTRAINT ck_agent_run_attempts_timestamps_in_window
    TO ck_agent_run_attempts_timestamps_in_range;

ALTER TABLE agent_runs DROP CONSTRAINT IF EXISTS ck_agent_runs_priority;

ALTER TABLE agent_run_attempts DROP COLUMN IF EXISTS retry_at;

ALTER TABLE agent_runs DROP COLUMN IF EXISTS priority;

DROP TRIGGER IF EXISTS agent_runs_available_at_default ON agent_runs;

DROP FUNCTION IF EXISTS agent_runs_available_at_default();

ALTER TABLE agent_runs DROP COLUMN IF EXISTS available_at;
