-- create_run, idempotent path: the run an earlier request with this request_id created.
SELECT * FROM agent_runs WHERE request_id = %(request_id)s
