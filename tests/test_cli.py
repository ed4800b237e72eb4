"""The `agent-runs` command line: exit codes, one-line errors, the attempts table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agent_runs import AgentRunRepository, create_pool
from agent_runs.agents import ScriptedAgent
from agent_runs.cli import main
from agent_runs.report import ATTEMPT_COLUMNS, ATTEMPT_JSON_FIELDS
from agent_runs.sql import migrations_dir
from agent_runs.worker import Worker
from tests.fix_factories import RunFactory

ROOT = Path(__file__).resolve().parents[1]
UNREACHABLE = "postgresql://nobody@127.0.0.1:1/none"


@pytest.fixture(autouse=True)
def _no_database_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *words: str) -> None:
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    for word in words:
        assert word in err


def enqueue_args(**overrides: str) -> list[str]:
    args = {"--thread": "t1", "--agent-slug": "scripted", "--uid": "u1"}
    args.update(overrides)
    return [item for pair in args.items() for item in pair]


# -- usage errors: exit 2, one line ----------------------------------------------------------


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys)
    assert code == 2
    assert_one_line_error(err, "required")


def test_a_missing_required_option_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "enqueue", "--thread", "t", "--dsn", UNREACHABLE)
    assert code == 2
    assert_one_line_error(err, "--agent-slug")


def test_a_missing_dsn_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "attempts", "some-run")
    assert code == 2
    assert_one_line_error(err, "DATABASE_URL")


def test_a_malformed_dsn_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "attempts", "x", "--dsn", "host=a =b")
    assert code == 2
    assert_one_line_error(err, "invalid DSN")


@pytest.mark.parametrize(
    ("payload", "words"),
    [("{not json", "not valid JSON"), ("[1, 2]", "JSON object"), ('"ok"', "JSON object")],
)
def test_a_bad_payload_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], dsn: str, payload: str, words: str
) -> None:
    code, _, err = run_cli(capsys, "enqueue", *enqueue_args(), "--payload", payload, "--dsn", dsn)
    assert code == 2
    assert_one_line_error(err, words)


def test_an_argument_the_repository_refuses_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], dsn: str
) -> None:
    code, _, err = run_cli(capsys, "enqueue", *enqueue_args(**{"--uid": "u" * 65}), "--dsn", dsn)
    assert code == 2
    assert_one_line_error(err, "uid")


def test_an_unknown_run_id_is_a_usage_error(capsys: pytest.CaptureFixture[str], dsn: str) -> None:
    code, _, err = run_cli(capsys, "attempts", "no-such-run", "--dsn", dsn)
    assert code == 2
    assert_one_line_error(err, "no run with id 'no-such-run'")


@pytest.mark.parametrize(
    "argv",
    [
        ["worker", "--concurrency", "0"],
        ["worker", "--lease-seconds", "nan"],
        ["worker", "--agent", "no_colon"],
        ["worker", "--agent", "no_such_module_xyz:agent"],
        ["worker", "--agent", "json:no_such_attr"],
        ["worker", "--agent", "json:__doc__"],
        ["worker", "--lease-seconds", "3", "--heartbeat-seconds", "3"],
        ["worker", "--name", "x" * 200],
        ["reconcile", "--every", "-1"],
    ],
)
def test_bad_worker_and_reconciler_options_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, _, err = run_cli(capsys, *argv, "--dsn", UNREACHABLE)
    assert code == 2
    assert_one_line_error(err)


# -- failures: exit 1 ------------------------------------------------------------------------


def test_an_unreachable_database_is_a_failure(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "enqueue", *enqueue_args(), "--dsn", UNREACHABLE)
    assert code == 1
    assert_one_line_error(err, "database error")


def test_a_busy_thread_is_a_failure(capsys: pytest.CaptureFixture[str], dsn: str) -> None:
    assert run_cli(capsys, "enqueue", *enqueue_args(), "--dsn", dsn)[0] == 0
    code, _, err = run_cli(capsys, "enqueue", *enqueue_args(), "--dsn", dsn)
    assert code == 1
    assert_one_line_error(err, "thread busy")


# -- commands that work ----------------------------------------------------------------------


def test_migrate_applies_reports_up_to_date_and_rolls_back(
    capsys: pytest.CaptureFixture[str], blank_dsn: str
) -> None:
    ids = sorted(p.name[: -len(".sql")] for p in migrations_dir().glob("*[0-9]_*.sql"))
    ids = [i for i in ids if not i.endswith(".rollback")]
    assert len(ids) >= 2
    assert run_cli(capsys, "migrate", "--dsn", blank_dsn)[:2] == (0, f"applied: {', '.join(ids)}\n")
    assert run_cli(capsys, "migrate", "--dsn", blank_dsn)[:2] == (0, "already up to date\n")
    assert run_cli(capsys, "migrate", "--rollback", "--dsn", blank_dsn)[:2] == (
        0,
        f"rolled back: {ids[-1]}\n",
    )


def test_migrate_reads_database_url(
    capsys: pytest.CaptureFixture[str], blank_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATABASE_URL", blank_dsn)
    code, out, _ = run_cli(capsys, "migrate")
    assert (code, out.startswith("applied:")) == (0, True)


def test_enqueue_prints_the_run_id_and_is_idempotent_per_request_id(
    capsys: pytest.CaptureFixture[str], dsn: str, repo: AgentRunRepository
) -> None:
    argv = [*enqueue_args(), "--request-id", "req-1", "--payload", '{"script": ["ok"]}']
    code, out, _ = run_cli(capsys, "enqueue", *argv, "--dsn", dsn)
    assert code == 0
    run_id = out.strip()
    run = repo.get_run(run_id)
    assert run is not None and run.input_payload == {"script": ["ok"]}
    assert (run.request_id, run.thread_id, run.agent_slug, run.uid) == (
        "req-1",
        "t1",
        "scripted",
        "u1",
    )
    assert run_cli(capsys, "enqueue", *argv, "--dsn", dsn)[:2] == (0, out)


def test_reconcile_once_reports_what_it_converged(
    capsys: pytest.CaptureFixture[str], dsn: str, repo: AgentRunRepository
) -> None:
    run = repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r")
    # Claimed a minute ago with a 1 s lease: expired by the database clock, no sleeping.
    a_minute_ago = datetime.now(UTC) - timedelta(minutes=1)
    assert repo.claim_next(worker_id="gone:1", lease_seconds=1, now=a_minute_ago) is not None
    code, out, _ = run_cli(capsys, "reconcile", "--dsn", dsn)
    assert (code, out) == (0, "reconciled 1 run(s)\n")
    converged = repo.get_run(run.id)
    assert converged is not None and converged.status == "failed"


@pytest.fixture
def finished_run_id(dsn: str, repo: AgentRunRepository) -> str:
    """A run with history: released for retry once, then completed by a real worker."""
    run = repo.create_run(
        thread_id="t",
        agent_slug="a",
        uid="u",
        request_id="r",
        input_payload={"script": ["retry", "ok"]},
    )
    with (
        create_pool(dsn, min_size=1, max_size=4) as pool,
        Worker(pool, ScriptedAgent(), name="cli-test", lease_seconds=5) as worker,
    ):
        worker.run_once()
        worker.run_once()
    return run.id


def test_attempts_prints_the_table_and_the_explanation(
    capsys: pytest.CaptureFixture[str], dsn: str, finished_run_id: str
) -> None:
    code, out, _ = run_cli(capsys, "attempts", finished_run_id, "--dsn", dsn)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"run {finished_run_id}  status completed")
    header = next(line for line in lines if line.strip().startswith("attempt "))
    assert header.split() == list(ATTEMPT_COLUMNS)
    # attempt, owner, started (2 words), finished (2 words), duration, outcome, error...
    rows = [line.split() for line in lines if line.strip()[:2] in ("1 ", "2 ")]
    assert [(row[0], row[7]) for row in rows] == [("1", "retry_released"), ("2", "completed")]
    assert rows[0][8] == "retryable_error:"  # the retryable error stays on its attempt
    assert lines[-1].startswith("completed: attempt 2 by cli-test:")


def test_attempts_json_has_the_documented_shape(
    capsys: pytest.CaptureFixture[str], dsn: str, finished_run_id: str
) -> None:
    code, out, _ = run_cli(capsys, "attempts", finished_run_id, "--json", "--dsn", dsn)
    assert code == 0
    data = json.loads(out)
    assert set(data) == {"run", "attempts", "requeues", "explanation"}
    assert data["requeues"] == []
    assert data["run"]["id"] == finished_run_id
    assert data["run"]["status"] == "completed"
    assert data["run"]["input_payload"] == {"script": ["retry", "ok"]}
    assert [tuple(a) for a in data["attempts"]] == [ATTEMPT_JSON_FIELDS] * 2
    assert [(a["attempt_no"], a["outcome"]) for a in data["attempts"]] == [
        (1, "retry_released"),
        (2, "completed"),
    ]
    assert data["attempts"][0]["finished_at"].endswith("+00:00")
    assert data["explanation"].startswith("completed: attempt 2")


def test_attempts_of_a_legacy_run_says_so(
    capsys: pytest.CaptureFixture[str], dsn: str, make_run: RunFactory
) -> None:
    run = make_run(status="completed", started_at=datetime.now(UTC), finished_at=datetime.now(UTC))
    code, out, _ = run_cli(capsys, "attempts", run.id, "--dsn", dsn)
    assert code == 0
    assert "(no attempts recorded)" in out
    assert out.splitlines()[-1].startswith("legacy: no facts recorded")


def test_attempts_of_a_run_cancelled_before_it_started(
    capsys: pytest.CaptureFixture[str], dsn: str, repo: AgentRunRepository
) -> None:
    run = repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r")
    repo.request_cancel(run.id)
    code, out, _ = run_cli(capsys, "attempts", run.id, "--json", "--dsn", dsn)
    assert code == 0
    assert (
        json.loads(out)["explanation"] == "cancelled: cancelled before it ever started (no attempt)"
    )


# -- the real entry points -------------------------------------------------------------------


def test_python_dash_m_and_the_console_script_both_run() -> None:
    module = subprocess.run(
        [sys.executable, "-m", "agent_runs", "--help"],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert module.returncode == 0
    for command in ("migrate", "enqueue", "worker", "reconcile", "attempts", "demo"):
        assert command in module.stdout
    script = Path(sys.executable).with_name("agent-runs")
    bad = subprocess.run(
        [str(script), "enqueue"], check=False, capture_output=True, text=True, cwd=ROOT
    )
    assert bad.returncode == 2
    assert_one_line_error(bad.stderr, "required")


@pytest.mark.e2e
def test_demo_runs_the_scripted_mix_to_the_end(dsn: str) -> None:
    """The demo on the test database (the embedded-server path is what `make demo` runs)."""
    demo = subprocess.run(
        [sys.executable, "-m", "agent_runs", "demo", "--dsn", dsn],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "UNEXPECTED" not in demo.stdout
    for label in ("success", "crash mid-run", "cancel", "hang", "retries exhausted"):
        assert f"== {label}" in demo.stdout
