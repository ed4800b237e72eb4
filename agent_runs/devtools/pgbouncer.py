"""A real PgBouncer in front of a PostgreSQL: started on a free port with a config in a temporary
directory, stopped by its PID (for tests and `make bench`; the OS package provides the binary).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final
from urllib.parse import quote, urlsplit, urlunsplit

from psycopg.conninfo import conninfo_to_dict

MODES: Final = ("transaction", "session")


def pgbouncer_binary() -> str | None:
    found = shutil.which("pgbouncer")
    if found:
        return found
    return "/usr/sbin/pgbouncer" if os.access("/usr/sbin/pgbouncer", os.X_OK) else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class PgBouncer:
    port: int
    mode: str
    user: str
    log: Path

    def url_for(self, server_url: str) -> str:
        """The same database as `server_url`, through this PgBouncer."""
        dbname = urlsplit(server_url).path
        netloc = f"{quote(self.user, safe='')}@127.0.0.1:{self.port}"
        return urlunsplit(("postgresql", netloc, dbname, "", ""))


def _run_as(host: str) -> list[str]:
    """PgBouncer refuses to run as root: drop to an unprivileged user then. A server reached by
    a Unix socket is reached as the owner of the socket's directory (an embedded server keeps it
    in its private data directory); otherwise as postgres, or nobody."""
    if os.geteuid() != 0:
        return []
    if host.startswith("/"):
        owner = pwd.getpwuid(os.stat(host).st_uid).pw_name
        if owner != "root":
            return ["-u", owner]
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return ["-u", name]
    return ["-u", "nobody"]  # pragma: no cover


@contextlib.contextmanager
def pgbouncer(server_url: str, *, mode: str, pool_size: int = 2) -> Iterator[PgBouncer]:
    """PgBouncer (pool_mode `mode`, default settings otherwise) in front of `server_url`'s
    server; every database name is forwarded. Raises FileNotFoundError without the binary."""
    binary = pgbouncer_binary()
    if binary is None:
        raise FileNotFoundError("pgbouncer is not installed")
    params = {k: str(v) for k, v in conninfo_to_dict(server_url).items() if v is not None}
    user = params.get("user", "postgres")
    host = params.get("host", "127.0.0.1")
    target = f"host={host} port={params.get('port', '5432')}"
    if "password" in params:
        target += f" password={params['password']}"
    with tempfile.TemporaryDirectory(prefix="agent_runs-pgbouncer-") as tmp:
        folder = Path(tmp)
        folder.chmod(0o755)
        (folder / "users.txt").write_text(f'"{user}" ""\n')
        port = free_port()
        (folder / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = {target}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {folder / 'users.txt'}\n"
            f"pool_mode = {mode}\n"
            f"default_pool_size = {pool_size}\n"
            "max_client_conn = 500\n"
            "ignore_startup_parameters = extra_float_digits\n"
            "query_wait_timeout = 20\n"
        )
        for name in ("users.txt", "pgbouncer.ini"):
            (folder / name).chmod(0o644)
        log = folder / "pgbouncer.log"
        with log.open("wb") as sink:
            process = subprocess.Popen(
                [binary, *_run_as(host), str(folder / "pgbouncer.ini")],
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        try:
            _wait_listening(port, process, log)
            yield PgBouncer(port=port, mode=mode, user=user, log=log)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                process.kill()
                process.wait()


def _wait_listening(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pgbouncer exited: {log.read_text(errors='replace')[-2000:]}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError("pgbouncer did not start listening")
