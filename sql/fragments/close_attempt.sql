-- close_attempt: the `attempt` CTE of an end: the owner's open attempt of each `finished` run
-- takes the run's outcome, errors and finished_at.
-- slots: where (which attempts: the run's own, open, of the owner the guard matched)
-- notes: sql/README.md (data-modifying CTEs)

attempt AS (
    UPDATE agent_run_attempts a
    SET (finished_at, updated_at, outcome, error_type, error_message) =
        (finished.finished_at, finished.finished_at, finished.status, finished.error_type,
         finished.error_message)
    FROM finished
    WHERE {{where}}
    RETURNING a.id
)
