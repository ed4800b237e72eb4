-- The attempts' update guard as an AFTER UPDATE trigger that fires only for a forbidden change.
--
-- A BEFORE UPDATE row trigger makes PostgreSQL lock each row before it fires (a WAL record per
-- heartbeat and per close) and runs PL/pgSQL on every update. An AFTER UPDATE trigger whose WHEN
-- clause names the forbidden changes costs nothing on an allowed update and refuses the same
-- ones, with the same SQLSTATE (restrict_violation): the statement fails at its end and
-- nothing it wrote stays. Deletes are still refused BEFORE, by the function of 0002.
--
-- On a populated table: DROP/CREATE TRIGGER take a SHARE ROW EXCLUSIVE lock on
-- agent_run_attempts for the few milliseconds of this transaction (no scan, no rewrite);
-- writers wait for it, readers do not. One transaction: the table is never unguarded.
-- depends: 0004_operator_indexes

DROP TRIGGER agent_run_attempts_guard ON agent_run_attempts;

CREATE TRIGGER agent_run_attempts_guard
    BEFORE DELETE ON agent_run_attempts
    FOR EACH ROW EXECUTE FUNCTION agent_run_attempts_guard();

-- The WHEN clause is the whole rule, 0002's conditions joined by OR; 0002's function, fired
-- only then, says which part was broken (an AFTER trigger's result is ignored: it always raises).
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
