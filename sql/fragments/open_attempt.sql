-- open_attempt: the `opened` CTE of a claim: attempt max + 1 of each claimed run, started no
-- earlier than the attempt before it ended, after `expired` closed any open one.
-- slots: run (the claimed rows' alias), values (worker_id, started_at, heartbeat_at,
--        lease_expires_at, created_at, updated_at), from, when? (a further condition), returning
-- notes: sql/README.md (clock, data-modifying CTEs)

opened AS (
    INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at, heartbeat_at,
                                    lease_expires_at, created_at, updated_at)
    SELECT {{run}}.id, previous.n + 1, {{values}}
    FROM {{from}},
         -- The run's own attempts only: the FILTER keeps the planner from reading max() backward
         -- off ix_agent_run_attempts_finished, a walk over every finished attempt.
         LATERAL (SELECT coalesce(max(a.attempt_no), 0) AS n,
                         max(a.finished_at) FILTER (WHERE a.finished_at IS NOT NULL) AS ended
                  FROM agent_run_attempts a WHERE a.run_id = {{run}}.id) AS previous
    WHERE {{when?}} (SELECT count(*) FROM expired) >= 0
    RETURNING {{returning}}
)
