-- agent_runs.trace_context: the W3C trace context of the span that created the run.
--
-- {"traceparent": "00-<trace id>-<span id>-<flags>", "tracestate": "..."} (tracestate only
-- when the creating span has one), written by create_run's own INSERT when telemetry is on
-- (agent_runs.telemetry), NULL otherwise. Write-once: set by the INSERT, never changed after.
--
-- Guarded by triggers whose WHEN clause is false on the hot paths, so they cost nothing there:
-- an INSERT without a context, and every UPDATE that does not name the column (claims,
-- renewals, finishes). Not a CHECK: a CHECK runs on every heartbeat. No index: nothing
-- searches by it, and renewals stay HOT.
--
-- On a populated table: ADD COLUMN without a default is a catalog change (no rewrite, no scan)
-- under a brief ACCESS EXCLUSIVE lock; the triggers take SHARE ROW EXCLUSIVE for the same
-- transaction. Old rows read NULL.
-- depends: 0009_lineage_is_a_tree

ALTER TABLE agent_runs ADD COLUMN trace_context jsonb NULL;

CREATE FUNCTION agent_runs_trace_context_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' THEN
        RAISE EXCEPTION 'run id=%: trace_context is written once, by create_run', NEW.id
            USING ERRCODE = 'restrict_violation';
    END IF;
    -- A JSON object of at most the two W3C fields, traceparent a string of the W3C shape.
    IF jsonb_typeof(NEW.trace_context) <> 'object'
       OR NOT (NEW.trace_context ?& ARRAY['traceparent'])
       OR EXISTS (SELECT FROM jsonb_object_keys(NEW.trace_context) AS k
                  WHERE k NOT IN ('traceparent', 'tracestate'))
       OR coalesce(NEW.trace_context ->> 'traceparent', '')
          !~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
       OR jsonb_typeof(coalesce(NEW.trace_context -> 'tracestate', '""')) <> 'string'
       OR length(coalesce(NEW.trace_context ->> 'tracestate', '')) > 512 THEN
        RAISE EXCEPTION 'run id=%: trace_context must be {"traceparent", "tracestate"} (W3C)',
                        NEW.id
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER agent_runs_trace_context_insert_guard
    BEFORE INSERT ON agent_runs
    FOR EACH ROW
    WHEN (NEW.trace_context IS NOT NULL)
    EXECUTE FUNCTION agent_runs_trace_context_guard();

CREATE TRIGGER agent_runs_trace_context_update_guard
    AFTER UPDATE OF trace_context ON agent_runs
    FOR EACH ROW
    WHEN (NEW.trace_context IS DISTINCT FROM OLD.trace_context)
    EXECUTE FUNCTION agent_runs_trace_context_guard();
