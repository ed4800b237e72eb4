-- The time-window CHECKs of 0003 in a compact form: the same window, the same refusals (a
-- check_violation naming ck_<table>_timestamps_in_range), a fraction of the cost.
--
-- PostgreSQL rebuilds every CHECK expression of a table from its stored form in each statement
-- that writes a row (prepared or not), so the cost grows with the expression's size: 0003's
-- window, two comparisons and a NULL test per column, made each single-row UPDATE of agent_runs
-- about 17 us of server CPU dearer (65.5 -> 48.6 us per update measured from PL/pgSQL, no
-- network and no commit; no CHECK at all: 46.5 us). One containment of every column in one
-- range constant refuses the same rows: a value outside [2000-01-01, 9000-01-01) UTC (infinity
-- included) makes a comparison false; a NULL column makes its comparison NULL, which a CHECK
-- lets pass, exactly as `col IS NULL OR ...` did.
--
-- On a populated database: each new CHECK is added NOT VALID (a brief exclusive lock), then
-- validated in a statement of its own (a scan that lets reads and writes go on); only then is
-- the old one dropped and the new one renamed (brief exclusive locks, no scan). The table is
-- guarded throughout. No transaction around the whole: a failed step can be run again.
-- depends: 0011_run_waiters
-- transactional: false

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
