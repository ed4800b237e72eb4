-- dashboard.finished_runs: one page of runs finished in a window, the latest finished first,
--                          by (finished_at, id), after the keyset cursor; the runs behind the
--                          overview's finished counts and error types.
-- from: terminal runs finished since window_start matching every non-NULL filter: statuses,
--       agent slug, thread, uid, the run's own (final) error_type
-- to:   nothing (read only)
-- returns: at most limit runs, the listing's columns, each with its attempt count and its last
--          attempt's owner token
-- notes: a backward range scan of ix_agent_runs_finished bounded by the window (plan-tested);
--        a rare filter reads the window's runs, as the overview's day totals do.
SELECT r.id, r.status, r.agent_slug, r.thread_id, r.uid, r.error_type, r.created_at,
       r.started_at, r.finished_at, r.worker_id,
       (SELECT count(*) FROM agent_run_attempts a WHERE a.run_id = r.id) AS attempt_count,
       (SELECT a.worker_id FROM agent_run_attempts a WHERE a.run_id = r.id
        ORDER BY a.attempt_no DESC LIMIT 1) AS last_worker_id
FROM agent_runs r
WHERE r.finished_at IS NOT NULL
  AND r.finished_at >= %(window_start)s::timestamptz
  AND (r.finished_at, r.id) < (coalesce(%(before_at)s::timestamptz, 'infinity'),
                               coalesce(%(before_id)s::text, ''))
  -- include: run_filters
  AND (%(error_type)s::text IS NULL OR r.error_type = %(error_type)s::text)
ORDER BY r.finished_at DESC, r.id DESC
LIMIT %(limit)s
