-- Drop agent_runs.trace_context and its guard (the stored trace contexts go with it).

DROP TRIGGER agent_runs_trace_context_update_guard ON agent_runs;

DROP TRIGGER agent_runs_trace_context_insert_guard ON agent_runs;

DROP FUNCTION agent_runs_trace_context_guard();

ALTER TABLE agent_runs DROP COLUMN trace_context;
