"""Limits per key, seen from outside: a freed slot wakes a worker (and nothing else does),
renewals of keyed runs stay HOT, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from agent_runs import AgentRunRepository, Finish
from tests.helpers import new_run
from tests.test_notify import received

Conn = psycopg.Connection[Any]
LEASE = 60.0


@pytest.fixture
def claimable(dsn: str) -> Iterator[Conn]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("LISTEN agent_runs_claimable")
        conn.execute("LISTEN agent_runs_finished")  # the sentinel's channel
        yield conn


def _claimable(notes: list[tuple[str, str]]) -> list[str]:
    return [payload for channel, payload in notes if channel == "agent_runs_claimable"]


def test_the_end_that_frees_a_full_keys_slot_wakes_a_worker_for_its_oldest_waiting_run(
    repo: AgentRunRepository, claimable: Conn, observer: Conn
) -> None:
    repo.set_limit("provider:p", 1)
    first = new_run(repo, concurrency_key="provider:p", agent_slug="summarize")
    new_run(repo, concurrency_key="provider:p", agent_slug="translate")
    other = new_run(repo, agent_slug="free")
    assert repo.claim_next(worker_id="w-1", lease_seconds=LEASE).id == first.id  # type: ignore[union-attr]
    assert repo.claim_next(worker_id="w-2", lease_seconds=LEASE).id == other.id  # type: ignore[union-attr]
    received(claimable, observer)  # the creations' wake-ups
    # An unlimited run's end wakes nobody: notifying commits serialize.
    repo.set_terminal_status(other.id, status="completed", worker_id="w-2")
    assert _claimable(received(claimable, observer)) == []
    repo.set_terminal_status(first.id, status="completed", worker_id="w-1")
    assert _claimable(received(claimable, observer)) == ["translate"]


def test_a_raised_limit_wakes_a_worker_for_the_next_run_in_claim_order(
    repo: AgentRunRepository, claimable: Conn, observer: Conn
) -> None:
    repo.set_limit("provider:q", 0)  # paused
    new_run(repo, concurrency_key="provider:q", agent_slug="routine", priority=5)
    new_run(
        repo,
        concurrency_key="provider:q",
        agent_slug="later",
        priority=0,
        available_at=datetime.now(UTC) + timedelta(hours=1),
    )
    new_run(repo, concurrency_key="provider:q", agent_slug="urgent", priority=0)
    received(claimable, observer)  # the creations' wake-ups
    repo.set_limit("provider:q", 1)
    # Not the oldest run ("routine"), nor one scheduled for later: the one a claim takes.
    assert _claimable(received(claimable, observer)) == ["urgent"]


def test_a_requeued_run_of_a_full_key_is_parked_until_a_slot_frees(
    repo: AgentRunRepository, observer: Conn
) -> None:
    repo.set_limit("provider:r", 2)
    first = new_run(repo, concurrency_key="provider:r")
    second = new_run(repo, concurrency_key="provider:r")
    assert repo.claim_next(worker_id="w-1", lease_seconds=LEASE).id == first.id  # type: ignore[union-attr]
    assert repo.claim_next(worker_id="w-2", lease_seconds=LEASE).id == second.id  # type: ignore[union-attr]
    repo.set_terminal_status(second.id, status="failed", worker_id="w-2", error_type="boom")
    repo.set_limit("provider:r", 1)  # full again: first holds its only slot

    def parked() -> bool:
        row = observer.execute(
            "SELECT key_waiting FROM agent_runs WHERE id = %s", (second.id,)
        ).fetchone()
        assert row is not None
        return bool(row[0])

    assert repo.requeue_run(second.id).changed
    assert parked()  # out of the claim index while its key is full
    assert repo.claim_next(worker_id="w-3", lease_seconds=LEASE) is None
    repo.set_terminal_status(first.id, status="completed", worker_id="w-1")
    assert not parked()
    assert repo.claim_next(worker_id="w-3", lease_seconds=LEASE).id == second.id  # type: ignore[union-attr]


@pytest.mark.parametrize("ending", ["release", "finish_runs", "reconcile", "cancel"])
def test_every_kind_of_end_of_a_full_keys_run_wakes_a_worker(
    repo: AgentRunRepository, claimable: Conn, observer: Conn, ending: str
) -> None:
    repo.set_limit("k", 1)
    run = new_run(repo, concurrency_key="k", agent_slug="a")
    new_run(repo, concurrency_key="k", agent_slug="b")
    assert repo.claim_next(worker_id="w", lease_seconds=LEASE).id == run.id  # type: ignore[union-attr]
    received(claimable, observer)
    if ending == "release":
        assert repo.release_lease_for_retry(run.id, worker_id="w")
        expected = {"a"}  # the released run is the key's oldest waiting one now
    elif ending == "finish_runs":
        assert list(repo.finish_runs([Finish(run.id, "w", "failed", "x")])) == [run.id]
        expected = {"b"}
    elif ending == "reconcile":
        observer.execute("UPDATE agent_runs SET lease_expires_at = heartbeat_at WHERE id = %s",
                         (run.id,))  # fmt: skip
        assert repo.reconcile_expired_leases()
        expected = {"b"}
    else:
        repo.request_cancel(run.id)
        assert repo.set_terminal_status(run.id, status="cancelled", worker_id="w").changed
        expected = {"b"}
    assert set(_claimable(received(claimable, observer))) >= expected


def test_a_keyed_runs_renewal_is_hot_and_an_unkeyed_claim_never_fires_the_counter(
    conn: Conn, repo: AgentRunRepository, t0: datetime
) -> None:
    repo.set_limit("k", 2)
    keyed = new_run(repo, concurrency_key="k")
    assert repo.mark_running(keyed.id, worker_id="w", lease_seconds=30, now=t0).acquired

    def counts() -> tuple[int, int, int]:
        row = conn.execute(
            "SELECT pg_stat_get_xact_tuples_updated('agent_runs'::regclass),"
            " pg_stat_get_xact_tuples_hot_updated('agent_runs'::regclass),"
            " pg_stat_get_xact_tuples_updated('agent_run_limits'::regclass)"
        ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1]), int(row[2])

    with conn.transaction(force_rollback=True):
        before = counts()
        assert repo.renew_lease(
            keyed.id, worker_id="w", lease_seconds=30, now=t0 + timedelta(seconds=10)
        )
        updated, hot, counters = (a - b for a, b in zip(counts(), before, strict=True))
        assert (updated, hot, counters) == (1, 1, 0)
    unkeyed = new_run(repo)
    with conn.transaction(force_rollback=True):
        before = counts()
        assert repo.mark_running(unkeyed.id, worker_id="w", lease_seconds=30).acquired
        assert counts()[2] == before[2]  # the limits table untouched


def _cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent_runs", *args, "--dsn", dsn],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_cli_sets_lists_and_deletes_limits_and_lists_runs_by_key(dsn: str) -> None:
    made = _cli(dsn, "enqueue", "--thread", "t", "--agent-slug", "a", "--uid", "u",
                "--concurrency-key", "user:7")  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert _cli(dsn, "limit", "set", "user:7", "2").returncode == 0
    listed = _cli(dsn, "limit", "list", "--json")
    assert json.loads(listed.stdout) == [
        {"concurrency_key": "user:7", "max_running": 2, "running": 0, "waiting": 1}
    ]
    table = _cli(dsn, "limit", "list").stdout.splitlines()
    assert table[0].split() == ["key", "running", "limit", "waiting"]
    assert table[2].split() == ["user:7", "0", "2", "1"]
    runs = json.loads(_cli(dsn, "runs", "--key", "user:7", "--json").stdout)
    assert [r["id"] for r in runs] == [made.stdout.strip()]
    assert runs[0]["concurrency_key"] == "user:7"
    assert json.loads(_cli(dsn, "runs", "--key", "user:8", "--json").stdout) == []
    assert _cli(dsn, "limit", "delete", "user:7").returncode == 0
    assert json.loads(_cli(dsn, "limit", "list", "--json").stdout) == []


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("limit", "set", "k" * 129, "1"), "concurrency_key"),
        (("limit", "set", "k", "-1"), "max_running"),
        (("limit", "set", "k", "many"), "N"),
        (
            (
                "enqueue",
                "--thread",
                "t",
                "--agent-slug",
                "a",
                "--uid",
                "u",
                "--concurrency-key",
                "k" * 129,
            ),
            "concurrency_key",
        ),
        (("runs", "--key", "k" * 129), "concurrency_key"),
    ],
)
def test_the_cli_refuses_bad_keys_and_limits_in_one_line_writing_nothing(
    dsn: str, observer: Conn, args: tuple[str, ...], named: str
) -> None:
    done = _cli(dsn, *args)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and named in done.stderr, done.stderr
    assert observer.execute("SELECT count(*) FROM agent_runs").fetchone() == (0,)
    assert observer.execute("SELECT count(*) FROM agent_run_limits").fetchone() == (0,)
