-- Bounds the module relies on to read back every row it can write.
--
-- Timestamps: every timestamp of both tables lies in [2000-01-01, 9000-01-01) UTC, finite and
-- far enough from the limits of timestamptz that it always reads back as a Python datetime
-- (the module refuses a `now` or a `now + lease_seconds` outside the same window).
-- JSON: input_payload and manifest are objects nested at most 64 containers deep whose numbers
-- are below 1e4000 in magnitude, as the module requires (deeper documents or longer integers
-- cannot be read back). A trigger, not a CHECK: a CHECK would run on every heartbeat.
--
-- The CHECKs are added NOT VALID, then validated in statements of their own: adding takes a
-- brief exclusive lock, validating scans the table under a lock that lets reads and writes go
-- on. Hence no transaction around the whole; should a step fail (a row out of bounds), the
-- steps before it are undone and the migration can be run again once the row is fixed.
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

-- Why a document is out of bounds (not an object, nested too deep, a number too long), or NULL.
CREATE FUNCTION agent_runs_json_problem(doc jsonb) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    IF doc IS NULL THEN
        RETURN NULL;
    ELSIF jsonb_typeof(doc) <> 'object' THEN
        RETURN 'is not an object';
    ELSIF jsonb_path_exists(
            doc, 'strict $.**{64 to last} ? (@.type() == "object" || @.type() == "array")') THEN
        RETURN 'nests more than 64 objects/arrays';
    ELSIF jsonb_path_exists(
            doc, 'strict $.** ? (@.type() == "number" && (@ >= 1e4000 || @ <= -1e4000))') THEN
        RETURN 'holds a number of 4,000 digits or more';
    END IF;
    RETURN NULL;
END
$$;

CREATE FUNCTION agent_runs_json_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    problem text;
BEGIN
    IF TG_OP = 'INSERT' OR NEW.input_payload IS DISTINCT FROM OLD.input_payload THEN
        problem := agent_runs_json_problem(NEW.input_payload);
        IF problem IS NOT NULL THEN
            RAISE EXCEPTION 'run id=%: input_payload %', NEW.id, problem
                USING ERRCODE = 'check_violation';
        END IF;
    END IF;
    IF NEW.manifest IS NOT NULL
       AND (TG_OP = 'INSERT' OR NEW.manifest IS DISTINCT FROM OLD.manifest) THEN
        problem := agent_runs_json_problem(NEW.manifest);
        IF problem IS NOT NULL THEN
            RAISE EXCEPTION 'run id=%: manifest %', NEW.id, problem
                USING ERRCODE = 'check_violation';
        END IF;
    END IF;
    RETURN NEW;
END
$$;

-- Fires only when a statement writes one of the two columns (never on a heartbeat).
CREATE TRIGGER agent_runs_json_guard
    BEFORE INSERT OR UPDATE OF input_payload, manifest ON agent_runs
    FOR EACH ROW EXECUTE FUNCTION agent_runs_json_guard();

ALTER TABLE agent_runs VALIDATE CONSTRAINT ck_agent_runs_timestamps_in_range;

ALTER TABLE agent_run_attempts VALIDATE CONSTRAINT ck_agent_run_attempts_timestamps_in_range;

-- Rows written before this migration are checked too.
DO $$
BEGIN
    IF EXISTS (SELECT FROM agent_runs
               WHERE agent_runs_json_problem(input_payload) IS NOT NULL
                  OR agent_runs_json_problem(manifest) IS NOT NULL) THEN
        RAISE EXCEPTION 'agent_runs holds an input_payload or manifest out of bounds'
            USING ERRCODE = 'check_violation';
    END IF;
END
$$;
