-- create_run: a new run starts `pending`, with no lease and no attempt.
-- Idempotent on request_id: a repeated request inserts nothing (the caller then reads the
-- existing run in a new statement, whose snapshot sees a concurrent creator's commit).
INSERT INTO agent_runs (
    id, request_id, thread_id, agent_slug, uid, run_type, created_by_run_id, input_payload
)
VALUES (
    %(run_id)s, %(request_id)s, %(thread_id)s, %(agent_slug)s, %(uid)s, %(run_type)s,
    %(created_by_run_id)s, %(input_payload)s
)
ON CONFLICT (request_id) DO NOTHING
RETURNING *
