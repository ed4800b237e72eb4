"""The throwaway PostgreSQL of the tests: one migrated template per session, a clone per test.

Fixtures live in plugin modules, one concern each; helpers that are not fixtures live in
`tests/helpers.py`. Test modules import from those, never from this file.
"""

from __future__ import annotations

pytest_plugins = [
    "tests.fix_server",  # which PostgreSQL server: pg_server
    "tests.fix_databases",  # a database per test: dsn, blank_dsn, conn, observer, repo
    "tests.fix_factories",  # rows forged in any state: make_run, make_attempt, t0
    "tests.fix_dashboard",  # the web dashboard: dashboard_pool, client
]
