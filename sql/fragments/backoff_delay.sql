-- backoff_delay: seconds until the retry of the n-th attempt in budget: backoff_seconds doubled
-- per attempt after the first, capped at backoff_max_seconds, less up to backoff_jitter of it.
-- slots: policy (the alias of the policy's columns), n (the attempts in budget)
-- notes: sql/README.md (policies)

least({{policy}}.backoff_max_seconds,
      {{policy}}.backoff_seconds * power(2::float8, least({{n}} - 1, 60)))
* (1 - {{policy}}.backoff_jitter * random())
