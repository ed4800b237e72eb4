-- Every timestamp of both tables lies in [2000-01-01, 9000-01-01) UTC: finite, and far enough
-- from the limits of timestamptz that a row written here can always be read back as a Python
-- datetime (the module refuses a `now` or a `now + lease_seconds` outside the same window).
-- Added NOT VALID, then validated in their own statements: adding takes a brief exclusive lock,
-- validating scans the table under a lock that lets reads and writes go on. Hence not one
-- transaction; should validating fail (a row outside the window), both are dropped again.
-- depends: 0002_agent_run_attempts
-- transactional: false

ALTER TABLE agent_runs ADD CONSTRAINT ck_agent_runs_timestamps_in_range CHECK (
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

ALTER TABLE agent_run_attempts ADD CONSTRAINT ck_agent_run_attempts_timestamps_in_range CHECK (
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

ALTER TABLE agent_runs VALIDATE CONSTRAINT ck_agent_runs_timestamps_in_range;

ALTER TABLE agent_run_attempts VALIDATE CONSTRAINT ck_agent_run_attempts_timestamps_in_range;
