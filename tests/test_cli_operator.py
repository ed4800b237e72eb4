"""`agent-runs runs / cancel / stats / prune` through main(): exits 0 and 2, JSON shapes, the
cursor on stderr, escaped tables."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest

from agent_runs import AgentRun
from agent_runs.cli.main import main

MakeRun = Callable[..., AgentRun]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_runs_json_pages_with_the_cursor_on_stderr(
    dsn: str, make_run: MakeRun, capsys: pytest.CaptureFixture[str], t0: datetime
) -> None:
    made = [make_run(created_at=t0 - timedelta(minutes=i)) for i in range(3)]
    code, out, err = run_cli(capsys, "runs", "--dsn", dsn, "--json", "--limit", "2")
    assert code == 0
    page = json.loads(out)
    assert [r["id"] for r in page] == [made[0].id, made[1].id]
    assert page[0]["attempt_count"] == 0 and page[0]["status"] == "pending"
    assert {"request_id", "created_at", "worker_id", "input_payload"} <= set(page[0])
    cursor = err.split("--before ")[1].strip()
    code, out, err = run_cli(capsys, "runs", "--dsn", dsn, "--json", "--before", cursor)
    assert code == 0 and [r["id"] for r in json.loads(out)] == [made[2].id]
    assert err == ""


def test_runs_table_escapes_values_and_ends_with_the_cursor_line(
    dsn: str, make_run: MakeRun, capsys: pytest.CaptureFixture[str]
) -> None:
    make_run(thread_id="evil\x1b[31m\nthread", agent_slug="a\u202eb")
    code, out, _ = run_cli(capsys, "runs", "--dsn", dsn, "--status", "pending")
    assert code == 0
    assert "\x1b" not in out and "\u202e" not in out and "evil\\e[31m\\nthread" in out
    assert out.splitlines()[0].split()[:3] == ["id", "status", "agent"]
    assert out.splitlines()[-1] == "(end of list)"


def test_cancel_tree_prints_counts_and_unknown_runs_exit_2(
    dsn: str, make_run: MakeRun, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_run()
    make_run(created_by_run_id=root.id)
    code, out, _ = run_cli(capsys, "cancel", root.id, "--tree", "--dsn", dsn, "--json")
    assert code == 0 and json.loads(out)["changed"] == {"cancelled": 2}
    code, out, _ = run_cli(capsys, "cancel", root.id, "--tree", "--dsn", dsn)
    assert code == 0 and out.startswith("nothing changed")
    for extra in ([], ["--tree"]):
        code, out, err = run_cli(capsys, "cancel", "missing-run", "--dsn", dsn, *extra)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1


def test_stats_json_has_stable_keys(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "stats", "--dsn", dsn, "--since", "1h", "--json")
    assert code == 0
    stats = json.loads(out)
    assert list(stats) == [
        "window_start",
        "now",
        "runs_by_status",
        "attempts_by_outcome",
        "top_error_types",
        "workers",
        "attempt_duration_seconds",
        "queue",
    ]
    assert stats["queue"] == {
        "pending": 0,
        "oldest_pending_age_seconds": None,
        "running": 0,
        "expired_unreconciled": 0,
    }


def test_prune_and_dry_run(
    dsn: str, make_run: MakeRun, capsys: pytest.CaptureFixture[str], t0: datetime
) -> None:
    old = t0 - timedelta(days=10)
    for _ in range(3):
        make_run(status="completed", created_at=old, started_at=old, finished_at=old)
    code, out, _ = run_cli(capsys, "prune", "--dsn", dsn, "--older-than", "7d", "--dry-run")
    assert code == 0 and out.startswith("would delete 3 runs and 0 attempts")
    code, out, _ = run_cli(
        capsys, "prune", "--dsn", dsn, "--older-than", "7d", "--batch", "2", "--json"
    )
    payload: dict[str, Any] = json.loads(out)
    assert code == 0 and (payload["runs"], payload["batches"], payload["dry_run"]) == (3, 2, False)


@pytest.mark.parametrize(
    "argv",
    [
        ["runs", "--since", "yesterday"],
        ["runs", "--since", "2030-01-01T00:00:00"],  # no offset
        ["runs", "--limit", "0"],
        ["runs", "--limit", "5000"],
        ["runs", "--before", "garbage"],
        ["runs", "--status", "nope"],
        ["runs", "--stuck", "--stuck-after", "15 minutes"],
        ["stats", "--since", "-1h"],
        ["prune", "--older-than", "0s"],
        ["prune", "--older-than", "7d", "--batch", "0"],
        ["prune"],
    ],
)
def test_bad_input_exits_2_with_one_line(
    dsn: str, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = run_cli(capsys, *argv, "--dsn", dsn)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
