"""Migrations tested by their effect: up, up again (no-op), down to zero, up again, same schema."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row

import agent_runs
from agent_runs import AgentRunRepository, RunStatus
from agent_runs.migrate import apply_migrations, rollback_migrations
from agent_runs.sql import migrations_dir
from tests.fix_server import conninfo_to_url

ALL = [
    "0001_agent_runs",
    "0002_agent_run_attempts",
    "0003_timestamp_bounds",
    "0004_operator_indexes",
    "0005_attempt_update_guard",
    "0006_json_guard_after_update",
    "0007_drop_attempt_identity_index",
    "0008_operator_indexes_skip_live",
    "0009_lineage_is_a_tree",
    "0010_trace_context",
    "0011_run_waiters",
    "0012_compact_time_checks",
    "0013_schedule_and_priority",
    "0014_requeues_and_policies",
    "0015_run_output_and_resumed_from",
    "0017_limits_per_key",
    "0018_limits_skip_blocked_runs",
]
AFTER_0001 = ALL[1:]
APP_TABLES = {
    "agent_runs",
    "agent_run_attempts",
    "agent_run_waiters",
    "agent_run_requeues",
    "agent_run_policies",
    "agent_run_limits",
}
AFTER_0002 = ALL[2:]
T0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)

# The application's schema, as comparable text (yoyo's own bookkeeping tables left out).
SCHEMA_SQL = """
WITH app_rel AS (
    SELECT c.oid, c.relname, c.relkind, c.reloptions
    FROM pg_class c
    WHERE c.relnamespace = 'public'::regnamespace
      AND c.relname NOT LIKE '\\_yoyo%' AND c.relname NOT LIKE 'yoyo\\_%'
)
SELECT item FROM (
    SELECT format('relation %s kind=%s options=%s', relname, relkind, reloptions) AS item
    FROM app_rel
    UNION ALL
    SELECT format('column %s.%s %s not_null=%s default=%s identity=%s', r.relname, a.attname,
                  format_type(a.atttypid, a.atttypmod), a.attnotnull,
                  pg_get_expr(d.adbin, d.adrelid), a.attidentity)
    FROM app_rel r
    JOIN pg_attribute a ON a.attrelid = r.oid AND a.attnum > 0 AND NOT a.attisdropped
    LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    WHERE r.relkind = 'r'
    UNION ALL
    SELECT format('constraint %s %s %s', r.relname, c.conname, pg_get_constraintdef(c.oid))
    FROM pg_constraint c JOIN app_rel r ON r.oid = c.conrelid
    UNION ALL
    SELECT format('index %s', pg_get_indexdef(i.indexrelid))
    FROM pg_index i JOIN app_rel r ON r.oid = i.indrelid
    UNION ALL
    SELECT format('trigger %s', pg_get_triggerdef(t.oid))
    FROM pg_trigger t JOIN app_rel r ON r.oid = t.tgrelid WHERE NOT t.tgisinternal
    UNION ALL
    SELECT format('function %s %s', p.oid::regprocedure, md5(p.prosrc))
    FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace
) AS schema
ORDER BY item
"""


def schema(url: str) -> list[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [row[0] for row in conn.execute(SCHEMA_SQL).fetchall()]


def relations(url: str) -> set[str]:
    return {
        item.split()[1] for item in schema(url) if item.startswith("relation") and "kind=r" in item
    }


def test_every_migration_has_a_rollback_file() -> None:
    folder = migrations_dir()
    forward = sorted(p.stem for p in folder.glob("*.sql") if not p.stem.endswith(".rollback"))
    assert forward == ALL
    for name in forward:
        rollback = folder / f"{name}.rollback.sql"
        assert rollback.is_file(), rollback
        assert rollback.read_text(encoding="utf-8").strip()


def test_migrations_apply_to_an_empty_database(blank_dsn: str) -> None:
    assert relations(blank_dsn) == set()
    assert apply_migrations(blank_dsn) == ALL
    assert relations(blank_dsn) == APP_TABLES
    items = schema(blank_dsn)
    assert any(item.startswith("trigger ") for item in items)
    assert any("uq_agent_run_attempts_run_attempt_no" in item for item in items)


def test_reapplying_migrations_is_a_no_op_that_keeps_the_data(blank_dsn: str) -> None:
    apply_migrations(blank_dsn)
    before = schema(blank_dsn)
    with agent_runs.connect(blank_dsn) as conn:
        run = AgentRunRepository(conn).create_run(
            thread_id="t", agent_slug="a", uid="u", request_id="r"
        )
    assert apply_migrations(blank_dsn) == []
    assert schema(blank_dsn) == before
    with agent_runs.connect(blank_dsn) as conn:
        assert AgentRunRepository(conn).get_run(run.id) is not None


def test_migrations_roll_back_one_by_one_to_zero_and_apply_again(blank_dsn: str) -> None:
    apply_migrations(blank_dsn)
    applied = schema(blank_dsn)

    assert sorted(rollback_migrations(blank_dsn, count=len(AFTER_0002))) == AFTER_0002
    assert not any("timestamps_in_range" in item for item in schema(blank_dsn))
    assert rollback_migrations(blank_dsn, count=1) == ["0002_agent_run_attempts"]
    assert relations(blank_dsn) == {"agent_runs"}
    assert not any(item.startswith(("function ", "trigger ")) for item in schema(blank_dsn))

    assert rollback_migrations(blank_dsn, count=1) == ["0001_agent_runs"]
    assert schema(blank_dsn) == []

    assert rollback_migrations(blank_dsn, count=1) == []
    assert apply_migrations(blank_dsn) == ALL
    assert schema(blank_dsn) == applied


def test_rolling_back_0002_keeps_the_runs_and_drops_their_history(blank_dsn: str) -> None:
    apply_migrations(blank_dsn)
    with agent_runs.connect(blank_dsn) as conn:
        repo = AgentRunRepository(conn)
        run = repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r")
        assert repo.mark_running(run.id, worker_id="w", lease_seconds=30, now=T0).acquired
    assert sorted(rollback_migrations(blank_dsn, count=len(AFTER_0001))) == AFTER_0001
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT status, worker_id FROM agent_runs").fetchone()
    assert row == ("running", "w")
    assert sorted(apply_migrations(blank_dsn)) == AFTER_0001
    with agent_runs.connect(blank_dsn) as conn:
        assert AgentRunRepository(conn).list_run_attempts(run.id) == []


LEGACY_RUNS: list[dict[str, Any]] = [
    {"id": "legacy-pending", "status": "pending"},
    {
        "id": "legacy-running",
        "status": "running",
        "worker_id": "old-worker",
        "heartbeat_at": T0,
        "lease_expires_at": T0 + timedelta(seconds=60),
        "started_at": T0,
    },
    {
        "id": "legacy-expired",
        "status": "running",
        "worker_id": "lost-worker",
        "heartbeat_at": T0 - timedelta(hours=1),
        "lease_expires_at": T0 - timedelta(minutes=59),
        "started_at": T0 - timedelta(hours=1),
    },
    {
        "id": "legacy-cancel",
        "status": "cancel_requested",
        "worker_id": "old-worker-2",
        "heartbeat_at": T0,
        "lease_expires_at": T0 + timedelta(seconds=60),
        "started_at": T0,
    },
    {"id": "legacy-done", "status": "completed", "started_at": T0, "finished_at": T0},
    {
        "id": "legacy-failed",
        "status": "failed",
        "error_type": "boom",
        "error_message": "it broke",
        "started_at": T0,
        "finished_at": T0,
    },
]


@pytest.fixture
def legacy_dsn(blank_dsn: str) -> str:
    """A database migrated to 0001 only, holding runs in every state (not migrated further)."""
    apply_migrations(blank_dsn)
    assert sorted(rollback_migrations(blank_dsn, count=len(AFTER_0001))) == AFTER_0001
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        for i, run in enumerate(LEGACY_RUNS):
            values = {
                "request_id": f"req-{i}",
                "thread_id": f"thread-{i}",
                "agent_slug": "a",
                "uid": "u",
                **run,
            }
            columns = ", ".join(values)
            marks = ", ".join(f"%({name})s" for name in values)
            conn.execute(
                f"INSERT INTO agent_runs ({columns}) VALUES ({marks})",  # noqa: S608
                values,
            )
    return blank_dsn


def _runs(url: str) -> list[dict[str, Any]]:
    with psycopg.connect(url, autocommit=True) as conn, conn.cursor(row_factory=dict_row) as cur:
        return cur.execute("SELECT * FROM agent_runs ORDER BY id").fetchall()


def test_0002_on_a_database_with_legacy_runs_back_fills_nothing(legacy_dsn: str) -> None:
    before = _runs(legacy_dsn)
    assert sorted(apply_migrations(legacy_dsn)) == AFTER_0001
    with psycopg.connect(legacy_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM agent_run_attempts").fetchone() == (0,)
    after = _runs(legacy_dsn)
    assert all(run.pop("trace_context") is None for run in after)  # 0010 adds it, NULL
    assert all(run.pop("output") is None for run in after)  # 0015 adds it, NULL
    assert all(run.pop("priority") == 0 for run in after)  # 0013 adds them: priority 0,
    assert all(run.pop("available_at") == run["created_at"] for run in after)  # creation time
    assert all(run.pop("concurrency_key") is None for run in after)  # 0017 adds it, NULL
    assert all(run.pop("key_waiting") is False for run in after)  # 0018 adds it, false
    assert after == before
    with agent_runs.connect(legacy_dsn) as conn:
        repo = AgentRunRepository(conn)
        for run in LEGACY_RUNS:
            assert repo.list_run_attempts(run["id"]) == []
            assert repo.get_open_attempt(run["id"]) is None


def test_legacy_runs_keep_working_after_0002(legacy_dsn: str) -> None:
    """A legacy owner can finish its run (no attempt to close); new claims start history."""
    apply_migrations(legacy_dsn)
    now = T0 + timedelta(seconds=1)
    with agent_runs.connect(legacy_dsn) as conn:
        repo = AgentRunRepository(conn)
        assert repo.renew_lease("legacy-running", worker_id="old-worker", lease_seconds=60, now=now)
        finished = repo.set_terminal_status(
            "legacy-running", status="completed", worker_id="old-worker", now=now
        )
        assert finished.changed and finished.run is not None
        assert repo.list_run_attempts("legacy-running") == []

        claim = repo.mark_running("legacy-pending", worker_id="new", lease_seconds=60, now=now)
        assert claim.acquired
        [attempt] = repo.list_run_attempts("legacy-pending")
        assert (attempt.attempt_no, attempt.worker_id, attempt.is_open) == (1, "new", True)

        converged = repo.reconcile_expired_leases(now=now)
        assert [run.id for run in converged] == ["legacy-expired"]
        assert converged[0].status == RunStatus.FAILED
        assert repo.list_run_attempts("legacy-expired") == []


def test_a_key_value_dsn_becomes_a_url_that_migrations_accept(blank_dsn: str) -> None:
    """The harness hands out postgresql:// URLs even when AGENT_RUNS_TEST_DSN is key=value."""
    key_value = make_conninfo("", **conninfo_to_dict(blank_dsn))
    assert not key_value.startswith("postgresql://")
    url = conninfo_to_url(key_value)
    assert url.startswith("postgresql://")
    assert conninfo_to_dict(url) == conninfo_to_dict(blank_dsn)
    assert apply_migrations(url) == ALL
    assert relations(blank_dsn) == APP_TABLES


def _bounds_objects(url: str) -> list[str]:
    """What 0003 creates (its CHECKs, its trigger and its functions), and 0006's trigger."""
    return [
        item for item in schema(url) if "timestamps_in_range" in item or "agent_runs_json_" in item
    ]


def _roll_back_0003(url: str) -> None:
    later = ALL[ALL.index("0003_timestamp_bounds") :]
    assert sorted(rollback_migrations(url, count=len(later))) == later
    assert _bounds_objects(url) == []


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("created_at", "1999-12-31 23:59:59Z"),
        ("started_at", "infinity"),
        ("input_payload", '{"a": 1e5000}'),
        ("input_payload", "[1]"),
    ],
)
def test_0003_refuses_a_row_out_of_bounds_leaves_nothing_and_applies_once_it_is_fixed(
    blank_dsn: str, column: str, value: str
) -> None:
    apply_migrations(blank_dsn)
    applied = _bounds_objects(blank_dsn)
    # 0003's two CHECKs, two functions and insert guard; 0006's update guard (same function).
    assert len(applied) == 6 and not any("NOT VALID" in item for item in applied)
    _roll_back_0003(blank_dsn)
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid)"
            " VALUES ('ok', 'ok', 'ok', 'a', 'u'), ('odd', 'odd', 'odd', 'a', 'u')"
        )
        conn.execute(
            sql.SQL("UPDATE agent_runs SET {} = %s WHERE id = 'odd'").format(
                sql.Identifier(column)
            ),
            (value,),
        )
    with pytest.raises(psycopg.errors.CheckViolation):
        apply_migrations(blank_dsn)
    assert _bounds_objects(blank_dsn) == []
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM agent_runs WHERE id = 'odd'")
    assert "0003_timestamp_bounds" in apply_migrations(blank_dsn)
    assert _bounds_objects(blank_dsn) == applied
    with agent_runs.connect(blank_dsn) as conn:
        assert AgentRunRepository(conn).get_run("ok") is not None


def test_rolling_back_0003_keeps_the_data_and_drops_only_its_bounds(blank_dsn: str) -> None:
    apply_migrations(blank_dsn)
    with agent_runs.connect(blank_dsn) as conn:
        repo = AgentRunRepository(conn)
        run = repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r")
        assert repo.mark_running(run.id, worker_id="w", lease_seconds=30, now=T0).acquired
    full = schema(blank_dsn)
    _roll_back_0003(blank_dsn)
    assert relations(blank_dsn) == {"agent_runs", "agent_run_attempts"}
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM agent_run_attempts").fetchone() == (1,)
        conn.execute("UPDATE agent_runs SET lease_expires_at = 'infinity'")  # no bound now
        conn.execute("UPDATE agent_runs SET lease_expires_at = %s", (T0,))
    assert sorted(apply_migrations(blank_dsn)) == ALL[ALL.index("0003_timestamp_bounds") :]
    assert schema(blank_dsn) == full


_WINDOW_EDGES = [
    None,
    "-infinity",
    "1999-12-31 23:59:59.999999Z",
    "2000-01-01 00:00Z",
    "2026-12-05 12:00+05:30",
    "8999-12-31 23:59:59.999999Z",
    "9000-01-01 00:00Z",
    "infinity",
]
_TIMESTAMPS = {
    "agent_runs": [
        "created_at",
        "updated_at",
        "heartbeat_at",
        "lease_expires_at",
        "manifest_recorded_at",
        "started_at",
        "finished_at",
    ],
    "agent_run_attempts": [
        "started_at",
        "created_at",
        "updated_at",
        "heartbeat_at",
        "lease_expires_at",
        "finished_at",
    ],
}


def _window_refusals(url: str) -> list[tuple[str, str, str | None, str]]:
    """Which (table, column, value) the time-window CHECKs refuse, tried on a row of each table
    (the other CHECKs switched off for the probe, inside a rolled-back transaction)."""
    found = []
    with psycopg.connect(url) as conn:
        conn.execute(
            "INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid)"
            " VALUES ('probe', 'probe', 'probe', 'a', 'u')"
        )
        conn.execute(
            "INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at)"
            " VALUES ('probe', 1, 'w', now())"
        )
        for table, columns in _TIMESTAMPS.items():
            others = conn.execute(
                "SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass"
                " AND contype = 'c' AND conname NOT LIKE '%%timestamps_in_range'",
                (table,),
            ).fetchall()
            for (name,) in others:
                conn.execute(
                    sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(
                        sql.Identifier(table), sql.Identifier(name)
                    )
                )
            conn.execute(
                sql.SQL("ALTER TABLE {} DISABLE TRIGGER USER").format(sql.Identifier(table))
            )
            for column in columns:
                for value in _WINDOW_EDGES:
                    try:
                        with conn.transaction():
                            conn.execute(
                                sql.SQL("UPDATE {} SET {} = %s::timestamptz").format(
                                    sql.Identifier(table), sql.Identifier(column)
                                ),
                                (value,),
                            )
                        outcome = "stored"
                    except psycopg.errors.CheckViolation as exc:
                        assert exc.diag.constraint_name == f"ck_{table}_timestamps_in_range"
                        outcome = "refused"
                    except psycopg.errors.NotNullViolation:
                        outcome = "not null"
                    found.append((table, column, value, outcome))
        conn.rollback()
    return found


def test_0012_refuses_exactly_what_0003s_time_window_refused_and_rolls_back_exactly(
    blank_dsn: str,
) -> None:
    newer = ALL[ALL.index("0012_compact_time_checks") + 1 :]
    apply_migrations(blank_dsn)
    assert sorted(rollback_migrations(blank_dsn, count=len(newer))) == newer
    compact, compact_schema = _window_refusals(blank_dsn), schema(blank_dsn)
    assert rollback_migrations(blank_dsn, count=1) == ["0012_compact_time_checks"]
    verbose = _window_refusals(blank_dsn)
    assert compact == verbose
    outcomes = {(t, c, v): o for t, c, v, o in compact}
    assert outcomes["agent_runs", "heartbeat_at", "infinity"] == "refused"
    assert outcomes["agent_runs", "heartbeat_at", "1999-12-31 23:59:59.999999Z"] == "refused"
    assert outcomes["agent_runs", "heartbeat_at", None] == "stored"
    assert outcomes["agent_run_attempts", "started_at", None] == "not null"
    assert outcomes["agent_runs", "finished_at", "8999-12-31 23:59:59.999999Z"] == "stored"
    assert outcomes["agent_run_attempts", "finished_at", "9000-01-01 00:00Z"] == "refused"
    rolled_back = schema(blank_dsn)
    assert rollback_migrations(blank_dsn, count=1) == ["0011_run_waiters"]
    assert apply_migrations(blank_dsn) == ["0011_run_waiters", "0012_compact_time_checks", *newer]
    assert sorted(rollback_migrations(blank_dsn, count=len(newer))) == newer
    assert schema(blank_dsn) == compact_schema
    assert rollback_migrations(blank_dsn, count=1) == ["0012_compact_time_checks"]
    assert schema(blank_dsn) == rolled_back
