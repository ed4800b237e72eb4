-- Back to 0003's form of the time-window CHECKs (same window; added NOT VALID, validated, then
-- swapped for the compact ones, as the forward migration does).
-- transactional: false

ALTER TABLE agent_runs DROP CONSTRAINT IF EXISTS ck_agent_runs_timestamps_in_window;

ALTER TABLE agent_runs ADD CONSTRAINT ck_agent_runs_timestamps_in_window CHECK (
        (created_at >= '2000-01-01 00:00Z' AND created_at < '9000-01-01 00:00Z')
        AND (updated_at >= '2000-01-01 00:00Z' AND updated_at < '9000-01-01 00:00Z')
        AND (heartbeat_at IS NULL
             OR heartbeat_at >= '2000-01-01 00:00Z' AND heartbeat_at < '9000-01-01 00:00Z')
        AND (lease_expires_at IS NULL
             OR lease_expires_at >= '2000-01-01 00:00Z' AND lease_expires_at < '9000-01-01 00:00Z')
        AND (manifest_recorded_at IS NULL
             OR manifest_recorded_at >= '2000-01-01 00:00Z' AND manifest_recorded_at < '9000-01-01 00:00Z')
        AND (started_at IS NULL
             OR started_at >= '2000-01-01 00:00Z' AND started_at < '9000-01-01 00:00Z')
        AND (finished_at IS NULL
             OR finished_at >= '2000-01-01 00:00Z' AND finished_at < '9000-01-01 00:00Z')
    ) NOT VALID;

ALTER TABLE agent_runs VALIDATE CONSTRAINT ck_agent_runs_timestamps_in_window;

ALTER TABLE agent_run_attempts DROP CONSTRAINT IF EXISTS ck_agent_run_attempts_timestamps_in_window;

ALTER TABLE agent_run_attempts ADD CONSTRAINT ck_agent_run_attempts_timestamps_in_window CHECK (
        (started_at >= '2000-01-01 00:00Z' AND started_at < '9000-01-01 00:00Z')
        AND (created_at >= '2000-01-01 00:00Z' AND created_at < '9000-01-01 00:00Z')
        AND (updated_at >= '2000-01-01 00:00Z' AND updated_at < '9000-01-01 00:00Z')
        AND (heartbeat_at IS NULL
             OR heartbeat_at >= '2000-01-01 00:00Z' AND heartbeat_at < '9000-01-01 00:00Z')
        AND (lease_expires_at IS NULL
             OR lease_expires_at >= '2000-01-01 00:00Z' AND lease_expires_at < '9000-01-01 00:00Z')
        AND (finished_at IS NULL
             OR finished_at >= '2000-01-01 00:00Z' AND finished_at < '9000-01-01 00:00Z')
    ) NOT VALID;

ALTER TABLE agent_run_attempts VALIDATE CONSTRAINT ck_agent_run_attempts_timestamps_in_window;

ALTER TABLE agent_runs DROP CONSTRAINT IF EXISTS ck_agent_runs_timestamps_in_range;

ALTER TABLE agent_runs RENAME CONSTRAINT ck_agent_runs_timestamps_in_window
    TO ck_agent_runs_timestamps_in_range;

ALTER TABLE agent_run_attempts DROP CONSTRAINT IF EXISTS ck_agent_run_attempts_timestamps_in_range;

ALTER TABLE agent_run_attempts RENAME CONSTRAINT ck_agent_run_attempts_timestamps_in_window
    TO ck_agent_run_attempts_timestamps_in_range;
