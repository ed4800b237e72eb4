-- dashboard.run_times: when each run of a listed page started and finished.
-- from: the runs whose ids are given (a page of the runs table, by primary key)
-- to:   nothing (read only)
-- returns: (id, started_at, finished_at), one row per run that exists, in no order
SELECT r.id, r.started_at, r.finished_at
FROM agent_runs r
WHERE r.id = ANY (%(ids)s::text[])
