"""Bad input: refused by name before any SQL, nothing written."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

import psycopg
import pytest

import agent_runs
from agent_runs import (
    AgentRunRepository,
    AgentRunsError,
    InvalidArgument,
    NotLeaseOwner,
    ThreadBusy,
    manifest_fingerprint,
)
from tests.fix_server import PgServer
from tests.helpers import (
    OWNER,
    Call,
    Runs,
    assert_refused_before_sql,
    assert_refused_writing_nothing,
    everything,
    read_state,
)

Conn = psycopg.Connection[Any]

LEASE = 30.0
MANIFEST = {"model": "m"}
FINGERPRINT = manifest_fingerprint(MANIFEST)
MARKER = " … [truncated {} characters]"


def create(**overrides: Any) -> Call:
    values: dict[str, Any] = {
        "thread_id": "t-new",
        "agent_slug": "a",
        "uid": "u",
        "request_id": "r-new",
    }
    values.update(overrides)
    return lambda repo, runs: repo.create_run(**values)


BAD_IDS: list[Any] = ["", "x" * 65, "a\x00b", None, 42]
BAD_WORKER_IDS: list[Any] = ["", "w" * 129, "w\x00", None, 7]
BAD_LEASES: list[Any] = [0, 0.0, -1, -0.001, 86400.001, 86401, math.nan, math.inf, -math.inf, "30"]
NAIVE = datetime(2030, 1, 1, 12, 0, 0)


def _cases() -> list[tuple[str, str, Call]]:
    """(case id, argument the message must name, the call)."""
    cases: list[tuple[str, str, Call]] = []

    def add(case_id: str, argument: str, call: Call) -> None:
        cases.append((case_id, argument, call))

    # run_id, request_id, thread_id, uid, agent_slug, created_by_run_id
    def bad_id(i: int, bad: Any) -> None:
        for argument in ("request_id", "thread_id", "uid", "agent_slug"):
            add(f"create_run-{argument}-{i}", argument, create(**{argument: bad}))
        if bad is not None:
            add(f"create_run-run_id-{i}", "run_id", create(run_id=bad))
            add(
                f"create_run-created_by_run_id-{i}",
                "created_by_run_id",
                create(created_by_run_id=bad),
            )
        add(
            f"mark_running-run_id-{i}",
            "run_id",
            lambda repo, runs: repo.mark_running(
                bad, worker_id=OWNER, lease_seconds=LEASE, now=runs.now
            ),
        )
        add(
            f"renew_lease-run_id-{i}",
            "run_id",
            lambda repo, runs: repo.renew_lease(
                bad, worker_id=OWNER, lease_seconds=LEASE, now=runs.now
            ),
        )
        add(
            f"release_lease_for_retry-run_id-{i}",
            "run_id",
            lambda repo, runs: repo.release_lease_for_retry(bad, worker_id=OWNER, now=runs.now),
        )
        add(
            f"set_terminal_status-run_id-{i}",
            "run_id",
            lambda repo, runs: repo.set_terminal_status(bad, status="failed", now=runs.now),
        )
        add(
            f"request_cancel-run_id-{i}",
            "run_id",
            lambda repo, runs: repo.request_cancel(bad, now=runs.now),
        )
        add(
            f"record_run_manifest-run_id-{i}",
            "run_id",
            lambda repo, runs: repo.record_run_manifest(
                bad, manifest=MANIFEST, fingerprint=FINGERPRINT, worker_id=OWNER, now=runs.now
            ),
        )
        add(f"get_run-run_id-{i}", "run_id", lambda repo, runs: repo.get_run(bad))
        add(
            f"list_run_attempts-run_id-{i}",
            "run_id",
            lambda repo, runs: repo.list_run_attempts(bad),
        )
        add(
            f"get_open_attempt-run_id-{i}",
            "run_id",
            lambda repo, runs: repo.get_open_attempt(bad),
        )

    for i, bad in enumerate(BAD_IDS):
        bad_id(i, bad)

    # worker_id: 1-128 characters, no NUL, wherever one is given
    def bad_worker_id(i: int, bad: Any) -> None:
        add(
            f"mark_running-worker_id-{i}",
            "worker_id",
            lambda repo, runs: repo.mark_running(
                runs.pending, worker_id=bad, lease_seconds=LEASE, now=runs.now
            ),
        )
        add(
            f"claim_next-worker_id-{i}",
            "worker_id",
            lambda repo, runs: repo.claim_next(worker_id=bad, lease_seconds=LEASE, now=runs.now),
        )
        add(
            f"renew_lease-worker_id-{i}",
            "worker_id",
            lambda repo, runs: repo.renew_lease(
                runs.running, worker_id=bad, lease_seconds=LEASE, now=runs.now
            ),
        )
        add(
            f"release_lease_for_retry-worker_id-{i}",
            "worker_id",
            lambda repo, runs: repo.release_lease_for_retry(
                runs.running, worker_id=bad, now=runs.now
            ),
        )
        add(
            f"record_run_manifest-worker_id-{i}",
            "worker_id",
            lambda repo, runs: repo.record_run_manifest(
                runs.running,
                manifest=MANIFEST,
                fingerprint=FINGERPRINT,
                worker_id=bad,
                now=runs.now,
            ),
        )
        if bad is not None:  # worker_id=None is how a pending run is failed without an owner
            add(
                f"set_terminal_status-worker_id-{i}",
                "worker_id",
                lambda repo, runs: repo.set_terminal_status(
                    runs.running, status="completed", worker_id=bad, now=runs.now
                ),
            )

    for i, bad in enumerate(BAD_WORKER_IDS):
        bad_worker_id(i, bad)

    # lease_seconds: a finite number, 0 < x <= 86400
    def bad_lease(i: int, bad: Any) -> None:
        add(
            f"mark_running-lease_seconds-{i}",
            "lease_seconds",
            lambda repo, runs: repo.mark_running(
                runs.pending, worker_id=OWNER, lease_seconds=bad, now=runs.now
            ),
        )
        add(
            f"claim_next-lease_seconds-{i}",
            "lease_seconds",
            lambda repo, runs: repo.claim_next(worker_id=OWNER, lease_seconds=bad, now=runs.now),
        )
        add(
            f"renew_lease-lease_seconds-{i}",
            "lease_seconds",
            lambda repo, runs: repo.renew_lease(
                runs.running, worker_id=OWNER, lease_seconds=bad, now=runs.now
            ),
        )

    for i, bad in enumerate(BAD_LEASES):
        bad_lease(i, bad)

    # status: terminal
    def bad_status(bad: Any) -> None:
        add(
            f"set_terminal_status-status-{bad or 'empty'}",
            "status",
            lambda repo, runs: repo.set_terminal_status(
                runs.running, status=bad, worker_id=OWNER, now=runs.now
            ),
        )

    for bad in ("pending", "running", "cancel_requested", "done", "", "COMPLETED"):
        bad_status(bad)

    # error_type: at most 64 characters
    add(
        "set_terminal_status-error_type-65",
        "error_type",
        lambda repo, runs: repo.set_terminal_status(
            runs.running, status="failed", worker_id=OWNER, error_type="e" * 65, now=runs.now
        ),
    )

    # fingerprint: 64 lowercase hex characters
    def bad_fingerprint(i: int, bad: Any) -> None:
        add(
            f"record_run_manifest-fingerprint-{i}",
            "fingerprint",
            lambda repo, runs: repo.record_run_manifest(
                runs.running, manifest=MANIFEST, fingerprint=bad, worker_id=OWNER, now=runs.now
            ),
        )

    bad_fingerprints = [
        "",
        "a" * 63,
        "a" * 65,
        FINGERPRINT.upper(),
        "g" * 64,
        " " + FINGERPRINT[1:],
    ]
    for i, bad in enumerate(bad_fingerprints):
        bad_fingerprint(i, bad)

    # manifest: a JSON-serializable dict
    def bad_manifest(i: int, bad: Any) -> None:
        add(
            f"record_run_manifest-manifest-{i}",
            "manifest",
            lambda repo, runs: repo.record_run_manifest(
                runs.running, manifest=bad, fingerprint=FINGERPRINT, worker_id=OWNER, now=runs.now
            ),
        )

    bad_manifests: list[Any] = [[1, 2], "text", None, {"x": object()}, {"x": {1, 2}}, {1j: 2}]
    for i, bad in enumerate(bad_manifests):
        bad_manifest(i, bad)

    # now: timezone-aware
    add(
        "mark_running-now",
        "now",
        lambda repo, runs: repo.mark_running(
            runs.pending, worker_id=OWNER, lease_seconds=LEASE, now=NAIVE
        ),
    )
    add(
        "claim_next-now",
        "now",
        lambda repo, runs: repo.claim_next(worker_id=OWNER, lease_seconds=LEASE, now=NAIVE),
    )
    add(
        "renew_lease-now",
        "now",
        lambda repo, runs: repo.renew_lease(
            runs.running, worker_id=OWNER, lease_seconds=LEASE, now=NAIVE
        ),
    )
    add(
        "release_lease_for_retry-now",
        "now",
        lambda repo, runs: repo.release_lease_for_retry(runs.running, worker_id=OWNER, now=NAIVE),
    )
    add(
        "set_terminal_status-now",
        "now",
        lambda repo, runs: repo.set_terminal_status(
            runs.running, status="completed", worker_id=OWNER, now=NAIVE
        ),
    )
    add(
        "request_cancel-now", "now", lambda repo, runs: repo.request_cancel(runs.running, now=NAIVE)
    )
    add(
        "reconcile_expired_leases-now",
        "now",
        lambda repo, runs: repo.reconcile_expired_leases(now=NAIVE),
    )
    add(
        "record_run_manifest-now",
        "now",
        lambda repo, runs: repo.record_run_manifest(
            runs.running, manifest=MANIFEST, fingerprint=FINGERPRINT, worker_id=OWNER, now=NAIVE
        ),
    )
    return cases


CASES = _cases()


@pytest.mark.parametrize(("argument", "call"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_argument_is_refused_by_name_and_writes_nothing(
    repo: AgentRunRepository, observer: Conn, runs: Runs, argument: str, call: Call
) -> None:
    assert_refused_writing_nothing(repo, observer, runs, argument, call)


@pytest.mark.parametrize(("argument", "call"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_argument_is_refused_before_any_sql_runs(
    pg_server: PgServer, argument: str, call: Call
) -> None:
    """On a closed connection, any SQL would fail: only validation can answer."""
    assert_refused_before_sql(pg_server.admin_url, argument, call)


@pytest.mark.parametrize(
    "call",
    [
        lambda repo, runs: repo.mark_running(
            runs.pending, worker_id="w" * 128, lease_seconds=86400, now=runs.now
        ),
        lambda repo, runs: repo.mark_running(
            runs.pending, worker_id="w", lease_seconds=0.001, now=runs.now
        ),
        lambda repo, runs: repo.renew_lease(
            runs.running, worker_id=OWNER, lease_seconds=1, now=runs.now
        ),
        lambda repo, runs: repo.set_terminal_status(
            runs.running, status="failed", worker_id=OWNER, error_type="e" * 64, now=runs.now
        ),
        lambda repo, runs: repo.create_run(
            thread_id="t" * 64,
            agent_slug="a" * 64,
            uid="u" * 64,
            request_id="r" * 64,
            run_id="i" * 64,
            created_by_run_id=runs.pending,
        ),
        lambda repo, runs: repo.record_run_manifest(
            runs.running,
            manifest={},
            fingerprint=manifest_fingerprint({}),
            worker_id=OWNER,
            now=runs.now,
        ),
    ],
    ids=[
        "worker_id-128-and-lease-86400",
        "tiny-lease",
        "integer-lease",
        "error_type-64",
        "ids-64",
        "empty-manifest",
    ],
)
def test_values_at_the_limits_are_accepted(
    repo: AgentRunRepository, observer: Conn, runs: Runs, call: Call
) -> None:
    before = everything(observer)
    result = call(repo, runs)
    assert result is not None and result is not False
    assert everything(observer) != before


def test_an_unknown_run_type_is_refused_by_name(repo: AgentRunRepository, observer: Conn) -> None:
    """A careful user expects InvalidArgument, not a CHECK."""
    with pytest.raises(InvalidArgument, match="run_type"):
        repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r", run_type="batch")
    assert everything(observer) == ([], [])


def test_error_classes_are_exported_with_their_bases() -> None:
    assert issubclass(InvalidArgument, AgentRunsError) and issubclass(InvalidArgument, ValueError)
    assert issubclass(NotLeaseOwner, AgentRunsError) and issubclass(NotLeaseOwner, ValueError)
    assert issubclass(ThreadBusy, AgentRunsError)
    assert agent_runs.errors.AgentRunsError is AgentRunsError
    for name in ("AgentRunsError", "InvalidArgument", "NotLeaseOwner", "ThreadBusy"):
        assert name in agent_runs.__all__


# --- error_message is never refused ------------------------------------------------------------


def _fail(repo: AgentRunRepository, runs: Runs, message: str) -> None:
    result = repo.set_terminal_status(
        runs.running,
        status="failed",
        worker_id=OWNER,
        error_type="boom",
        error_message=message,
        now=runs.now,
    )
    assert result.changed


def _stored_messages(observer: Conn, run_id: str) -> tuple[str, str]:
    state = read_state(observer, run_id)
    assert state.run is not None
    return state.run["error_message"], state.attempts[-1]["error_message"]


def test_nul_characters_in_an_error_message_become_replacement_characters(
    repo: AgentRunRepository, observer: Conn, runs: Runs
) -> None:
    _fail(repo, runs, "before\x00after\x00")
    assert _stored_messages(observer, runs.running) == ("before\ufffdafter\ufffd",) * 2


def test_an_error_message_of_exactly_8192_characters_is_kept_whole(
    repo: AgentRunRepository, observer: Conn, runs: Runs
) -> None:
    message = "é" * 8192
    _fail(repo, runs, message)
    assert _stored_messages(observer, runs.running) == (message, message)


@pytest.mark.parametrize("length", [8193, 20_000, 1_000_000])
def test_a_long_error_message_is_cut_with_a_marker_not_refused(
    repo: AgentRunRepository, observer: Conn, runs: Runs, length: int
) -> None:
    message = "".join(chr(0x41 + i % 26) for i in range(length))
    _fail(repo, runs, message)
    expected = message[:8192] + MARKER.format(length - 8192)
    assert _stored_messages(observer, runs.running) == (expected, expected)


def test_nul_cleaning_and_cutting_apply_together(
    repo: AgentRunRepository, observer: Conn, runs: Runs
) -> None:
    message = "\x00" * 9000
    _fail(repo, runs, message)
    expected = "\ufffd" * 8192 + MARKER.format(808)
    assert _stored_messages(observer, runs.running) == (expected, expected)


def test_a_pending_run_failed_without_an_owner_gets_the_same_cleaning(
    repo: AgentRunRepository, observer: Conn, runs: Runs
) -> None:
    assert repo.set_terminal_status(
        runs.pending, status="failed", error_message="x\x00" + "y" * 9000, now=runs.now
    ).changed
    state = read_state(observer, runs.pending)
    assert state.run is not None
    assert state.run["error_message"] == "x\ufffd" + "y" * 8190 + MARKER.format(9002 - 8192)


# --- hostile strings are data --------------------------------------------------------------------

HOSTILE = [
    "'; DROP TABLE agent_runs; --",
    '"quoted" \\ back\\slash',
    "-- comment",
    "/* open comment",
    "%(run_id)s %s {} $1",
    "Robert'); DELETE FROM agent_run_attempts;--",
    "ünïcödé ☃ 𝔘 日本語 עברית \u200f\u202e",
    "tab\tnew\nline\rreturn",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_strings_round_trip_as_data(
    repo: AgentRunRepository, observer: Conn, t0: datetime, text: str
) -> None:
    ident = text[:64]
    run = repo.create_run(
        thread_id=ident,
        agent_slug=ident,
        uid=ident,
        request_id=ident,
        run_id=ident,
        input_payload={text: text},
    )
    worker = text[:128]
    assert repo.mark_running(run.id, worker_id=worker, lease_seconds=LEASE, now=t0).acquired
    assert repo.renew_lease(run.id, worker_id=worker, lease_seconds=LEASE, now=t0)
    manifest = {text: [text]}
    assert repo.record_run_manifest(
        run.id,
        manifest=manifest,
        fingerprint=manifest_fingerprint(manifest),
        worker_id=worker,
        now=t0,
    ).changed
    assert repo.set_terminal_status(
        run.id,
        status="failed",
        worker_id=worker,
        error_type=text[:64],
        error_message=text,
        now=t0,
    ).changed
    state = read_state(observer, ident)
    assert state.run is not None
    for column in ("id", "thread_id", "agent_slug", "uid", "request_id"):
        assert state.run[column] == ident
    assert state.run["input_payload"] == {text: text}
    assert state.run["manifest"] == manifest
    assert (state.run["error_type"], state.run["error_message"]) == (text[:64], text)
    [attempt] = state.attempts
    assert attempt["worker_id"] == worker and attempt["error_message"] == text
    assert repo.get_run(ident) is not None
    tables = observer.execute(
        "SELECT count(*) FROM pg_tables WHERE tablename IN ('agent_runs', 'agent_run_attempts')"
    ).fetchone()
    assert tables == (2,)
