-- in_budget: the condition on an attempt `a` of being in budget: started at or after the run's
-- latest requeue (every attempt when it was never requeued).
-- slots: run (the run's id)
-- notes: sql/README.md (policies)

AND a.started_at >= coalesce(
    (SELECT max(q.requeued_at) FROM agent_run_requeues q WHERE q.run_id = {{run}}),
    '-infinity')
