-- Back to 0003's BEFORE INSERT OR UPDATE OF input_payload, manifest guard (one transaction).

DROP TRIGGER agent_runs_json_update_guard ON agent_runs;

DROP TRIGGER agent_runs_json_guard ON agent_runs;

CREATE TRIGGER agent_runs_json_guard
    BEFORE INSERT OR UPDATE OF input_payload, manifest ON agent_runs
    FOR EACH ROW EXECUTE FUNCTION agent_runs_json_guard();
