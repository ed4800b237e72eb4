-- run_filters: the optional filters on a run `r` that every list of runs offers: each one holds
-- when its parameter is NULL.
-- notes: sql/README.md (parameters)

AND (%(statuses)s::text[] IS NULL OR r.status = ANY (%(statuses)s::text[]))
AND (%(agent_slug)s::text IS NULL OR r.agent_slug = %(agent_slug)s::text)
AND (%(thread_id)s::text IS NULL OR r.thread_id = %(thread_id)s::text)
AND (%(uid)s::text IS NULL OR r.uid = %(uid)s::text)
