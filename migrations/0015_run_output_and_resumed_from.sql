-- A run's result and where an attempt resumed a checkpointed execution.
--
-- agent_runs.output: the JSON value the transition that completes a run writes (an agent's
-- AgentResult.completed(output=...), set_terminal_status(..., output=...)); NULL until then and
-- for a run that ended otherwise, except an interrupted run, which may carry what it waits for.
-- Any JSON value, at most 1 MiB of JSON text (checked by the module before any SQL).
--
-- agent_run_attempts.resumed_from / resumed_step: the checkpoint an attempt resumed from and
-- its step (a LangGraph agent that picks up where an earlier attempt stopped). Both NULL, or
-- both set, once, while the attempt is open; part of the immutable fact after it finishes (the
-- guard of 0005 refuses any update of a finished attempt). A second trigger keeps them
-- write-once on an open attempt; like 0005's it fires only for a forbidden change.
--
-- On a populated database: ADD COLUMN of a nullable column without a default is a catalog
-- change (no rewrite); the CHECK is added NOT VALID (a brief lock) and validated in a statement
-- of its own (a scan that lets reads and writes go on); the trigger takes a brief lock. No
-- transaction around the whole: every step can be run again.
-- depends: 0012_compact_time_checks
-- transactional: false

ALTER TABLE agent_runs ADD COLUMN IF NOT EXISTS output jsonb;

ALTER TABLE agent_run_attempts ADD COLUMN IF NOT EXISTS resumed_from text,
    ADD COLUMN IF NOT EXISTS resumed_step integer;

ALTER TABLE agent_run_attempts DROP CONSTRAINT IF EXISTS ck_agent_run_attempts_resumed_from;

ALTER TABLE agent_run_attempts ADD CONSTRAINT ck_agent_run_attempts_resumed_from CHECK (
        (resumed_from IS NULL) = (resumed_step IS NULL)
        AND length(resumed_from) BETWEEN 1 AND 128
    ) NOT VALID;

ALTER TABLE agent_run_attempts VALIDATE CONSTRAINT ck_agent_run_attempts_resumed_from;

CREATE OR REPLACE FUNCTION agent_run_attempts_resume_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'agent_run_attempts row % (run_id %) resumed from checkpoint % already: '
                    'where an attempt resumed is written once', OLD.id, OLD.run_id,
                    OLD.resumed_from
        USING ERRCODE = 'restrict_violation';
END
$$;

CREATE OR REPLACE TRIGGER agent_run_attempts_resume_guard
    AFTER UPDATE OF resumed_from, resumed_step ON agent_run_attempts
    FOR EACH ROW
    WHEN (OLD.resumed_from IS NOT NULL
          AND (NEW.resumed_from IS DISTINCT FROM OLD.resumed_from
               OR NEW.resumed_step IS DISTINCT FROM OLD.resumed_step))
    EXECUTE FUNCTION agent_run_attempts_resume_guard();
