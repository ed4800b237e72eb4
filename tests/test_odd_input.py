"""Odd input never loses a fact: refused by name before any SQL, made storable, or kept exact.

Against the real database: refusals write nothing (counted from another connection), the
schema refuses what the API refuses, failure facts with unstorable text are still recorded,
manifests fingerprint the same after a jsonb round trip, human output escapes what it prints.
"""

from __future__ import annotations

import hashlib
import json
import math
import unicodedata
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from psycopg import sql

from agent_runs import AgentRunRepository, InvalidArgument, manifest_fingerprint
from agent_runs import validation as check
from agent_runs.explain import explain_run
from agent_runs.report import history_json, render_history
from tests.helpers import (
    OWNER,
    Call,
    Runs,
    assert_refused_before_sql,
    assert_refused_writing_nothing,
    new_run,
)
from tests.helpers import row_counts as counts

Conn = psycopg.Connection[Any]
LEASE = 30.0
TIME_MAX = datetime(9000, 1, 1, tzinfo=UTC)
TIME_MIN = datetime(2000, 1, 1, tzinfo=UTC)
# Threads left running by other tests (jittered back-offs) move the global random state while
# Hypothesis draws; it then warns about the random module in strategies, which none use here.
FOREIGN_RANDOM = pytest.mark.filterwarnings(
    "ignore:Do not use the `random` module inside strategies"
)
PROPERTY = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def nested(depth: int) -> dict[str, Any]:
    """A dict nested `depth` objects deep, built without recursion."""
    root: dict[str, Any] = {}
    inner = root
    for _ in range(depth - 1):
        inner["a"] = {}
        inner = inner["a"]
    return root


SURROGATE = "\udc80"
PLUS_16 = timezone(timedelta(hours=16))
BAD_JSON: list[tuple[str, Any]] = [
    ("nan", {"a": math.nan}),
    ("infinity", {"a": [1, -math.inf]}),
    ("int-key", {1: 2}),
    ("none-key", {None: 2}),
    ("tuple-key", {(1, 2): 2}),
    ("nul-key", {"a\x00": 1}),
    ("nul-string", {"a": ["ok", "b\x00"]}),
    ("surrogate-key", {SURROGATE: 1}),
    ("surrogate-string", {"a": {"b": "x" + SURROGATE}}),
    ("set", {"a": {1, 2}}),
    ("bytes", {"a": b"x"}),
    ("huge-int", {"a": 10**4000}),
    ("deep-65", nested(65)),
    ("deep-10000", nested(10_000)),
    ("not-an-object", [1, 2]),
]


def _cases() -> list[tuple[str, str, Call]]:
    cases: list[tuple[str, str, Call]] = []

    def add(case_id: str, argument: str, call: Call) -> None:
        cases.append((case_id, argument, call))

    add("run_type-list", "run_type", lambda r, _: new_run(r, run_type=[]))
    add("run_type-none", "run_type", lambda r, _: new_run(r, run_type=None))
    for argument in ("thread_id", "agent_slug", "uid", "request_id", "run_id", "created_by_run_id"):
        add(
            f"create_run-{argument}-surrogate",
            argument,
            lambda r, _, a=argument: new_run(r, **{a: "x" + SURROGATE}),  # type: ignore[misc]
        )
    add("get_run-surrogate", "run_id", lambda r, _: r.get_run(SURROGATE))
    add("get_run-list", "run_id", lambda r, _: r.get_run([]))  # type: ignore[arg-type]
    add("get_run_by_owner-surrogate", "worker_id", lambda r, _: r.get_run_by_owner(SURROGATE))
    add(
        "mark_running-worker_id-surrogate",
        "worker_id",
        lambda r, s: r.mark_running(s.pending, worker_id=SURROGATE, lease_seconds=LEASE, now=s.now),
    )
    for slugs in ("support", [], [""], ["a", SURROGATE], 5, {"a": 1}):
        add(
            f"claim_next-agent_slugs-{slugs!r}",
            "agent_slugs",
            lambda r, s, v=slugs: r.claim_next(  # type: ignore[misc]
                worker_id=OWNER, lease_seconds=LEASE, now=s.now, agent_slugs=v
            ),
        )
    for i, lease in enumerate([10**400, -(10**400), True, Decimal(1), 2**2000]):
        add(
            f"mark_running-lease_seconds-{i}",
            "lease_seconds",
            lambda r, s, v=lease: r.mark_running(  # type: ignore[misc]
                s.pending, worker_id=OWNER, lease_seconds=v, now=s.now
            ),
        )
        add(
            f"renew_leases-lease_seconds-{i}",
            "lease_seconds",
            lambda r, s, v=lease: r.renew_leases(  # type: ignore[misc]
                {s.running: OWNER}, lease_seconds=v, now=s.now
            ),
        )
    bad_nows: list[tuple[str, Any]] = [
        ("far-future", datetime(9500, 1, 1, tzinfo=UTC)),
        ("max", datetime.max.replace(tzinfo=UTC)),
        ("window-end", TIME_MAX),
        ("before-2000", TIME_MIN - timedelta(microseconds=1)),
        ("min-plus-16", datetime.min.replace(tzinfo=PLUS_16)),
        ("string", "2030-01-01T00:00:00Z"),
    ]
    for label, bad in bad_nows:
        add(
            f"mark_running-now-{label}",
            "now",
            lambda r, s, v=bad: r.mark_running(  # type: ignore[misc]
                s.pending, worker_id=OWNER, lease_seconds=LEASE, now=v
            ),
        )
        add(
            f"set_terminal_status-now-{label}",
            "now",
            lambda r, s, v=bad: r.set_terminal_status(  # type: ignore[misc]
                s.running, status="completed", worker_id=OWNER, now=v
            ),
        )
        add(
            f"reconcile-now-{label}",
            "now",
            lambda r, _, v=bad: r.reconcile_expired_leases(now=v),  # type: ignore[misc]
        )
    # now is inside the window, now + lease_seconds is not
    edge = TIME_MAX - timedelta(seconds=LEASE - 1)
    add(
        "mark_running-expiry-past-window",
        "now + lease_seconds",
        lambda r, s: r.mark_running(s.pending, worker_id=OWNER, lease_seconds=LEASE, now=edge),
    )
    add(
        "claim_next-expiry-past-window",
        "now + lease_seconds",
        lambda r, _: r.claim_next(worker_id=OWNER, lease_seconds=LEASE, now=edge),
    )
    add(
        "renew_lease-expiry-past-window",
        "now + lease_seconds",
        lambda r, s: r.renew_lease(s.running, worker_id=OWNER, lease_seconds=LEASE, now=edge),
    )
    add(
        "renew_leases-expiry-past-window",
        "now + lease_seconds",
        lambda r, s: r.renew_leases({s.running: OWNER}, lease_seconds=LEASE, now=edge),
    )
    for label, bad in BAD_JSON:
        add(
            f"create_run-input_payload-{label}",
            "input_payload",
            lambda r, _, v=bad: new_run(r, input_payload=v),  # type: ignore[misc]
        )
        add(
            f"record_run_manifest-manifest-{label}",
            "manifest",
            lambda r, s, v=bad: r.record_run_manifest(  # type: ignore[misc]
                s.running, manifest=v, fingerprint="0" * 64, worker_id=OWNER, now=s.now
            ),
        )
    for label, bad_type in [("empty", ""), ("surrogate", SURROGATE), ("nul", "a\x00"), ("int", 5)]:
        add(
            f"set_terminal_status-error_type-{label}",
            "error_type",
            lambda r, s, v=bad_type: r.set_terminal_status(  # type: ignore[misc]
                s.running, status="failed", worker_id=OWNER, error_type=v, now=s.now
            ),
        )
    add(
        "set_terminal_status-status-surrogate",
        "status",
        lambda r, s: r.set_terminal_status(s.running, status=SURROGATE, now=s.now),
    )
    for label, bad_limit in [("zero", 0), ("huge", 10**400), ("bool", True), ("float", 5.0)]:
        add(
            f"reconcile-limit-{label}",
            "limit",
            lambda r, s, v=bad_limit: r.reconcile_expired_leases(  # type: ignore[misc]
                now=s.now, limit=v
            ),
        )
    add("renew_leases-str", "leases", lambda r, s: r.renew_leases("abc", lease_seconds=LEASE))  # type: ignore[arg-type]
    add(
        "renew_leases-worker_id",
        "leases worker_id",
        lambda r, s: r.renew_leases({s.running: 5}, lease_seconds=LEASE),  # type: ignore[dict-item]
    )
    add(
        "renew_leases-run_id-surrogate",
        "leases run_id",
        lambda r, s: r.renew_leases({SURROGATE: OWNER}, lease_seconds=LEASE),
    )
    return cases


CASES = _cases()


@pytest.mark.parametrize(("argument", "call"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_odd_input_is_refused_by_name_and_writes_nothing(
    repo: AgentRunRepository, observer: Conn, runs: Runs, argument: str, call: Call
) -> None:
    assert_refused_writing_nothing(repo, observer, runs, argument, call)


@pytest.mark.parametrize(("argument", "call"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_odd_input_is_refused_before_any_sql(dsn: str, argument: str, call: Call) -> None:
    """On a closed connection any SQL would fail: only validation can answer."""
    assert_refused_before_sql(dsn, argument, call)


@pytest.mark.parametrize(("label", "bad"), BAD_JSON, ids=[label for label, _ in BAD_JSON])
def test_manifest_fingerprint_refuses_what_record_run_manifest_refuses(
    label: str, bad: Any
) -> None:
    with pytest.raises(InvalidArgument, match="manifest"):
        manifest_fingerprint(bad)


# -- clocks: any aware offset, converted to UTC; the whole window is readable ---------------------


@pytest.mark.parametrize("offset", [16 * 60, 23 * 60 + 59, -(23 * 60 + 59), 330])
def test_any_aware_offset_is_converted_to_utc_before_the_server(
    repo: AgentRunRepository, observer: Conn, t0: datetime, offset: int
) -> None:
    zone = timezone(timedelta(minutes=offset))
    run = new_run(repo)
    local = t0.astimezone(zone)
    claim = repo.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE, now=local)
    assert claim.acquired and claim.run is not None
    assert claim.run.heartbeat_at == t0 and claim.run.heartbeat_at.tzinfo is UTC
    row = observer.execute(
        "SELECT heartbeat_at, lease_expires_at FROM agent_runs WHERE id = %s", (run.id,)
    ).fetchone()
    assert row == (t0, t0 + timedelta(seconds=LEASE))


def test_the_edges_of_the_window_are_written_read_and_reconciled(
    repo: AgentRunRepository, observer: Conn
) -> None:
    """A lease ending just inside the window: every reader and the reconciler still work."""
    early, late = new_run(repo), new_run(repo)
    assert repo.mark_running(early.id, worker_id="w1", lease_seconds=LEASE, now=TIME_MIN).acquired
    last = TIME_MAX - timedelta(seconds=LEASE, microseconds=1)
    assert repo.mark_running(late.id, worker_id="w2", lease_seconds=LEASE, now=last).acquired
    converged = repo.reconcile_expired_leases(now=TIME_MAX - timedelta(microseconds=1))
    assert sorted(run.id for run in converged) == sorted([early.id, late.id])
    for run_id in (early.id, late.id):
        run = repo.get_run(run_id)
        assert run is not None and run.status == "failed"
        [attempt] = repo.list_run_attempts(run_id)
        assert attempt.outcome == "lease_expired"
    assert counts(observer) == (2, 2)


def _leases(observer: Conn, table: str) -> list[tuple[Any, ...]]:
    query = sql.SQL("SELECT lease_expires_at FROM {} WHERE heartbeat_at IS NOT NULL ORDER BY 1")
    return observer.execute(query.format(sql.Identifier(table))).fetchall()


@pytest.mark.parametrize("table", ["agent_runs", "agent_run_attempts"])
@pytest.mark.parametrize(
    "value", ["infinity", "-infinity", "9000-01-01 00:00Z", "1999-12-31 23:59:59.999999Z"]
)
def test_the_schema_refuses_a_timestamp_outside_the_window(
    observer: Conn, runs: Runs, table: str, value: str
) -> None:
    before = _leases(observer, table)
    assert before
    update = sql.SQL(
        "UPDATE {} SET lease_expires_at = %s::timestamptz WHERE heartbeat_at IS NOT NULL"
    ).format(sql.Identifier(table))
    with pytest.raises(psycopg.errors.CheckViolation, match="timestamps_in_range"):
        observer.execute(update, (value,))
    run_id = f"direct-{uuid.uuid4().hex}"
    with pytest.raises(psycopg.errors.CheckViolation, match="timestamps_in_range"):
        observer.execute(
            "INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, created_at)"
            " VALUES (%(id)s, %(id)s, %(id)s, 'a', 'u', %(at)s::timestamptz)",
            {"id": run_id, "at": value},
        )
    assert _leases(observer, table) == before
    assert counts(observer) == (2, 1)


# -- failure facts are made storable, never refused ----------------------------------------------


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


@pytest.mark.parametrize(
    ("message", "stored"),
    [
        ("lone " + SURROGATE + " and \x00", "lone \ufffd and \ufffd"),
        ("pair \ud83d\ude00 joined", "pair 😀 joined"),
        ("\ud800", "\ufffd"),
        (Unprintable(), "<unprintable Unprintable: __str__ raised RuntimeError>"),
    ],
    ids=["lone-and-nul", "surrogate-pair", "only-a-surrogate", "unprintable"],
)
def test_an_unstorable_error_message_is_recorded_storable(
    repo: AgentRunRepository, observer: Conn, runs: Runs, message: Any, stored: str
) -> None:
    result = repo.set_terminal_status(
        runs.running,
        status="failed",
        worker_id=OWNER,
        error_type="boom",
        error_message=message,
        now=runs.now,
    )
    assert result.changed
    row = observer.execute(
        "SELECT r.error_message, a.error_message FROM agent_runs r"
        " JOIN agent_run_attempts a ON a.run_id = r.id WHERE r.id = %s",
        (runs.running,),
    ).fetchone()
    assert row == (stored, stored)


def test_a_long_message_with_surrogates_is_cleaned_then_cut() -> None:
    text = check.error_message(SURROGATE * 9000)
    assert text == "\ufffd" * 8192 + " … [truncated 808 characters]"


@pytest.mark.parametrize(
    ("error_type", "message"),
    [
        ("", "boom"),
        ("e" * 65, "boom"),
        ("bad\x00type", None),
        ("bad" + SURROGATE, "msg" + SURROGATE),
        (42, "boom"),
        (["x"], "\x00" * 10),
    ],
    ids=["empty", "65", "nul", "surrogate", "int", "list"],
)
def test_an_invalid_agent_error_type_is_kept_inside_the_message(
    repo: AgentRunRepository, observer: Conn, runs: Runs, error_type: Any, message: Any
) -> None:
    stored_type, stored_message = check.agent_error(error_type, message)
    assert stored_type == check.INVALID_ERROR_TYPE
    assert stored_message is not None
    assert stored_message.startswith(f"error_type {check.error_message(repr(error_type))}")
    if message is not None:
        assert stored_message.endswith(": " + str(check.error_message(message)))
    assert repo.set_terminal_status(
        runs.running,
        status="failed",
        worker_id=OWNER,
        error_type=stored_type,
        error_message=stored_message,
        now=runs.now,
    ).changed
    row = observer.execute(
        "SELECT error_type, error_message FROM agent_runs WHERE id = %s", (runs.running,)
    ).fetchone()
    assert row == (stored_type, stored_message)


def test_a_valid_agent_error_is_kept_as_is() -> None:
    assert check.agent_error("timeout", "took\x00 too long") == ("timeout", "took\ufffd too long")
    assert check.agent_error(None, None) == (None, None)
    assert check.agent_error("e" * 64, None) == ("e" * 64, None)


# -- worker settings -----------------------------------------------------------------------------


def test_worker_settings_are_checked_by_validation() -> None:
    assert check.worker_name("n" * 95) == "n" * 95
    assert len(f"{'n' * 95}:{uuid.uuid4().hex}") == 128
    for bad_name in ("n" * 96, "", "a\x00", SURROGATE, 5, None):
        with pytest.raises(InvalidArgument, match="name"):
            check.worker_name(bad_name)
    assert check.heartbeat_seconds(None, 60.0) == 20.0
    assert check.heartbeat_seconds(59, 60.0) == 59.0
    for bad_beat in (60, 61, 0, -1, math.nan, 10**400, True, "5"):
        with pytest.raises(InvalidArgument, match="heartbeat_seconds"):
            check.heartbeat_seconds(bad_beat, 60.0)
    assert check.max_tries(1) == 1
    for bad_tries in (0, -1, 10**400, True, 2.0, None):
        with pytest.raises(InvalidArgument, match="max_tries"):
            check.max_tries(bad_tries)
    assert check.poll_seconds(0.01) == 0.01
    for bad_poll in (0, -1, math.inf, math.nan, 10**400, 3601, False, None):
        with pytest.raises(InvalidArgument, match="poll_seconds"):
            check.poll_seconds(bad_poll)
    bad_slug_values: list[object] = ["support", [], set(), [""]]
    for bad_slugs in bad_slug_values:
        with pytest.raises(InvalidArgument, match="agent_slugs"):
            check.agent_slugs(bad_slugs)
    assert check.agent_slugs(("a", "b")) == ["a", "b"]


# -- manifests: the fingerprint survives jsonb --------------------------------------------------

JSON_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)
JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=False, allow_infinity=False)
    | JSON_TEXT
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(JSON_TEXT, inner, max_size=4)
    ),
    max_leaves=20,
)
MANIFESTS = st.dictionaries(JSON_TEXT, JSON_VALUES, max_size=6)


@pytest.fixture
def owned_runs(repo: AgentRunRepository, t0: datetime) -> Callable[[], str]:
    def claim() -> str:
        run = new_run(repo)
        assert repo.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0).acquired
        return run.id

    return claim


@FOREIGN_RANDOM
@PROPERTY
@given(manifest=MANIFESTS)
@example(manifest={"negative zero": -0.0, "e16": 1e16, "e23": 1e23, "max": 1.7976931348623157e308})
@example(manifest={"tiny": 5e-324, "small": 1e-7, "one": 1.0, "big int": 2**64 + 1})
@example(manifest={"huge int": -(10**3999), "keys": {"b": 1, "a": 2, "": 3}})
@example(manifest=nested(64))
@example(manifest={"text": "ünï ☃ 𝔘 \u202e \n\t\x1b ' \" \\", "\x7f": "\ufffe"})
def test_a_manifest_fingerprints_the_same_after_a_jsonb_round_trip(
    repo: AgentRunRepository, t0: datetime, owned_runs: Callable[[], str], manifest: dict[str, Any]
) -> None:
    run_id = owned_runs()
    fingerprint = manifest_fingerprint(manifest)
    recorded = repo.record_run_manifest(
        run_id, manifest=manifest, fingerprint=fingerprint, worker_id=OWNER, now=t0
    )
    assert recorded.changed and recorded.run is not None
    assert recorded.run.manifest is not None
    read = repo.get_run(run_id)
    assert read is not None and read.manifest is not None
    assert read.manifest_fingerprint == fingerprint
    assert manifest_fingerprint(read.manifest) == fingerprint
    assert manifest_fingerprint(recorded.run.manifest) == fingerprint


def _jsonb_rewrites(value: Any) -> bool:
    """True when jsonb would give a different number back (-0.0, floats printed with e+)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, float) and ("e+" in repr(item) or repr(item) == "-0.0"):
            return True
    return False


@FOREIGN_RANDOM
@settings(max_examples=200, deadline=None, database=None)
@given(manifest=MANIFESTS)
def test_the_fingerprint_is_the_documented_formula_when_jsonb_rewrites_no_number(
    manifest: dict[str, Any],
) -> None:
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    expected = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    assert (manifest_fingerprint(manifest) == expected) or _jsonb_rewrites(manifest)


ODD_TEXT = st.text(
    alphabet=st.characters() | st.sampled_from(["\x00", SURROGATE, "\ud83d", "\u202e"]),
    max_size=8,
)
ODD_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | ODD_TEXT,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(ODD_TEXT | st.integers(), inner, max_size=3)
    ),
    max_leaves=12,
)


@FOREIGN_RANDOM
@PROPERTY
@given(payload=st.dictionaries(ODD_TEXT, ODD_VALUES, max_size=4))
def test_every_payload_is_either_refused_by_name_or_stored_by_the_server(
    repo: AgentRunRepository, observer: Conn, payload: dict[str, Any]
) -> None:
    before = counts(observer)
    try:
        run = new_run(repo, input_payload=payload)
    except InvalidArgument as exc:
        assert "input_payload" in str(exc)
        assert counts(observer) == before
        return
    read = repo.get_run(run.id)
    assert read is not None
    assert json.dumps(read.input_payload, sort_keys=True) == json.dumps(
        json.loads(json.dumps(payload)), sort_keys=True
    ) or _jsonb_rewrites(payload)


# -- human output: one value, one cell -------------------------------------------------------------

HOSTILE = "a\x1b[31mred\r\nforged | line\u202eevil\x85\u2028\x00end\\"


def _visible(line: str) -> bool:
    bidi = set("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
    return not any(
        unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp") or ch in bidi for ch in line
    )


def test_the_attempts_table_escapes_every_value_and_the_json_stays_exact(
    repo: AgentRunRepository, t0: datetime
) -> None:
    ident = "id\x1b\n\u202e"[:64]
    run = repo.create_run(
        thread_id=ident, agent_slug=ident, uid=ident, request_id="req" + ident, run_id=ident
    )
    owner = "w" + HOSTILE.replace("\x00", "")
    assert repo.mark_running(run.id, worker_id=owner, lease_seconds=LEASE, now=t0).acquired
    assert repo.release_lease_for_retry(run.id, worker_id=owner, now=t0)
    assert repo.mark_running(run.id, worker_id=owner, lease_seconds=LEASE, now=t0).acquired
    assert repo.set_terminal_status(
        run.id,
        status="failed",
        worker_id=owner,
        error_type="type\x1b]0;title\x07",
        error_message=HOSTILE,
        now=t0,
    ).changed
    finished = repo.get_run(run.id)
    assert finished is not None
    attempts = repo.list_run_attempts(run.id)
    explanation = explain_run(finished, attempts)
    assert explanation.explained, explanation.text
    text = render_history(finished, attempts, explanation)
    lines = text.split("\n")
    assert all(_visible(line) for line in lines), text
    # run (2 lines) + error + blank + header + rule + 2 attempts + blank + explanation
    assert len(lines) == 10, text
    assert "\\e[31m" in text and "\\r\\n" in text and "\\u202e" in text
    assert _visible(explanation.text) and "\\n" in explanation.text
    exact = history_json(finished, attempts, explanation)
    assert exact["run"]["error_message"] == check.error_message(HOSTILE)
    assert exact["run"]["thread_id"] == ident
    assert [a["worker_id"] for a in exact["attempts"]] == [owner, owner]


def _deep_json(depth: int) -> str:
    return '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        ("[1]", "is not an object"),
        ('"text"', "is not an object"),
        (_deep_json(65), "nests more than 64"),
        (_deep_json(5000), "nests more than 64"),
        ('{"a": [1e4000]}', "4,000 digits"),
        ('{"a": {"b": -1e4000}}', "4,000 digits"),
    ],
)
@pytest.mark.parametrize("column", ["input_payload", "manifest"])
def test_the_schema_refuses_json_the_module_could_not_read_back(
    observer: Conn, runs: Runs, column: str, document: str, problem: str
) -> None:
    before = counts(observer)
    # A manifest comes with its fingerprint and time (a CHECK, which PostgreSQL tests before
    # the AFTER UPDATE guard of 0006: the update breaks only the JSON rule).
    manifest_columns = ", manifest_fingerprint = 'x', manifest_recorded_at = now()"
    update = sql.SQL("UPDATE agent_runs SET {} = %s::jsonb{} WHERE id = %s").format(
        sql.Identifier(column), sql.SQL(manifest_columns if column == "manifest" else "")
    )
    with pytest.raises(psycopg.errors.CheckViolation, match=f"{column} .*{problem}"):
        observer.execute(update, (document, runs.running))
    insert = sql.SQL(
        "INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, {},"
        " manifest_fingerprint, manifest_recorded_at)"
        " VALUES ('direct', 'direct', 'direct', 'a', 'u', %s::jsonb, {}, {})"
    ).format(
        sql.Identifier(column),
        sql.Literal("x" if column == "manifest" else None),
        sql.SQL("now()" if column == "manifest" else "NULL"),
    )
    with pytest.raises(psycopg.errors.CheckViolation, match=f"{column} .*{problem}"):
        observer.execute(insert, (document,))
    assert counts(observer) == before


def test_every_run_the_schema_allows_reads_back_and_reconciles(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    """Odd but allowed rows written with plain SQL: every reader and the reconciler cope."""
    odd = {
        "deep": _deep_json(64),
        "long-number": '{"a": 9e3999, "b": -1e-5000, "c": 1e400}',
        "text": '{"\\u202e": "\\u0001\\n", "": ""}',
    }
    lease_end = TIME_MAX - timedelta(microseconds=1)
    for run_id, document in odd.items():
        observer.execute(
            "INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, input_payload,"
            " status, worker_id, heartbeat_at, lease_expires_at, started_at, created_at)"
            " VALUES (%(id)s, %(id)s, %(id)s, 'a', 'u', %(doc)s::jsonb, 'running', 'w',"
            " %(min)s, %(end)s, %(min)s, %(min)s)",
            {"id": run_id, "doc": document, "min": TIME_MIN, "end": lease_end},
        )
    for run_id in odd:
        run = repo.get_run(run_id)
        assert run is not None and run.lease_expires_at == lease_end
    converged = repo.reconcile_expired_leases(now=lease_end)
    assert sorted(run.id for run in converged) == sorted(odd)
    assert counts(observer) == (len(odd), 0)
