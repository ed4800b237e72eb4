-- expire_attempts: the `expired` CTE of a claim: the open attempt a lost lease left behind ends
-- lease_expired, before the claim opens the next (one open attempt per run).
-- slots: at (the time), from (what it reads), where (which attempts)
-- notes: sql/README.md (data-modifying CTEs)

expired AS (
    UPDATE agent_run_attempts a
    SET (finished_at, updated_at, outcome, error_type, error_message) =
        ({{at}}, {{at}}, 'lease_expired', 'worker_lease_expired', %(lost_message)s::text)
    FROM {{from}}
    WHERE {{where}}
    RETURNING a.id
)
