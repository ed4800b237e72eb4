"""bench.designs: every design's floor claims oldest first and runs a lifecycle; --quick runs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from psycopg import sql

from agent_runs.migrate import apply_migrations
from bench import designs
from tests.fix_server import PgServer

LEASE = 60.0


def test_every_design_claims_oldest_first_and_runs_a_lifecycle(blank_dsn: str) -> None:
    apply_migrations(blank_dsn)
    seeders = designs.prepare(blank_dsn, replace(designs.QUICK, history=50))
    try:
        for design in designs.DESIGNS:
            conn = seeders[design.name]
            design.add_pending(conn, 3)
            design.add_pending(conn, 2)  # a later batch: claimed after the first
            client = design.make_client(conn)
            claimed: list[str] = []
            while (run_id := client.claim(f"w{len(claimed)}", LEASE)) is not None:
                claimed.append(run_id)
            assert len(claimed) == 5, design.name
            assert design.count_pending(conn) == 0, design.name
            runs = "runs" if design.tables[0].endswith(".runs") else "agent_runs"
            query = sql.SQL(
                "SELECT created_at, lpad(id::text, 40, '0') FROM {} WHERE id::text = %s"
            )
            order = []
            for run_id in claimed:
                row = conn.execute(query.format(sql.Identifier(runs)), (run_id,)).fetchone()
                assert row is not None, design.name
                order.append((row[0], row[1]))
            assert order == sorted(order), design.name

            first = claimed[0]
            assert not client.renew(first, "someone-else", LEASE), design.name
            assert client.renew(first, "w0", LEASE), design.name
            assert not client.complete(first, "someone-else"), design.name
            assert client.complete(first, "w0"), design.name
            assert not client.complete(first, "w0"), design.name
            assert not client.renew(first, "w0", LEASE), design.name
    finally:
        for conn in seeders.values():
            conn.close()


def test_quick_mode_measures_every_design(pg_server: PgServer, tmp_path: Path) -> None:
    output = tmp_path / "designs.json"
    designs.main(["--quick", "--dsn", pg_server.admin_url, "--output", str(output)])
    results = json.loads(output.read_text())["by_threads"]["1"]
    assert set(results) == {design.name for design in designs.DESIGNS}
    for name, entry in results.items():
        assert entry["lifecycles"] > 0, name
        assert not entry["ran_out_of_work"], name
    assert results["lean"]["ratio_to_lean"] == 1.0
