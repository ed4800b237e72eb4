-- apply_decision: the rest of the run's UPDATE once `decision` (d: exhausted, delay) ruled: no
-- lease; finished now when exhausted, else available after the delay (its place kept at 0).
-- notes: sql/README.md (clock, policies)

    (worker_id, heartbeat_at, lease_expires_at) = (NULL, NULL, NULL),
    finished_at = CASE WHEN d.exhausted IS NULL THEN NULL ELSE clock.now END,
    available_at = CASE WHEN d.exhausted IS NULL AND d.delay > 0
                        THEN clock.now + make_interval(secs => d.delay)
                        ELSE r.available_at END,
    updated_at = clock.now
FROM decision d, clock
