"""Limits per key: what a claim costs with 10,000 keys at their limit and 100,000 runs blocked
ahead of the first claimable one, beside a backlog with no limits, and beside the claim
statement without its limits parts (today's claim before limits); renewals of keyed runs.

Each claim is timed as one statement (claim_next.sql, prepared) in a transaction rolled back
after it, so every claim meets the same backlog. Targets: blocked ÷ no limits ≤ 2, unlimited
claim ÷ the claim without limits ≤ 1.1, keyed renewals HOT.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any, Final
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import psycopg
from psycopg import sql

import agent_runs
from agent_runs import AgentRunRepository
from agent_runs.sql import query

FULL: Final = {"keys": 10_000, "blocked": 100_000, "claimable": 1_000, "claims": 300}
QUICK: Final = {"keys": 200, "blocked": 2_000, "claimable": 100, "claims": 40}
LEASE_SECONDS: Final = 3600.0
RENEWALS: Final = 200

# Blocked runs (keys 0..keys-1, each key at its limit of 1 through one running run), created
# before every claimable run; then unkeyed claimable runs. Parameters: keys, blocked, claimable.
_SEED_LIMITS: Final = """
INSERT INTO agent_run_limits (concurrency_key, max_running)
SELECT 'bench-key-' || k, 1 FROM generate_series(0, %(keys)s::int - 1) AS k
"""
_SEED_RUNNING: Final = """
INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status, worker_id,
                        heartbeat_at, lease_expires_at, started_at, created_at, updated_at,
                        concurrency_key)
SELECT 'live-' || k, 'live-' || k, 'live-' || k, 'bench', 'u', 'running', 'w:' || k,
       now(), now() + interval '1 hour', now(), now() - interval '2 days', now(),
       'bench-key-' || k
FROM generate_series(0, %(keys)s::int - 1) AS k
"""
_SEED_PENDING: Final = """
INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, created_at, updated_at,
                        concurrency_key)
SELECT %(prefix)s || i, %(prefix)s || i, %(prefix)s || i, 'bench', 'u',
       now() - interval '1 day' + i * interval '1 millisecond', now(),
       CASE WHEN %(keyed)s THEN 'bench-key-' || mod(i, %(keys)s::int) END
FROM generate_series(%(first)s::int, %(last)s::int) AS i
"""


def without_limits(sql: str) -> str:
    """claim_next.sql without its limits-per-key work (admission, the anti-join): the claim as
    it was before them, on today's schema (whose claim index leaves parked runs out)."""
    lines = sql.splitlines()
    out: list[str] = []
    skipping = ""
    for line in lines:
        if skipping == "filter":
            if "l.running >= l.max_running))" in line:
                skipping = ""
            if "NOT r.key_waiting" in line:
                out.append(line)  # the claim index's predicate (schema, not the claim's work)
            continue
        if skipping == "ctes":
            if line.startswith("lease AS ("):
                skipping = ""
            else:
                continue
        if "-- limits per key: a run of a key at its limit" in line:
            skipping = "filter"
            continue
        if line.startswith("-- limits per key: the candidate's limit row"):
            skipping = "ctes"
            continue
        if "-- limits per key" in line:
            continue  # the lease's one-line filter
        out.append(line)
    stripped = "\n".join(out)
    assert "agent_run_limits" not in stripped and "over_limit" not in stripped, stripped
    return stripped


def _seed(conn: psycopg.Connection[Any], sizes: dict[str, int], *, limited: bool) -> None:
    params = {"keys": sizes["keys"], "keyed": limited}
    if limited:
        conn.execute(_SEED_LIMITS, params)
        conn.execute(_SEED_RUNNING, params)
    conn.execute(
        _SEED_PENDING, {**params, "prefix": "blocked-", "first": 1, "last": sizes["blocked"]}
    )
    first = sizes["blocked"] + 1
    conn.execute(
        _SEED_PENDING,
        {**params, "keyed": False, "prefix": "free-", "first": first,
         "last": first + sizes["claimable"] - 1},
    )  # fmt: skip
    conn.execute("VACUUM (ANALYZE) agent_runs")
    conn.execute("ANALYZE agent_run_limits")


def _claim_timer(conn: psycopg.Connection[Any], sql: str, first: str) -> Callable[[], float]:
    """Times one claim statement; its run's id must start with `first` (the claim skipped
    exactly the blocked runs, or none)."""
    params = {"now": None, "agent_slugs": None, "lease_seconds": LEASE_SECONDS,
              "lost_message": "bench"}  # fmt: skip

    def claim_once() -> float:
        params["worker_id"] = f"bench:{uuid.uuid4().hex}"
        with conn.transaction(force_rollback=True):
            started = time.perf_counter()
            row = conn.execute(sql, params, prepare=True).fetchone()
            elapsed = time.perf_counter() - started
        assert row is not None and str(row[0]).startswith(first), row
        return elapsed

    return claim_once


def _p50_ms(timers: dict[str, Callable[[], float]], claims: int) -> dict[str, float]:
    """Each timer's median over `claims` calls, the timers interleaved call by call, their
    order reversed each round."""
    for timer in timers.values():  # warm-up: prepare, caches
        for _ in range(10):
            timer()
    taken: dict[str, list[float]] = {name: [] for name in timers}
    order = list(timers)
    for _ in range(claims):
        order.reverse()  # no timer always runs right after another one
        for name in order:
            taken[name].append(timers[name]())
    return {name: statistics.median(values) * 1000 for name, values in taken.items()}


def _renewals_hot(url: str) -> float:
    with agent_runs.connect(url) as conn:
        repo = AgentRunRepository(conn)
        repo.set_limit("bench-renew", 5)
        run = repo.create_run(thread_id="renew", agent_slug="bench", uid="u",
                              request_id=f"renew-{uuid.uuid4().hex}",
                              concurrency_key="bench-renew")  # fmt: skip
        claimed = repo.mark_running(run.id, worker_id="renewer", lease_seconds=LEASE_SECONDS)
        assert claimed.acquired
        with conn.transaction(force_rollback=True):
            before = conn.execute(
                "SELECT pg_stat_get_xact_tuples_updated('agent_runs'::regclass),"
                " pg_stat_get_xact_tuples_hot_updated('agent_runs'::regclass)"
            ).fetchone()
            for _ in range(RENEWALS):
                repo.renew_lease(run.id, worker_id="renewer", lease_seconds=LEASE_SECONDS)
            after = conn.execute(
                "SELECT pg_stat_get_xact_tuples_updated('agent_runs'::regclass),"
                " pg_stat_get_xact_tuples_hot_updated('agent_runs'::regclass)"
            ).fetchone()
        assert before is not None and after is not None
        return float(after[1] - before[1]) / max(1, int(after[0] - before[0]))


def run_phase(url: str, quick: bool) -> dict[str, Any]:
    sizes = QUICK if quick else FULL
    current, today = query("claim_next"), without_limits(query("claim_next"))
    # The database's name from the URL's path: an embedded server's URL carries its socket
    # directory (slashes included) in the query string.
    parts = urlsplit(url)
    name = unquote(parts.path.lstrip("/"))
    other_name = f"{name}_nolimits"
    other = urlunsplit(parts._replace(path="/" + quote(other_name, safe="")))
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(other_name)))
        admin.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(other_name), sql.Identifier(name)
            )
        )
    try:
        with agent_runs.connect(url) as limited, agent_runs.connect(other) as plain:
            _seed(limited, sizes, limited=True)
            _seed(plain, sizes, limited=False)
            p50 = _p50_ms(
                {
                    "blocked": _claim_timer(limited, current, "free-"),
                    "no_limits": _claim_timer(plain, current, "blocked-"),
                    "without_limits_sql": _claim_timer(plain, today, "blocked-"),
                },
                sizes["claims"],
            )
    finally:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(other_name)
                )
            )
    return {
        **sizes,
        "p50_ms": p50,
        "blocked_over_no_limits": p50["blocked"] / p50["no_limits"],
        "unlimited_over_without_limits_sql": p50["no_limits"] / p50["without_limits_sql"],
        "keyed_renewals_hot_ratio": _renewals_hot(url),
    }


def render_phase(result: dict[str, Any]) -> list[str]:
    p50 = result["p50_ms"]
    return [
        f"limits per key: claim_next p50 with {result['keys']:,} keys at their limit and "
        f"{result['blocked']:,} runs blocked ahead of the first claimable one:",
        f"  blocked backlog            {p50['blocked']:8.3f} ms",
        f"  same backlog, no limits    {p50['no_limits']:8.3f} ms"
        f"  (blocked ÷ this: x{result['blocked_over_no_limits']:.2f})",
        f"  claim without limits' SQL  {p50['without_limits_sql']:8.3f} ms"
        f"  (unlimited ÷ this: x{result['unlimited_over_without_limits_sql']:.2f})",
        f"  keyed renewals HOT: {result['keyed_renewals_hot_ratio']:.0%}",
    ]
