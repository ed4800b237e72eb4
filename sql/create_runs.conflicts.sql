-- create_runs.conflicts: after a refused batch, what it ran into (to name the item).
-- from: any run
-- to:   nothing (read only)
-- returns: kind 'request' (a request_id of the batch that exists), 'thread' (an active run on
--          a thread of the batch), 'run_id' (a run_id of the batch that exists), with its key
SELECT 'request' AS kind, r.request_id AS a, NULL::text AS b, NULL::text AS c
FROM agent_runs r
WHERE r.request_id = ANY (%(request_ids)s::text[])
UNION ALL
SELECT 'thread', r.uid, r.agent_slug, r.thread_id
FROM agent_runs r
JOIN unnest(%(uids)s::text[], %(agent_slugs)s::text[], %(thread_ids)s::text[])
     AS k (uid, agent_slug, thread_id)
  ON r.uid = k.uid AND r.agent_slug = k.agent_slug AND r.thread_id = k.thread_id
WHERE r.status IN ('pending', 'running', 'cancel_requested')
UNION ALL
SELECT 'run_id', r.id, NULL, NULL
FROM agent_runs r
WHERE r.id = ANY (%(run_ids)s::text[]) OR r.id = ANY (%(created_by_run_ids)s::text[])
