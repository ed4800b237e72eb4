-- Recovery policy: agent_run_policies (one row per agent slug, '*' the default for slugs
-- without one), agent_run_requeues (an operator's requeue of an ended run, an immutable fact),
-- and the attempts' guard extended to retry_at.
--
-- Requeues are facts like finished attempts: no UPDATE at all, no DELETE while the run exists
-- (deleting the run removes them). A run's attempts in budget are those started at or after
-- its latest requeue, found through ix_agent_run_requeues_run.
--
-- The attempts' guard: retry_at is written only by the UPDATE that finishes an attempt (an
-- open attempt may not set it alone), and never after; the function of 0002 names it.
--
-- On a populated database: two new empty tables; the guard's function and trigger are
-- replaced in this one transaction (SHARE ROW EXCLUSIVE on agent_run_attempts for its
-- milliseconds: writers wait, readers do not; the table is never unguarded).
-- depends: 0013_schedule_and_priority

CREATE TABLE agent_run_policies (
    agent_slug          text             PRIMARY KEY,
    max_attempts        integer          NOT NULL,
    max_lost_leases     integer          NOT NULL,
    backoff_seconds     double precision NOT NULL,
    backoff_max_seconds double precision NOT NULL,
    backoff_jitter      double precision NOT NULL,
    deadline_seconds    double precision NULL,
    updated_at          timestamptz      NOT NULL DEFAULT now(),

    CONSTRAINT ck_agent_run_policies_agent_slug CHECK (length(agent_slug) BETWEEN 1 AND 64),
    CONSTRAINT ck_agent_run_policies_max_attempts CHECK (max_attempts >= 1),
    CONSTRAINT ck_agent_run_policies_max_lost_leases CHECK (max_lost_leases >= 0),
    CONSTRAINT ck_agent_run_policies_backoff CHECK (
        backoff_seconds >= 0 AND backoff_max_seconds >= backoff_seconds
        AND backoff_max_seconds <= 31536000),
    CONSTRAINT ck_agent_run_policies_jitter CHECK (backoff_jitter BETWEEN 0 AND 1),
    CONSTRAINT ck_agent_run_policies_deadline CHECK (
        deadline_seconds IS NULL OR (deadline_seconds > 0 AND deadline_seconds <= 315360000))
);

CREATE TABLE agent_run_requeues (
    id                  bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id              text        NOT NULL REFERENCES agent_runs (id) ON DELETE CASCADE,
    requeued_at         timestamptz NOT NULL,
    previous_status     text        NOT NULL,
    previous_error_type text        NULL,
    reason              text        NULL,

    CONSTRAINT ck_agent_run_requeues_previous_status CHECK (
        previous_status IN ('failed', 'cancelled', 'interrupted')),
    CONSTRAINT ck_agent_run_requeues_requeued_at_in_range CHECK (
        '[2000-01-01 00:00Z,9000-01-01 00:00Z)'::tstzrange @> requeued_at)
);

CREATE INDEX ix_agent_run_requeues_run ON agent_run_requeues (run_id, requeued_at);

CREATE FUNCTION agent_run_requeues_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF EXISTS (SELECT 1 FROM agent_runs WHERE id = OLD.run_id) THEN
            RAISE EXCEPTION 'requeue id=% of run_id=% cannot be deleted while its run exists',
                OLD.id, OLD.run_id
                USING ERRCODE = 'restrict_violation',
                      HINT = 'Requeues are facts; delete the run to remove its history.';
        END IF;
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'requeue id=% of run_id=% is immutable', OLD.id, OLD.run_id
        USING ERRCODE = 'restrict_violation';
END
$$;

CREATE TRIGGER agent_run_requeues_guard
    BEFORE UPDATE OR DELETE ON agent_run_requeues
    FOR EACH ROW EXECUTE FUNCTION agent_run_requeues_guard();

CREATE OR REPLACE FUNCTION agent_run_attempts_guard() RETURNS trigger
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
            OR NEW.error_message IS DISTINCT FROM OLD.error_message
            OR NEW.retry_at IS DISTINCT FROM OLD.retry_at) THEN
        RAISE EXCEPTION 'attempt id=% of run_id=% is open: it may only renew its lease or be finished',
            OLD.id, OLD.run_id
            USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER agent_run_attempts_update_guard ON agent_run_attempts;

CREATE TRIGGER agent_run_attempts_update_guard
    AFTER UPDATE ON agent_run_attempts
    FOR EACH ROW
    WHEN (OLD.finished_at IS NOT NULL
          OR NEW.id IS DISTINCT FROM OLD.id
          OR NEW.run_id IS DISTINCT FROM OLD.run_id
          OR NEW.attempt_no IS DISTINCT FROM OLD.attempt_no
          OR NEW.worker_id IS DISTINCT FROM OLD.worker_id
          OR NEW.started_at IS DISTINCT FROM OLD.started_at
          OR NEW.created_at IS DISTINCT FROM OLD.created_at
          OR (NEW.finished_at IS NULL
              AND (NEW.outcome IS DISTINCT FROM OLD.outcome
                   OR NEW.error_type IS DISTINCT FROM OLD.error_type
                   OR NEW.error_message IS DISTINCT FROM OLD.error_message
                   OR NEW.retry_at IS DISTINCT FROM OLD.retry_at)))
    EXECUTE FUNCTION agent_run_attempts_guard();
