-- list_runs: one page of runs, newest first by (created_at, id), after the keyset cursor.
-- from: any run matching every non-NULL filter: statuses, agent slug, thread, uid, key, worker
--       identity (an attempt's owner token without its last ':' part), created since, stuck
--       (an expired live lease not reconciled yet, or pending and available for longer than
--       stuck_after_seconds)
-- to:   nothing (read only)
-- returns: at most limit runs, each with its attempt count and its last attempt's owner token;
--          with documents false, input_payload, error_message, manifest and trace_context are
--          NULL (a listing: the values are never read from TOAST nor sent); output always
-- notes: sql/README.md (clock); three parts with the same filters, merged: settled runs
--        (pending or finished) through the listing indexes, which leave live runs out; with
--        stuck, pending runs instead, the only settled ones that can be stuck; and live runs
--        (few, one per lease) through ix_agent_runs_live (NOT MATERIALIZED: each part reads its
--        own index). The worker filter is a per-run probe of the run's few attempts by run_id
--        (OFFSET 0 keeps it a probe, not a join reading every attempt), made while each half
--        walks newest first, so it stops once the page is full: settled runs come in index
--        order; live runs, which ix_agent_runs_live holds in no useful order, are sorted first
--        (the OFFSET 0 subquery) and probed after, not all probed before the sort.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
matching AS NOT MATERIALIZED (
    SELECT r.*
    FROM agent_runs r
    WHERE (r.created_at, r.id) < (coalesce(%(before_created_at)s::timestamptz, 'infinity'),
                                  coalesce(%(before_id)s::text, ''))
      -- include: run_filters
      AND (%(concurrency_key)s::text IS NULL OR r.concurrency_key = %(concurrency_key)s::text)
      AND r.created_at >= coalesce(
              %(since_at)s::timestamptz,
              (SELECT now FROM clock) - make_interval(secs => %(since_seconds)s::float8),
              '-infinity')
      AND (NOT %(stuck)s::boolean
           OR (r.status IN ('running', 'cancel_requested') AND r.worker_id IS NOT NULL
               AND r.lease_expires_at <= (SELECT now FROM clock))
           OR (r.status = 'cancel_requested' AND r.worker_id IS NULL
               AND r.started_at IS NOT NULL)
           -- available (created, scheduled or backed off until then) longer than stuck_after
           OR (r.status = 'pending'
               AND r.available_at <= (SELECT now FROM clock)
                   - make_interval(secs => %(stuck_after_seconds)s::float8)))
),
page AS (
    (SELECT * FROM matching m
     WHERE m.status NOT IN ('running', 'cancel_requested')
       AND (%(worker)s::text IS NULL OR EXISTS (
               SELECT FROM agent_run_attempts a
               WHERE a.run_id = m.id
                 AND regexp_replace(a.worker_id, ':[^:]*$', '') = %(worker)s::text
               OFFSET 0))
       -- Each half is skipped whole (a one-time filter) when no status asked for can be in it:
       -- else its index walk, filtered by a status it never holds, reads every row.
       AND CASE WHEN %(statuses)s::text[] IS NULL THEN true
                ELSE NOT %(statuses)s::text[] <@ ARRAY['running', 'cancel_requested'] END
       -- the only settled runs that can be stuck are pending: the next half reads them
       AND NOT %(stuck)s::boolean
     ORDER BY m.created_at DESC, m.id DESC
     LIMIT %(limit)s)
    UNION ALL
    -- stuck: the pending runs, found through an index of live runs (OFFSET 0), each then
    -- matched by its id, and sorted: not a walk of the listing index past every finished run
    (SELECT m.*
     FROM (SELECT r.id FROM agent_runs r WHERE r.status = 'pending' OFFSET 0) pending
     CROSS JOIN LATERAL (SELECT * FROM matching m WHERE m.id = pending.id OFFSET 0) m
     -- one-time filters: without stuck none of it is read
     WHERE %(stuck)s::boolean
       AND CASE WHEN %(statuses)s::text[] IS NULL THEN true
                ELSE 'pending' = ANY (%(statuses)s::text[]) END
       AND (%(worker)s::text IS NULL OR EXISTS (
               SELECT FROM agent_run_attempts a
               WHERE a.run_id = m.id
                 AND regexp_replace(a.worker_id, ':[^:]*$', '') = %(worker)s::text
               OFFSET 0))
     ORDER BY m.created_at DESC, m.id DESC
     LIMIT %(limit)s)
    UNION ALL
    (SELECT * FROM (
         SELECT * FROM matching m
         WHERE m.status IN ('running', 'cancel_requested')
           AND CASE WHEN %(statuses)s::text[] IS NULL THEN true
                    ELSE %(statuses)s::text[] && ARRAY['running', 'cancel_requested'] END
         ORDER BY m.created_at DESC, m.id DESC
         OFFSET 0) live
     WHERE %(worker)s::text IS NULL OR EXISTS (
               SELECT FROM agent_run_attempts a
               WHERE a.run_id = live.id
                 AND regexp_replace(a.worker_id, ':[^:]*$', '') = %(worker)s::text
               OFFSET 0)
     ORDER BY live.created_at DESC, live.id DESC
     LIMIT %(limit)s)
    ORDER BY created_at DESC, id DESC
    LIMIT %(limit)s
)
SELECT page.id, page.request_id, page.thread_id, page.agent_slug, page.uid, page.run_type,
       page.created_by_run_id, page.status,
       CASE WHEN %(documents)s::boolean THEN page.input_payload END AS input_payload,
       page.error_type,
       CASE WHEN %(documents)s::boolean THEN page.error_message END AS error_message,
       page.worker_id, page.heartbeat_at, page.lease_expires_at,
       CASE WHEN %(documents)s::boolean THEN page.manifest END AS manifest,
       page.manifest_fingerprint, page.manifest_recorded_at, page.started_at, page.finished_at,
       page.created_at, page.updated_at,
       CASE WHEN %(documents)s::boolean THEN page.trace_context END AS trace_context,
       page.priority, page.available_at,
       -- a listing never reads a run's result
       NULL::jsonb AS output,
       page.concurrency_key,
       (SELECT count(*) FROM agent_run_attempts a WHERE a.run_id = page.id) AS attempt_count,
       (SELECT a.worker_id FROM agent_run_attempts a WHERE a.run_id = page.id
        ORDER BY a.attempt_no DESC LIMIT 1) AS last_worker_id
FROM page
ORDER BY page.created_at DESC, page.id DESC
