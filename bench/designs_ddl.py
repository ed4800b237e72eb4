"""The DDL of the schema designs that bench.designs compares, one schema each.

`lean` (bench.lean_floor's bench_lean) and `current` (the migrations 0001-0012 in public) are
not here: they are installed as they are. Every other design is written out below, in its own
schema; each script sets search_path to that schema, so the names inside are the project's.
The guard functions of the migrations (public.agent_runs_json_guard, ..._trace_context_guard,
..._lineage_guard, agent_run_attempts_guard) are reused: they read NEW/OLD, and the tables they
query resolve through the session's search_path to the design's own.
All tables keep fillfactor 80, as today.
"""

from __future__ import annotations

from typing import Final

from bench import lean_floor

_TERMINAL: Final = "('completed', 'failed', 'cancelled', 'interrupted')"
_ACTIVE: Final = "('pending', 'running', 'cancel_requested')"
_WINDOW: Final = "'[2000-01-01 00:00Z,9000-01-01 00:00Z)'::tstzrange"

# The row-shape rules of 0001 and 0009 with the compact time window of 0012.
_STATE_CHECKS: Final = f"""\
    CONSTRAINT ck_agent_runs_status CHECK (
        status IN ('pending', 'running', 'cancel_requested',
                   'completed', 'failed', 'cancelled', 'interrupted')),
    CONSTRAINT ck_agent_runs_lease_all_or_none CHECK (
        (worker_id IS NULL AND heartbeat_at IS NULL AND lease_expires_at IS NULL)
        OR (worker_id IS NOT NULL AND heartbeat_at IS NOT NULL AND lease_expires_at IS NOT NULL)),
    CONSTRAINT ck_agent_runs_terminal_is_finished CHECK (
        status NOT IN {_TERMINAL} OR (finished_at IS NOT NULL AND worker_id IS NULL)),
    CONSTRAINT ck_agent_runs_running_has_lease CHECK (status <> 'running' OR worker_id IS NOT NULL),
    CONSTRAINT ck_agent_runs_manifest_all_or_none CHECK (
        (manifest IS NULL) = (manifest_fingerprint IS NULL)
        AND (manifest IS NULL) = (manifest_recorded_at IS NULL))"""

_ONE_ROW_RUNS: Final = f"""\
CREATE TABLE agent_runs (
    id                   text        PRIMARY KEY,
    request_id           text        NOT NULL,
    thread_id            text        NOT NULL,
    agent_slug           text        NOT NULL,
    uid                  text        NOT NULL,
    run_type             text        NOT NULL DEFAULT 'chat',
    created_by_run_id    text        NULL REFERENCES agent_runs (id) ON DELETE SET NULL,
    status               text        NOT NULL DEFAULT 'pending',
    input_payload        jsonb       NOT NULL DEFAULT '{{}}'::jsonb,
    error_type           text,
    error_message        text,
    worker_id            text,
    heartbeat_at         timestamptz,
    lease_expires_at     timestamptz,
    manifest             jsonb,
    manifest_fingerprint text,
    manifest_recorded_at timestamptz,
    started_at           timestamptz,
    finished_at          timestamptz,
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now(),
    trace_context        jsonb,
    CONSTRAINT uq_agent_runs_request_id UNIQUE (request_id),
    CONSTRAINT ck_agent_runs_run_type CHECK (run_type IN ('chat', 'resume', 'subagent')),
    CONSTRAINT ck_agent_runs_not_own_parent CHECK (created_by_run_id <> id),
{_STATE_CHECKS},
    CONSTRAINT ck_agent_runs_timestamps_in_range CHECK ({_WINDOW} @> ALL (ARRAY[
        created_at, updated_at, heartbeat_at, lease_expires_at, manifest_recorded_at,
        started_at, finished_at]))
) WITH (fillfactor = 80);
CREATE INDEX ix_agent_runs_created_by_run_id ON agent_runs (created_by_run_id)
    WHERE created_by_run_id IS NOT NULL;
CREATE TRIGGER agent_runs_json_guard BEFORE INSERT ON agent_runs
    FOR EACH ROW EXECUTE FUNCTION public.agent_runs_json_guard();
CREATE TRIGGER agent_runs_json_update_guard AFTER UPDATE OF input_payload, manifest ON agent_runs
    FOR EACH ROW WHEN (NEW.input_payload IS DISTINCT FROM OLD.input_payload
                       OR NEW.manifest IS DISTINCT FROM OLD.manifest)
    EXECUTE FUNCTION public.agent_runs_json_guard();
"""

# Guards every design keeps on agent_runs (wherever trace_context and the parent link live).
_IMMUTABLE_GUARDS: Final = """\
CREATE TRIGGER agent_runs_lineage_guard AFTER UPDATE OF created_by_run_id ON agent_runs
    FOR EACH ROW WHEN (NEW.created_by_run_id IS NOT NULL
                       AND NEW.created_by_run_id IS DISTINCT FROM OLD.created_by_run_id)
    EXECUTE FUNCTION public.agent_runs_lineage_guard();
CREATE TRIGGER agent_runs_trace_context_insert_guard BEFORE INSERT ON agent_runs
    FOR EACH ROW WHEN (NEW.trace_context IS NOT NULL)
    EXECUTE FUNCTION public.agent_runs_trace_context_guard();
CREATE TRIGGER agent_runs_trace_context_update_guard AFTER UPDATE OF trace_context ON agent_runs
    FOR EACH ROW WHEN (NEW.trace_context IS DISTINCT FROM OLD.trace_context)
    EXECUTE FUNCTION public.agent_runs_trace_context_guard();
"""

_ATTEMPT_COLUMNS: Final = f"""\
    run_id           text        NOT NULL REFERENCES agent_runs (id) ON DELETE CASCADE,
    attempt_no       integer     NOT NULL,
    worker_id        text        NOT NULL,
    started_at       timestamptz NOT NULL,
    heartbeat_at     timestamptz,
    lease_expires_at timestamptz,
    finished_at      timestamptz,
    outcome          text,
    error_type       text,
    error_message    text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT ck_agent_run_attempts_attempt_no_positive CHECK (attempt_no > 0),
    CONSTRAINT ck_agent_run_attempts_outcome CHECK (
        outcome IN ('completed', 'failed', 'cancelled', 'interrupted',
                    'retry_released', 'lease_expired')),
    CONSTRAINT ck_agent_run_attempts_finished_has_outcome CHECK (
        (outcome IS NULL) = (finished_at IS NULL)),
    CONSTRAINT ck_agent_run_attempts_timestamps_in_range CHECK ({_WINDOW} @> ALL (ARRAY[
        started_at, created_at, updated_at, heartbeat_at, lease_expires_at, finished_at]))"""

_ONE_OPEN: Final = """\
CREATE UNIQUE INDEX uq_agent_run_attempts_one_open_per_run ON agent_run_attempts (run_id)
    WHERE finished_at IS NULL;
CREATE TRIGGER agent_run_attempts_guard BEFORE DELETE ON agent_run_attempts
    FOR EACH ROW EXECUTE FUNCTION {guard}();
"""

# Attempts as today (0002, 0005, 0012): identity id, unique (run_id, attempt_no), one open.
_ATTEMPTS_TODAY: Final = f"""\
CREATE TABLE agent_run_attempts (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
{_ATTEMPT_COLUMNS},
    CONSTRAINT uq_agent_run_attempts_run_attempt_no UNIQUE (run_id, attempt_no)
) WITH (fillfactor = 80);
{_ONE_OPEN.format(guard="public.agent_run_attempts_guard")}\
CREATE TRIGGER agent_run_attempts_update_guard AFTER UPDATE ON agent_run_attempts
    FOR EACH ROW WHEN (OLD.finished_at IS NOT NULL
          OR NEW.id IS DISTINCT FROM OLD.id
          OR NEW.run_id IS DISTINCT FROM OLD.run_id
          OR NEW.attempt_no IS DISTINCT FROM OLD.attempt_no
          OR NEW.worker_id IS DISTINCT FROM OLD.worker_id
          OR NEW.started_at IS DISTINCT FROM OLD.started_at
          OR NEW.created_at IS DISTINCT FROM OLD.created_at
          OR (NEW.finished_at IS NULL
              AND (NEW.outcome IS DISTINCT FROM OLD.outcome
                   OR NEW.error_type IS DISTINCT FROM OLD.error_type
                   OR NEW.error_message IS DISTINCT FROM OLD.error_message)))
    EXECUTE FUNCTION public.agent_run_attempts_guard();
"""

_ATTEMPTS_FINISHED_INDEX: Final = """\
CREATE INDEX ix_agent_run_attempts_finished ON agent_run_attempts (finished_at)
    WHERE finished_at IS NOT NULL;
"""

# Attempts keyed as they are read: PRIMARY KEY (run_id, attempt_no), no identity id, no
# finished index; the same guard, by a copy of 0002's function that names the attempt by key.
_ATTEMPTS_KEYED: Final = f"""\
CREATE TABLE agent_run_attempts (
{_ATTEMPT_COLUMNS},
    PRIMARY KEY (run_id, attempt_no)
) WITH (fillfactor = 80);
CREATE FUNCTION agent_run_attempts_keyed_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF EXISTS (SELECT 1 FROM agent_runs WHERE id = OLD.run_id) THEN
            RAISE EXCEPTION 'attempt % of run_id=% cannot be deleted while its run exists',
                OLD.attempt_no, OLD.run_id USING ERRCODE = 'restrict_violation';
        END IF;
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'attempt % of run_id=%: finished attempts are immutable; an open one may '
        'only renew its lease or be finished', OLD.attempt_no, OLD.run_id
        USING ERRCODE = 'restrict_violation';
END
$$;
{_ONE_OPEN.format(guard="agent_run_attempts_keyed_guard")}\
CREATE TRIGGER agent_run_attempts_update_guard AFTER UPDATE ON agent_run_attempts
    FOR EACH ROW WHEN (OLD.finished_at IS NOT NULL
          OR NEW.run_id IS DISTINCT FROM OLD.run_id
          OR NEW.attempt_no IS DISTINCT FROM OLD.attempt_no
          OR NEW.worker_id IS DISTINCT FROM OLD.worker_id
          OR NEW.started_at IS DISTINCT FROM OLD.started_at
          OR NEW.created_at IS DISTINCT FROM OLD.created_at
          OR (NEW.finished_at IS NULL
              AND (NEW.outcome IS DISTINCT FROM OLD.outcome
                   OR NEW.error_type IS DISTINCT FROM OLD.error_type
                   OR NEW.error_message IS DISTINCT FROM OLD.error_message)))
    EXECUTE FUNCTION agent_run_attempts_keyed_guard();
"""  # noqa: S608

# diet: today's single table with every index not strictly needed dropped. Trades: statistics
# and prune read finished runs by created_at (no finished_at index on runs or attempts);
# pending runs are listed through ix_agent_runs_claimable (the settled indexes hold terminal
# runs only, so a create writes none of them).
DIET: Final = f"""\
CREATE SCHEMA design_diet;
SET search_path = design_diet, public;
{_ONE_ROW_RUNS}{_IMMUTABLE_GUARDS}
CREATE UNIQUE INDEX uq_agent_runs_one_active_per_thread ON agent_runs (uid, agent_slug, thread_id)
    WHERE status IN {_ACTIVE};
CREATE INDEX ix_agent_runs_claimable ON agent_runs (created_at, id)
    WHERE status = 'pending' OR (status = 'cancel_requested' AND worker_id IS NULL);
CREATE INDEX ix_agent_runs_live ON agent_runs (id) WHERE status IN ('running', 'cancel_requested');
CREATE INDEX ix_agent_runs_status_created ON agent_runs (status, created_at, id)
    WHERE status IN {_TERMINAL};
CREATE INDEX ix_agent_runs_terminal_created ON agent_runs (created_at, id)
    WHERE status IN {_TERMINAL};
CREATE INDEX ix_agent_runs_terminal_agent_created ON agent_runs (agent_slug, created_at, id)
    WHERE status IN {_TERMINAL};
CREATE INDEX ix_agent_runs_terminal_uid_created ON agent_runs (uid, created_at, id)
    WHERE status IN {_TERMINAL};
CREATE INDEX ix_agent_runs_terminal_thread_created ON agent_runs (thread_id, created_at, id)
    WHERE status IN {_TERMINAL};
{_ATTEMPTS_TODAY}"""

# split: agent_runs written once at create (identity, request, listing columns, parent, input)
# with its unique and listing indexes (no status predicate); agent_run_state carries what
# changes, with copies of uid/agent_slug/thread_id/created_at for the one-active and claimable
# indexes. Trades: a run reads as a join of two rows; the copies must never diverge (written by
# the same create); listings filtered by status join the state. Renewals change only the last
# three columns of the state row (PostgreSQL logs only the changed middle of a tuple).
_SPLIT_RUNS: Final = f"""\
CREATE TABLE agent_runs (
    id                text        PRIMARY KEY,
    request_id        text        NOT NULL,
    thread_id         text        NOT NULL,
    agent_slug        text        NOT NULL,
    uid               text        NOT NULL,
    run_type          text        NOT NULL DEFAULT 'chat',
    created_by_run_id text        NULL REFERENCES agent_runs (id) ON DELETE SET NULL,
    input_payload     jsonb       NOT NULL DEFAULT '{{}}'::jsonb,
    created_at        timestamptz NOT NULL DEFAULT now(),
    trace_context     jsonb,
    CONSTRAINT uq_agent_runs_request_id UNIQUE (request_id),
    CONSTRAINT ck_agent_runs_run_type CHECK (run_type IN ('chat', 'resume', 'subagent')),
    CONSTRAINT ck_agent_runs_not_own_parent CHECK (created_by_run_id <> id),
    CONSTRAINT ck_agent_runs_timestamps_in_range CHECK ({_WINDOW} @> created_at)
) WITH (fillfactor = 80);
CREATE INDEX ix_agent_runs_created_by_run_id ON agent_runs (created_by_run_id)
    WHERE created_by_run_id IS NOT NULL;
CREATE INDEX ix_agent_runs_created ON agent_runs (created_at, id);
CREATE INDEX ix_agent_runs_agent_created ON agent_runs (agent_slug, created_at, id);
CREATE INDEX ix_agent_runs_uid_created ON agent_runs (uid, created_at, id);
CREATE INDEX ix_agent_runs_thread_created ON agent_runs (thread_id, created_at, id);
CREATE TRIGGER agent_runs_json_guard BEFORE INSERT ON agent_runs
    FOR EACH ROW EXECUTE FUNCTION public.agent_runs_json_guard_input();
{_IMMUTABLE_GUARDS}
CREATE TABLE agent_run_state (
    run_id               text        PRIMARY KEY REFERENCES agent_runs (id) ON DELETE CASCADE,
    uid                  text        NOT NULL,
    agent_slug           text        NOT NULL,
    thread_id            text        NOT NULL,
    created_at           timestamptz NOT NULL,
    error_type           text,
    error_message        text,
    manifest             jsonb,
    manifest_fingerprint text,
    manifest_recorded_at timestamptz,
    finished_at          timestamptz,
    status               text        NOT NULL DEFAULT 'pending',
    started_at           timestamptz,
    worker_id            text,
    heartbeat_at         timestamptz,
    lease_expires_at     timestamptz,
    updated_at           timestamptz NOT NULL DEFAULT now(),
{_STATE_CHECKS},
    CONSTRAINT ck_agent_run_state_timestamps_in_range CHECK ({_WINDOW} @> ALL (ARRAY[
        created_at, updated_at, heartbeat_at, lease_expires_at, manifest_recorded_at,
        started_at, finished_at]))
) WITH (fillfactor = 80);
CREATE UNIQUE INDEX uq_agent_runs_one_active_per_thread
    ON agent_run_state (uid, agent_slug, thread_id) WHERE status IN {_ACTIVE};
CREATE INDEX ix_agent_runs_claimable ON agent_run_state (created_at, run_id)
    WHERE status = 'pending' OR (status = 'cancel_requested' AND worker_id IS NULL);
CREATE INDEX ix_agent_runs_live ON agent_run_state (run_id)
    WHERE status IN ('running', 'cancel_requested');
CREATE INDEX ix_agent_runs_status_created ON agent_run_state (status, created_at, run_id)
    WHERE status IN {_TERMINAL};
CREATE INDEX ix_agent_runs_finished ON agent_run_state (finished_at, run_id)
    WHERE finished_at IS NOT NULL;
CREATE TRIGGER agent_run_state_manifest_guard AFTER UPDATE OF manifest ON agent_run_state
    FOR EACH ROW WHEN (NEW.manifest IS DISTINCT FROM OLD.manifest)
    EXECUTE FUNCTION public.agent_runs_json_guard_manifest();
"""

# Input and manifest halves of 0003's JSON guard, for a design that keeps them in two tables.
JSON_GUARD_HALVES: Final = """\
CREATE OR REPLACE FUNCTION public.agent_runs_json_guard_input() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF public.agent_runs_json_problem(NEW.input_payload) IS NOT NULL THEN
        RAISE EXCEPTION 'run id=%: input_payload %', NEW.id,
            public.agent_runs_json_problem(NEW.input_payload) USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;
CREATE OR REPLACE FUNCTION public.agent_runs_json_guard_manifest() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF public.agent_runs_json_problem(NEW.manifest) IS NOT NULL THEN
        RAISE EXCEPTION 'run id=%: manifest %', NEW.run_id,
            public.agent_runs_json_problem(NEW.manifest) USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;
"""

SPLIT: Final = f"""\
CREATE SCHEMA design_split;
SET search_path = design_split, public;
{_SPLIT_RUNS}{_ATTEMPTS_TODAY}{_ATTEMPTS_FINISHED_INDEX}"""

# split_keys: split with attempts keyed (run_id, attempt_no). Trades: no surrogate attempt id
# (RunAttempt.id would have to become the pair), no index of attempts by finished_at.
SPLIT_KEYS: Final = f"""\
CREATE SCHEMA design_split_keys;
SET search_path = design_split_keys, public;
{_SPLIT_RUNS}{_ATTEMPTS_KEYED}"""

# queue: the single table with no index that reads status, worker_id or finished_at, so a claim
# and a finish can be HOT. Pickup from agent_run_queue (inserted at create, deleted at claim);
# one active run per thread from agent_run_active (inserted at create, deleted at finish; also
# the reconciler's live set). Trades: the side tables are kept right only by the statements
# (measured without triggers: a raw INSERT/UPDATE of agent_runs bypasses them); no index lists
# runs by status or by finished_at; the queue's dead head entries wait for vacuum.
QUEUE: Final = f"""\
CREATE SCHEMA design_queue;
SET search_path = design_queue, public;
{_ONE_ROW_RUNS}{_IMMUTABLE_GUARDS}
CREATE INDEX ix_agent_runs_created ON agent_runs (created_at, id);
CREATE INDEX ix_agent_runs_agent_created ON agent_runs (agent_slug, created_at, id);
CREATE INDEX ix_agent_runs_uid_created ON agent_runs (uid, created_at, id);
CREATE INDEX ix_agent_runs_thread_created ON agent_runs (thread_id, created_at, id);
CREATE TABLE agent_run_queue (
    created_at timestamptz NOT NULL,
    run_id     text        NOT NULL,
    PRIMARY KEY (created_at, run_id)
);
CREATE TABLE agent_run_active (
    uid        text NOT NULL,
    agent_slug text NOT NULL,
    thread_id  text NOT NULL,
    run_id     text NOT NULL,
    PRIMARY KEY (uid, agent_slug, thread_id)
);
{_ATTEMPTS_KEYED}"""

# lean_plus_checks: the lean floor's schema plus today's compact CHECKs on the columns it has.
LEAN_PLUS_CHECKS: Final = (
    lean_floor.DDL.replace("bench_lean.", "").replace(
        "CREATE SCHEMA bench_lean;",
        "CREATE SCHEMA design_lean_checks;\nSET search_path = design_lean_checks, public;",
    )
    + f"""\
ALTER TABLE runs ADD CONSTRAINT ck_runs_status CHECK (
        status IN ('pending', 'running', 'cancel_requested',
                   'completed', 'failed', 'cancelled', 'interrupted')),
    ADD CONSTRAINT ck_runs_lease_all_or_none CHECK (
        (worker_id IS NULL AND heartbeat_at IS NULL AND lease_expires_at IS NULL)
        OR (worker_id IS NOT NULL AND heartbeat_at IS NOT NULL AND lease_expires_at IS NOT NULL)),
    ADD CONSTRAINT ck_runs_terminal_is_finished CHECK (
        status NOT IN {_TERMINAL} OR (finished_at IS NOT NULL AND worker_id IS NULL)),
    ADD CONSTRAINT ck_runs_running_has_lease CHECK (status <> 'running' OR worker_id IS NOT NULL),
    ADD CONSTRAINT ck_runs_timestamps_in_range CHECK ({_WINDOW} @> ALL (ARRAY[
        created_at, heartbeat_at, lease_expires_at, started_at, finished_at]));
ALTER TABLE attempts ADD CONSTRAINT ck_attempts_attempt_no_positive CHECK (attempt_no > 0),
    ADD CONSTRAINT ck_attempts_outcome CHECK (
        outcome IN ('completed', 'failed', 'cancelled', 'interrupted',
                    'retry_released', 'lease_expired')),
    ADD CONSTRAINT ck_attempts_finished_has_outcome CHECK (
        (outcome IS NULL) = (finished_at IS NULL)),
    ADD CONSTRAINT ck_attempts_timestamps_in_range CHECK ({_WINDOW} @> ALL (ARRAY[
        started_at, heartbeat_at, lease_expires_at, finished_at]));
"""
)

# What each design changes against `current`, one line each (for the report).
DIFFERENCES: Final = {
    "lean": "bench_lean: bigint ids, runs PK + claimable only; attempts PK (run_id, attempt_no);"
    " no unique request_id, one-active, live, listing, FK, CHECK, trigger",
    "current": "migrations 0001-0012 as they are (public schema), bench/floor.py's statements",
    "diet": "- ix_agent_runs_finished, - ix_agent_run_attempts_finished; the 4 settled listing"
    " indexes' predicate NOT IN (running, cancel_requested) -> IN (terminal statuses)",
    "split": "agent_runs immutable (pkey, uq request_id, 4 unconditional listing, parent) +"
    " agent_run_state (pkey, one-active, claimable, live, status_created, finished, CHECKs);"
    " attempts as today",
    "split_keys": "split + attempts PRIMARY KEY (run_id, attempt_no): - identity id,"
    " - ix_agent_run_attempts_finished",
    "queue": "one table: pkey, uq request_id, 4 unconditional listing, parent; - one-active,"
    " - claimable, - live, - status_created, - finished; + agent_run_queue PK (created_at,"
    " run_id), + agent_run_active PK (uid, agent_slug, thread_id); attempts as split_keys",
    "lean_plus_checks": "lean + compact CHECKs (status, lease all-or-none, terminal finished,"
    " running leased, time window; attempt_no, outcome, outcome<->finished, time window)",
}
