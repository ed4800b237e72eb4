"""Never over-admitted: 3 processes of 8 threads (and a reconciler each) over 50 limited keys,
with releases, cancels and crashed owners, through every claim path.

Three checks, each able to fail on its own:
- every counted transition of a keyed run is logged by a test trigger that fires after the
  counter's (so under the key row's lock, in commit order): replayed per key, the count never
  exceeds the limit;
- the attempt intervals: at no instant do more attempts of a key overlap than its limit
  (an attempt's times are its statements' clock, taken before the lock waits: an overlap
  shorter than CLOCK_SLACK is that, not an admission);
- a sampler reads the live runs per key in one snapshot every few milliseconds.
At the end every run is terminal and every counter is back to 0.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

import psycopg

from agent_runs import AgentRunRepository

Conn = psycopg.Connection[Any]
KEYS = 50
RUNS_PER_KEY = 6
UNKEYED = 60
PROCESSES = 3
SECONDS = 90.0
CLOCK_SLACK = timedelta(milliseconds=100)

LOG_DDL = """
CREATE TABLE limits_log (seq bigserial PRIMARY KEY, key text, delta int);
CREATE FUNCTION limits_log() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    was boolean := TG_OP <> 'INSERT' AND (OLD.status = 'running'
        OR (OLD.status = 'cancel_requested' AND OLD.worker_id IS NOT NULL));
    now_counted boolean := TG_OP <> 'DELETE' AND (NEW.status = 'running'
        OR (NEW.status = 'cancel_requested' AND NEW.worker_id IS NOT NULL));
BEGIN
    IF was AND NOT now_counted THEN
        INSERT INTO limits_log (key, delta) VALUES (OLD.concurrency_key, -1);
    ELSIF now_counted AND NOT was THEN
        INSERT INTO limits_log (key, delta) VALUES (NEW.concurrency_key, 1);
    END IF;
    RETURN NULL;
END $$;
-- Named to fire after agent_run_limits_count_update (triggers fire in name order).
CREATE TRIGGER zz_limits_log AFTER UPDATE ON agent_runs FOR EACH ROW
    WHEN (NEW.concurrency_key IS NOT NULL) EXECUTE FUNCTION limits_log();
"""


def _limit_of(index: int) -> int:
    return 1 + index % 3


def _sample(dsn: str, stop: threading.Event, seen: list[tuple[str, int, int]]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.wait(0.005):
            seen.extend(
                conn.execute(
                    "SELECT r.concurrency_key, count(*)::int, l.max_running"
                    " FROM agent_runs r JOIN agent_run_limits l USING (concurrency_key)"
                    " WHERE r.status = 'running'"
                    "    OR (r.status = 'cancel_requested' AND r.worker_id IS NOT NULL)"
                    " GROUP BY r.concurrency_key, l.max_running"
                    " HAVING count(*) > l.max_running"
                ).fetchall()
            )


def _most_overlapping(intervals: list[tuple[datetime, datetime]]) -> int:
    """The most intervals open at once, each shortened at its start by CLOCK_SLACK."""
    events = [(start + CLOCK_SLACK, 1) for start, end in intervals if end > start + CLOCK_SLACK]
    events += [(end, -1) for start, end in intervals if end > start + CLOCK_SLACK]
    open_now = most = 0
    for _, delta in sorted(events):  # at a tie, an end (-1) comes before a start
        open_now += delta
        most = max(most, open_now)
    return most


def test_no_key_is_ever_over_admitted_by_concurrent_processes(
    dsn: str, repo: AgentRunRepository, observer: Conn
) -> None:
    observer.execute(LOG_DDL)
    for k in range(KEYS):
        repo.set_limit(f"key-{k}", _limit_of(k))
    items = [
        {"thread_id": f"t-{k}-{n}", "agent_slug": f"agent-{n % 3}", "uid": "u",
         "request_id": f"r-{k}-{n}", "concurrency_key": f"key-{k}"}
        for n in range(RUNS_PER_KEY) for k in range(KEYS)
    ] + [
        {"thread_id": f"free-{n}", "agent_slug": "agent-0", "uid": "u", "request_id": f"f-{n}"}
        for n in range(UNKEYED)
    ]  # fmt: skip
    repo.create_runs(items)

    stop, over = threading.Event(), list[tuple[str, int, int]]()
    sampler = threading.Thread(target=_sample, args=(dsn, stop, over))
    sampler.start()
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.limits_churn", dsn, str(p), str(SECONDS)],
                stderr=subprocess.PIPE,
                text=True,
            )
            for p in range(PROCESSES)
        ]
        outcomes = [(proc.communicate(timeout=SECONDS + 60)[1], proc.returncode) for proc in procs]
    finally:
        stop.set()
        sampler.join()
    for err, code in outcomes:
        assert code == 0, err

    assert over == [], f"a snapshot saw a key over its limit: {over[:5]}"
    active = observer.execute(
        "SELECT count(*) FROM agent_runs WHERE status IN ('pending', 'running', 'cancel_requested')"
    ).fetchone()
    assert active == (0,), "runs left active: something stalled"
    assert {x.running for x in repo.list_limits()} == {0}

    replay: dict[str, int] = defaultdict(int)
    most: dict[str, int] = defaultdict(int)
    for key, delta in observer.execute("SELECT key, delta FROM limits_log ORDER BY seq"):
        replay[key] += delta
        most[key] = max(most[key], replay[key])
    assert len(most) == KEYS and all(v == 0 for v in replay.values())
    assert {k: v for k, v in most.items() if v > _limit_of(int(k[4:]))} == {}
    assert sum(most.values()) > KEYS, "the keys were never busy: no race was tested"

    intervals: dict[str, list[tuple[datetime, datetime]]] = defaultdict(list)
    for key, started, finished in observer.execute(
        "SELECT r.concurrency_key, a.started_at, a.finished_at FROM agent_run_attempts a"
        " JOIN agent_runs r ON r.id = a.run_id WHERE r.concurrency_key IS NOT NULL"
    ):
        intervals[key].append((started, finished))
    outcomes_seen = observer.execute(
        "SELECT DISTINCT outcome FROM agent_run_attempts ORDER BY 1"
    ).fetchall()
    assert {o for (o,) in outcomes_seen} >= {"completed", "cancelled", "retry_released",
                                               "lease_expired"}  # fmt: skip
    for key, spans in intervals.items():
        assert _most_overlapping(spans) <= _limit_of(int(key[4:])), key
