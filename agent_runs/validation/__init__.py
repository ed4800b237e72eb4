"""Input checks that run before any SQL: a bad argument is refused by name, nothing is written.

One small function per argument kind, in a module per kind of value (limits, text, numbers,
times, documents, batches, settings, schedule, filters); callers use
`from agent_runs import validation as check`.

Limits (the schema enforces the same time window, see migrations/0003_timestamp_bounds.sql):

- Identifiers (run_id, request_id, thread_id, uid, agent_slug, created_by_run_id): a str of
  1-64 characters; worker_id 1-128. No NUL, no lone surrogates (text must encode as UTF-8).
- Time window: every timestamp the module writes lies in [2000-01-01, 9000-01-01) UTC. A given
  `now` must be timezone-aware (any offset Python accepts; it is converted to UTC here), and
  `now` as well as `now + lease_seconds` must lie inside the window.
- lease_seconds: a finite number, 0 < x <= 86400 (huge ints are refused, never overflow).
- JSON (input_payload, manifest): an object of strict JSON: str keys, finite floats, ints of
  fewer than 4,000 digits, no NUL and no lone surrogate in any key or string, at most 64
  nested containers (checked iteratively: no recursion, whatever the depth of the input).
- output (a run's result): any strict JSON value under the same rules, at most 1 MiB of JSON
  text (UTF-8); None means no output.
- error_message is never refused but made storable (see `error_message`); error_type is
  refused when invalid from a direct caller, and kept inside the message by `agent_error`.
- Worker settings: name 1-95 characters (owner tokens are `name:` + 32 hex digits, <= 128),
  heartbeat_seconds below lease_seconds, max_tries 1-1,000,000, poll_seconds 0 < x <= 3600.
- Scheduling: priority 0-9; available_at an aware datetime in the window; retry_after_seconds
  and back-off 0 <= x <= a year; backoff_jitter 0-1; max_attempts >= 1; max_lost_leases >= 0;
  deadline_seconds None or 0 < x <= ten years; a requeue's reason 1-1000 characters.
- timeout_seconds (wait_for_run): a finite number, 0 <= x <= 366 days. Every number is checked
  without converting it first: a huge int is refused by name, never an OverflowError.
"""

from __future__ import annotations

from agent_runs.validation.batches import (
    agent_slugs,
    finishes,
    leases,
    worker_ids,
)
from agent_runs.validation.documents import (
    canonical_json,
    json_document,
    json_object,
    json_value,
    output_text,
)
from agent_runs.validation.filters import (
    flag,
    since,
    span,
    statuses,
)
from agent_runs.validation.limits import (
    INVALID_ERROR_TYPE,
    MAX_BAD_ERROR_TYPE_SHOWN,
    MAX_BATCH,
    MAX_CONCURRENCY,
    MAX_DSN_LENGTH,
    MAX_ERROR_MESSAGE_LENGTH,
    MAX_ERROR_TYPE_LENGTH,
    MAX_ID_LENGTH,
    MAX_JSON_DEPTH,
    MAX_JSON_INT,
    MAX_LEASE_SECONDS,
    MAX_LIMIT,
    MAX_OUTPUT_BYTES,
    MAX_POLL_SECONDS,
    MAX_TIMEOUT_SECONDS,
    MAX_TRIES,
    MAX_WORKER_ID_LENGTH,
    MAX_WORKER_NAME_LENGTH,
    RUN_TYPES,
    TIME_MAX,
    TIME_MIN,
)
from agent_runs.validation.numbers import (
    every_seconds,
    integer,
    lease_seconds,
    limit,
    max_running,
    timeout_seconds,
)
from agent_runs.validation.schedule import (
    DEFAULT_POLICY_SLUG,
    MAX_DELAY_SECONDS,
    available_at,
    backoff_jitter,
    backoff_seconds,
    deadline_seconds,
    max_attempts,
    max_lost_leases,
    policy_slug,
    priority,
    reason,
    retry_after_seconds,
)
from agent_runs.validation.settings import (
    COMPLETIONS,
    completion,
    dashboard_token,
    heartbeat_seconds,
    max_tries,
    optional_dsn,
    poll_seconds,
    worker_name,
)
from agent_runs.validation.text import (
    agent_error,
    checkpoint_id,
    concurrency_key,
    error_message,
    error_type,
    fingerprint,
    identifier,
    optional_concurrency_key,
    optional_identifier,
    optional_worker_id,
    run_type,
    terminal_status,
    worker_id,
)
from agent_runs.validation.times import (
    instant,
    lease,
    now,
)

__all__ = [
    "COMPLETIONS",
    "DEFAULT_POLICY_SLUG",
    "INVALID_ERROR_TYPE",
    "MAX_BAD_ERROR_TYPE_SHOWN",
    "MAX_BATCH",
    "MAX_CONCURRENCY",
    "MAX_DELAY_SECONDS",
    "MAX_DSN_LENGTH",
    "MAX_ERROR_MESSAGE_LENGTH",
    "MAX_ERROR_TYPE_LENGTH",
    "MAX_ID_LENGTH",
    "MAX_JSON_DEPTH",
    "MAX_JSON_INT",
    "MAX_LEASE_SECONDS",
    "MAX_LIMIT",
    "MAX_OUTPUT_BYTES",
    "MAX_POLL_SECONDS",
    "MAX_TIMEOUT_SECONDS",
    "MAX_TRIES",
    "MAX_WORKER_ID_LENGTH",
    "MAX_WORKER_NAME_LENGTH",
    "RUN_TYPES",
    "TIME_MAX",
    "TIME_MIN",
    "agent_error",
    "agent_slugs",
    "available_at",
    "backoff_jitter",
    "backoff_seconds",
    "canonical_json",
    "checkpoint_id",
    "completion",
    "concurrency_key",
    "dashboard_token",
    "deadline_seconds",
    "error_message",
    "error_type",
    "every_seconds",
    "fingerprint",
    "finishes",
    "flag",
    "heartbeat_seconds",
    "identifier",
    "instant",
    "integer",
    "json_document",
    "json_object",
    "json_value",
    "lease",
    "lease_seconds",
    "leases",
    "limit",
    "max_attempts",
    "max_lost_leases",
    "max_running",
    "max_tries",
    "now",
    "optional_concurrency_key",
    "optional_dsn",
    "optional_identifier",
    "optional_worker_id",
    "output_text",
    "policy_slug",
    "poll_seconds",
    "priority",
    "reason",
    "retry_after_seconds",
    "run_type",
    "since",
    "span",
    "statuses",
    "terminal_status",
    "timeout_seconds",
    "worker_id",
    "worker_ids",
    "worker_name",
]
