-- Back to 0013: the attempts' guard of 0005 (retry_at stays a column, unguarded on open
-- attempts as before 0014), and no policies or requeues (their rows go).

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
                   OR NEW.error_message IS DISTINCT FROM OLD.error_message)))
    EXECUTE FUNCTION agent_run_attempts_guard();

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
            OR NEW.error_message IS DISTINCT FROM OLD.error_message) THEN
        RAISE EXCEPTION 'attempt id=% of run_id=% is open: it may only renew its lease or be finished',
            OLD.id, OLD.run_id
            USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END
$$;

DROP TABLE agent_run_requeues;

DROP FUNCTION agent_run_requeues_guard();

DROP TABLE agent_run_policies;
