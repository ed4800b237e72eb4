-- dashboard.runs_by_attempt: one page of the runs that have an attempt finished in a window
--                            matching the filters, the latest such attempt first, by (its
--                            finished_at, run id), after the keyset cursor; the runs behind the
--                            workers page's counts.
-- from: attempts finished since window_start with any of the given outcomes, worker identity (owner
--       token without its last ':' part) and attempt error_type, when not NULL
-- to:   nothing (read only)
-- returns: at most limit runs, the listing's columns, each with its attempt count, its last
--          attempt's owner token and matched_at (its latest matching attempt's finished_at)
-- notes: a backward walk of ix_agent_run_attempts_finished from the cursor, bounded by the
--        window, that stops once the page is full (plan-tested): each run counts at its latest
--        matching attempt only (a probe of the run's few attempts by primary key), so a run
--        is on one page only.
WITH matched AS (
    SELECT a.run_id, a.finished_at AS matched_at
    FROM agent_run_attempts a
    WHERE a.finished_at IS NOT NULL
      AND a.finished_at >= %(window_start)s::timestamptz
      AND (a.finished_at, a.run_id) < (coalesce(%(before_at)s::timestamptz, 'infinity'),
                                       coalesce(%(before_id)s::text, ''))
      AND (%(outcomes)s::text[] IS NULL OR a.outcome = ANY(%(outcomes)s::text[]))
      AND (%(error_type)s::text IS NULL OR a.error_type = %(error_type)s::text)
      AND (%(worker)s::text IS NULL
           OR regexp_replace(a.worker_id, ':[^:]*$', '') = %(worker)s::text)
      AND NOT EXISTS (
          SELECT FROM agent_run_attempts b
          WHERE b.run_id = a.run_id
            AND (b.finished_at, b.attempt_no) > (a.finished_at, a.attempt_no)
            AND (%(outcomes)s::text[] IS NULL OR b.outcome = ANY(%(outcomes)s::text[]))
            AND (%(error_type)s::text IS NULL OR b.error_type = %(error_type)s::text)
            AND (%(worker)s::text IS NULL
                 OR regexp_replace(b.worker_id, ':[^:]*$', '') = %(worker)s::text))
    ORDER BY a.finished_at DESC, a.run_id DESC
    LIMIT %(limit)s
)
SELECT r.id, r.status, r.agent_slug, r.thread_id, r.uid, r.error_type, r.created_at,
       r.started_at, r.finished_at, r.worker_id, m.matched_at,
       (SELECT count(*) FROM agent_run_attempts a WHERE a.run_id = r.id) AS attempt_count,
       (SELECT a.worker_id FROM agent_run_attempts a WHERE a.run_id = r.id
        ORDER BY a.attempt_no DESC LIMIT 1) AS last_worker_id
FROM matched m
JOIN agent_runs r ON r.id = m.run_id
ORDER BY m.matched_at DESC, r.id DESC
