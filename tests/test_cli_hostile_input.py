"""The command line under hostile input: one line on stderr and exit 2, no secrets echoed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agent_runs.cli import main

SECRET = "s3cr#t?pw"


def _cli(
    *args: str | bytes, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "agent_runs", *args],
        capture_output=True,
        check=False,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def _one_line_error(proc: subprocess.CompletedProcess[bytes]) -> str:
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "args",
    [
        (b"attempts", b"\xff\xfe"),
        (b"enqueue", b"--thread", b"t\x80", b"--agent-slug", b"a", b"--uid", b"u"),
        (b"worker", b"--agent-slug", b"\xc3"),
    ],
)
def test_non_utf8_arguments_are_one_line_and_exit_2(args: tuple[bytes, ...]) -> None:
    err = _one_line_error(_cli(*args, "--dsn", "postgresql://u@127.0.0.1:1/x"))
    assert "not valid UTF-8" in err


@pytest.mark.parametrize(
    "dsn",
    [
        f"postgresql://user:{SECRET}@127.0.0.1:5432/db?sslmode=bogus-mode",
        f"host=127.0.0.1 password={SECRET} port='unterminated",
    ],
)
def test_no_dsn_password_is_echoed_on_a_bad_dsn(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["attempts", "some-run", "--dsn", dsn])
    out, err = capsys.readouterr()
    assert code in (1, 2)
    assert SECRET not in out + err


def test_an_overlong_agent_slug_makes_the_worker_exit_2_at_once(dsn: str) -> None:
    err = _one_line_error(_cli("worker", "--dsn", dsn, "--agent-slug", "x" * 65, "--no-listen"))
    assert "agent_slugs" in err


def test_a_deep_payload_is_refused_in_one_line(dsn: str) -> None:
    deep = "[" * 10_000 + "]" * 10_000
    err = _one_line_error(
        _cli(
            "enqueue",
            "--dsn",
            dsn,
            "--thread",
            "t",
            "--agent-slug",
            "a",
            "--uid",
            "u",
            "--payload",
            '{"x": ' + deep + "}",
        )
    )
    assert "payload" in err
