-- agent_run_attempts: one immutable fact record per execution ownership of a run.
-- Runs created before this migration (legacy) get no attempt rows: nothing is back-filled.
-- depends: 0001_agent_runs

CREATE TABLE agent_run_attempts (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id           text        NOT NULL REFERENCES agent_runs (id) ON DELETE CASCADE,
    attempt_no       integer     NOT NULL,
    worker_id        text        NOT NULL,
    started_at       timestamptz NOT NULL,
    heartbeat_at     timestamptz,
    lease_expires_at timestamptz,
    finished_at      timestamptz,
    outcome          text,
    error_type       text,
    error_message    text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),

    CONSTRAINT uq_agent_run_attempts_run_attempt_no UNIQUE (run_id, attempt_no),
    CONSTRAINT ck_agent_run_attempts_attempt_no_positive CHECK (attempt_no > 0),
    CONSTRAINT ck_agent_run_attempts_outcome CHECK (
        outcome IN ('completed', 'failed', 'cancelled', 'interrupted',
                    'retry_released', 'lease_expired')),
    CONSTRAINT ck_agent_run_attempts_finished_has_outcome CHECK (
        (outcome IS NULL) = (finished_at IS NULL))
)
-- Open attempts are renewed in place with their run: leave room for HOT updates.
WITH (fillfactor = 80);

-- Never two owners: at most one open attempt per run.
CREATE UNIQUE INDEX uq_agent_run_attempts_one_open_per_run
    ON agent_run_attempts (run_id)
    WHERE finished_at IS NULL;

-- Facts are never rewritten. A finished attempt refuses every UPDATE, even a no-op one; an open
-- attempt may only refresh its heartbeat/lease or be finished once; identity never changes.
-- Deleting an attempt is refused while its run exists (deleting the run cascades).
CREATE FUNCTION agent_run_attempts_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF EXISTS (SELECT 1 FROM agent_runs WHERE id = OLD.run_id) THEN
            RAISE EXCEPTION 'attempt id=% of run_id=% cannot be deleted while its run exists',
                OLD.id, OLD.run_id
                USING ERRCODE = 'restrict_violation',
                      HINT = 'Attempts are facts; delete the run to remove its history.';
        END IF;
        RETURN OLD;
    END IF;

    IF OLD.finished_at IS NOT NULL THEN
        RAISE EXCEPTION 'attempt id=% of run_id=% is finished and immutable', OLD.id, OLD.run_id
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF NEW.id IS DISTINCT FROM OLD.id
       OR NEW.run_id IS DISTINCT FROM OLD.run_id
       OR NEW.attempt_no IS DISTINCT FROM OLD.attempt_no
       OR NEW.worker_id IS DISTINCT FROM OLD.worker_id
       OR NEW.started_at IS DISTINCT FROM OLD.started_at
       OR NEW.created_at IS DISTINCT FROM OLD.created_at THEN
        RAISE EXCEPTION 'attempt id=% of run_id=%: run_id, attempt_no, worker_id and started_at never change',
            OLD.id, OLD.run_id
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF NEW.finished_at IS NULL
       AND (NEW.outcome IS DISTINCT FROM OLD.outcome
            OR NEW.error_type IS DISTINCT FROM OLD.error_type
            OR NEW.error_message IS DISTINCT FROM OLD.error_message) THEN
        RAISE EXCEPTION 'attempt id=% of run_id=% is open: it may only renew its lease or be finished',
            OLD.id, OLD.run_id
            USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER agent_run_attempts_guard
    BEFORE UPDATE OR DELETE ON agent_run_attempts
    FOR EACH ROW EXECUTE FUNCTION agent_run_attempts_guard();
