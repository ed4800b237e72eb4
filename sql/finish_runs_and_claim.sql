-- finish_runs_and_claim: finish_runs, then claim_next_attempts for the slots it freed, in one statement.
-- from: as finish_runs for the batch's runs; as claim_next_attempts for the claimable backlog
-- to:   as finish_runs; then up to one claim per worker_id, no more than runs finished here
-- returns: one row per run claimed (as claim_next_attempts), or one row of NULL run columns when
--          none was; every row carries the batch's finished run ids and finished_at times
-- notes: sql/README.md (clock, CASE not IN, data-modifying CTEs, lock order, wake-ups, twins)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
batch AS (
    -- Arrays behind a sub-select: the planner's estimate no longer depends on their length, so
    -- the prepared statement keeps one generic plan instead of planning every call.
    SELECT (SELECT %(run_ids)s::text[]) AS run_ids
),
decided AS (
    SELECT *
    FROM unnest((SELECT run_ids FROM batch), (SELECT %(finish_worker_ids)s::text[]),
                (SELECT %(statuses)s::text[]), (SELECT %(error_types)s::text[]),
                (SELECT %(error_messages)s::text[]), (SELECT %(outputs)s::text[]))
         AS d (run_id, worker_id, status, error_type, error_message, output)
),
locked AS (
    SELECT r.id, r.concurrency_key
    FROM agent_runs r
    -- index lookups, never a walk over live runs
    WHERE r.id = ANY ((SELECT run_ids FROM batch)::text[])
    ORDER BY r.id
    FOR UPDATE
),
finished AS (
    UPDATE agent_runs r
    SET (status, error_type, error_message, output) =
        (d.status, d.error_type, d.error_message, d.output::jsonb),
        (worker_id, heartbeat_at, lease_expires_at) = (NULL, NULL, NULL),
        finished_at = clock.now,
        updated_at = clock.now
    FROM locked, decided d, clock
    WHERE r.id = locked.id AND d.run_id = r.id
      AND r.worker_id = d.worker_id
      AND r.lease_expires_at > clock.now
      AND CASE r.status
          WHEN 'running' THEN d.status IN ('completed', 'failed', 'interrupted')
          WHEN 'cancel_requested' THEN d.status = 'cancelled'
          END
    RETURNING r.id, r.status, r.error_type, r.error_message, r.finished_at, d.worker_id
),
attempt AS (
    -- Each run's owner is the worker_id its guard matched.
    UPDATE agent_run_attempts a
    SET (finished_at, updated_at, outcome, error_type, error_message) =
        (finished.finished_at, finished.finished_at, finished.status, finished.error_type,
         finished.error_message)
    FROM finished
    WHERE a.run_id = ANY ((SELECT run_ids FROM batch)::text[]) AND a.run_id = finished.id
      AND a.finished_at IS NULL
      AND a.worker_id = finished.worker_id
    RETURNING a.id
),
notified AS (
    SELECT pg_notify('agent_runs_finished', finished.id) FROM finished
    WHERE agent_run_waiters_take(finished.id)
),
candidate AS (
    -- claim_next_attempts' claim from here on, for no more slots than runs finished above (a
    -- refused end keeps its slot until it is written alone). The finished runs were running:
    -- never candidates, so the two halves touch different rows.
    SELECT c.id, c.priority, c.available_at, c.concurrency_key
    FROM (VALUES (0), (1), (2), (3), (4), (5), (6), (7), (8), (9)) AS p (priority)
    CROSS JOIN LATERAL (
        SELECT r.id, r.priority, r.available_at, r.concurrency_key
        FROM agent_runs r
        WHERE r.priority = p.priority
          -- available by the given clock or the database's, whichever is later
          AND r.available_at <= (SELECT greatest(now, now()) FROM clock)
          AND (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
          AND CASE WHEN %(agent_slugs)s::text[] IS NULL THEN true
                   ELSE r.agent_slug = ANY (%(agent_slugs)s::text[]) END
          -- limits per key: a run of a key at its limit is passed over, keeping its place.
          AND NOT r.key_waiting
          AND (r.concurrency_key IS NULL OR NOT EXISTS (
              SELECT FROM agent_run_limits l
              WHERE l.concurrency_key = r.concurrency_key AND l.running >= l.max_running
                -- unless this statement's own ends free a slot of it
                AND l.running - (SELECT count(*) FROM locked
                                 WHERE locked.concurrency_key = l.concurrency_key)
                    >= l.max_running))
        ORDER BY r.available_at, r.id
        LIMIT least(cardinality(%(worker_ids)s::text[]), (SELECT count(*) FROM finished))
        FOR UPDATE SKIP LOCKED
    ) AS c
    LIMIT least(cardinality(%(worker_ids)s::text[]), (SELECT count(*) FROM finished))
),
-- limits per key: the candidates' limit rows, locked after the runs and in key order
-- (sql/README.md, limits); a key admits its candidates in claim order while it has slots.
keyed AS (
    SELECT c.id, c.concurrency_key,
           row_number() OVER (PARTITION BY c.concurrency_key
                               ORDER BY c.priority, c.available_at, c.id) AS rank
    FROM candidate c WHERE c.concurrency_key IS NOT NULL
),
key_slots AS (
    -- A slot that this statement's own ends free may be taken by its claims.
    SELECT l.concurrency_key,
           l.max_running - l.running
           + (SELECT count(*) FROM finished JOIN locked USING (id)
              WHERE locked.concurrency_key = l.concurrency_key) AS free
    FROM agent_run_limits l
    WHERE l.concurrency_key IN (SELECT k.concurrency_key FROM keyed k
                                UNION SELECT locked.concurrency_key FROM locked)
    ORDER BY l.concurrency_key
    FOR UPDATE
),
over_limit AS (
    SELECT keyed.id FROM keyed JOIN key_slots USING (concurrency_key)
    WHERE keyed.rank > key_slots.free
),
lease AS (
    SELECT c.id, owner.worker_id, clock.now,
           clock.now + make_interval(secs => %(lease_seconds)s::float8) AS expires_at
    FROM (SELECT id, row_number() OVER (ORDER BY priority, available_at, id) AS n
          FROM candidate) AS c
    JOIN unnest(%(worker_ids)s::text[]) WITH ORDINALITY AS owner (worker_id, n) USING (n)
    CROSS JOIN clock
    WHERE NOT EXISTS (SELECT FROM over_limit WHERE over_limit.id = c.id)  -- limits per key
),
expired AS (
    UPDATE agent_run_attempts a
    SET (finished_at, updated_at, outcome, error_type, error_message) =
        (clock.now, clock.now, 'lease_expired', 'worker_lease_expired', %(lost_message)s::text)
    FROM clock
    -- An array of the claimed ids: index lookups, never a walk over every open attempt.
    WHERE a.run_id = ANY (ARRAY(SELECT id FROM lease)) AND a.finished_at IS NULL
    RETURNING a.id
),
opened AS (
    INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at, heartbeat_at,
                                    lease_expires_at, created_at, updated_at)
    SELECT lease.id, previous.n + 1, lease.worker_id,
           greatest(lease.now, previous.ended), lease.now, lease.expires_at, lease.now, lease.now
    FROM lease,
         -- The run's own attempts only: the FILTER keeps the planner from reading max() backward
         -- off ix_agent_run_attempts_finished, a walk over every finished attempt.
         LATERAL (SELECT coalesce(max(a.attempt_no), 0) AS n,
                         max(a.finished_at) FILTER (WHERE a.finished_at IS NOT NULL) AS ended
                  FROM agent_run_attempts a WHERE a.run_id = lease.id) AS previous
    WHERE (SELECT count(*) FROM expired) >= 0
    RETURNING run_id, attempt_no
),
claimed AS (
    UPDATE agent_runs r
    SET status = CASE WHEN r.status = 'pending' THEN 'running' ELSE r.status END,
        worker_id = lease.worker_id,
        heartbeat_at = lease.now,
        lease_expires_at = lease.expires_at,
        started_at = coalesce(r.started_at, lease.now),
        updated_at = lease.now
    FROM lease, opened
    -- An array of the claimed ids: index lookups, never a walk over the runs (as a CTE, this
    -- join is otherwise planned as a hash join over every run).
    WHERE r.id = ANY (ARRAY(SELECT id FROM lease))
      AND r.id = lease.id AND opened.run_id = lease.id
    RETURNING r.*, opened.attempt_no
),
ends AS (
    SELECT coalesce(array_agg(id ORDER BY id), '{}') AS finished_ids,
           coalesce(array_agg(finished_at ORDER BY id), '{}') AS finished_ats
    FROM finished
    WHERE (SELECT count(*) FROM notified) >= 0
      AND (SELECT count(*) FROM key_slots) >= 0  -- limits per key: the batch's keys locked
)
SELECT claimed.*, ends.finished_ids, ends.finished_ats
FROM ends LEFT JOIN claimed ON true
