-- Back to 0002's BEFORE UPDATE OR DELETE guard (same refusals; one transaction).

DROP TRIGGER agent_run_attempts_update_guard ON agent_run_attempts;

DROP TRIGGER agent_run_attempts_guard ON agent_run_attempts;

CREATE TRIGGER agent_run_attempts_guard
    BEFORE UPDATE OR DELETE ON agent_run_attempts
    FOR EACH ROW EXECUTE FUNCTION agent_run_attempts_guard();
