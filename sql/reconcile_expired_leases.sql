-- reconcile_expired_leases: converge the runs reconcile_expired_leases.lock locked.
-- from: those run ids, still running | cancel_requested
-- to:   a running run its policy retries (lost leases <= max_lost_leases, attempts in budget
--       < max_attempts, deadline not passed): pending, available_at = now + delay (kept when
--       0); else failed / worker_lease_expired (no lost lease allowed: the at-least-once
--       message), lost_leases_exhausted, retries_exhausted or deadline_exceeded; lease
--       cleared; every open attempt -> lease_expired (retry_at when retried); wakes
--       agent_runs_claimable (retried) or agent_runs_finished (for a run someone waits for)
-- returns: the converged runs as they are now, by id
-- notes: sql/README.md (clock, CASE not IN, data-modifying CTEs, lock order, wake-ups, policies)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
facts AS (
    -- Per run: its policy (the slug's row, else '*', else built-in) and its attempts in budget
    -- (started at or after the latest requeue; the lost one included) and lost leases among them.
    SELECT r.id, r.status,
           coalesce(p.max_attempts, 3) AS max_attempts,
           coalesce(p.max_lost_leases, 0) AS max_lost_leases,
           -- include: policy_defaults,
           greatest(b.n, 1) AS n, b.lost + 1 AS lost, b.first_no, b.last_no,
           clock.now > r.created_at + make_interval(secs => p.deadline_seconds) AS late
    FROM agent_runs r
    CROSS JOIN clock
    -- include: run_policy
    --   run: r
    CROSS JOIN LATERAL (
        SELECT count(*) AS n,
               count(*) FILTER (WHERE a.outcome = 'lease_expired') AS lost,
               min(a.attempt_no) FILTER (WHERE a.outcome = 'lease_expired' OR a.finished_at IS NULL)
                   AS first_no,
               max(a.attempt_no) AS last_no
        FROM agent_run_attempts a
        WHERE a.run_id = r.id
          -- include: in_budget
          --   run: r.id
    ) AS b
    WHERE r.id = ANY (%(run_ids)s::text[])
),
decision AS (
    SELECT f.id,
           CASE WHEN f.status = 'cancel_requested' OR f.max_lost_leases = 0
                    THEN 'worker_lease_expired'
                WHEN f.lost > f.max_lost_leases THEN 'lost_leases_exhausted'
                WHEN f.n >= f.max_attempts THEN 'retries_exhausted'
                WHEN f.late THEN 'deadline_exceeded'
           END AS exhausted,
           CASE f.status WHEN 'running' THEN
               -- include: backoff_delay
               --   policy: f
               --   n: f.n
           END AS delay,
           f.n, f.lost, f.first_no, f.last_no, f.max_attempts, f.max_lost_leases,
           f.deadline_seconds
    FROM facts f
),
-- limits per key: the runs' limit rows, in key order, before the counter's trigger updates them
-- at the statement's end (the runs are locked already: reconcile_expired_leases.lock).
key_slots AS (
    SELECT l.concurrency_key FROM agent_run_limits l
    WHERE l.concurrency_key IN (SELECT k.concurrency_key FROM agent_runs k
                                WHERE k.id = ANY (%(run_ids)s::text[]))
    ORDER BY l.concurrency_key
    FOR UPDATE
),
converged AS (
    UPDATE agent_runs r
    SET status = CASE WHEN d.exhausted IS NULL THEN 'pending' ELSE 'failed' END,
        error_type = d.exhausted,
        error_message = CASE d.exhausted
            WHEN 'worker_lease_expired' THEN %(lost_message)s::text
            WHEN 'lost_leases_exhausted' THEN
                'lost its lease ' || d.lost || ' times (attempts ' || d.first_no || '–'
                || d.last_no || '); the policy allows ' || d.max_lost_leases || '. '
                || %(lost_message)s::text
            WHEN 'retries_exhausted' THEN
                'attempt ' || d.n || ' of ' || d.max_attempts || ' lost its lease. '
                || %(lost_message)s::text
            WHEN 'deadline_exceeded' THEN
                'attempt ' || d.n || ' lost its lease after the deadline ('
                || d.deadline_seconds || ' s after creation) passed. ' || %(lost_message)s::text
            END,
    -- include: apply_decision
    WHERE r.id = ANY (%(run_ids)s::text[]) AND r.id = d.id
      AND CASE r.status WHEN 'running' THEN true WHEN 'cancel_requested' THEN true END
    RETURNING r.*
),
attempts AS (
    UPDATE agent_run_attempts a
    SET (finished_at, updated_at, outcome) =
        (converged.updated_at, converged.updated_at, 'lease_expired'),
        error_type = coalesce(converged.error_type, 'worker_lease_expired'),
        error_message = coalesce(converged.error_message, %(lost_message)s::text),
        retry_at = CASE converged.status WHEN 'pending' THEN converged.available_at END
    FROM converged
    WHERE a.run_id = ANY (%(run_ids)s::text[]) AND a.run_id = converged.id
      AND a.finished_at IS NULL
    RETURNING a.id
),
-- include: notify_retried_or_finished
--   run: converged
SELECT converged.* FROM converged
WHERE (SELECT count(*) FROM notified) >= 0 AND (SELECT count(*) FROM attempts) >= 0
  AND (SELECT count(*) FROM key_slots) >= 0  -- limits per key
ORDER BY converged.id
