"""One process of the limits stress test: 8 threads claim, finish, release, cancel and abandon
("crash") runs through every claim path, beside a reconciler thread, until no run is left
active or the deadline passes.

Run as `python -m tests.limits_churn DSN SEED SECONDS`; exits 0, or 1 with the first error.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import uuid
from typing import Final

import agent_runs
from agent_runs import AgentRun, AgentRunRepository, Finish

THREADS: Final = 8
LEASE: Final = 1.0  # an abandoned run's lease expires fast; the reconciler converges it


def _active(repo: AgentRunRepository) -> int:
    row = repo.conn.execute(
        "SELECT count(*) FROM agent_runs WHERE status IN ('pending', 'running', 'cancel_requested')"
    ).fetchone()
    return 0 if row is None else int(row[0])


def _claim(repo: AgentRunRepository, rng: random.Random, name: str) -> list[AgentRun]:
    owner = f"{name}:{uuid.uuid4().hex}"
    path = rng.random()
    if path < 0.4:
        run = repo.claim_next(worker_id=owner, lease_seconds=LEASE)
        return [] if run is None else [run]
    if path < 0.75:
        owners = [owner, f"{name}:{uuid.uuid4().hex}"]
        return [c.run for c in repo.claim_next_attempts(worker_ids=owners, lease_seconds=LEASE)]
    row = repo.conn.execute(
        "SELECT id FROM agent_runs WHERE status = 'pending' ORDER BY random() LIMIT 1"
    ).fetchone()
    if row is None:
        return []
    run, acquired = repo.mark_running(row[0], worker_id=owner, lease_seconds=LEASE)
    return [run] if acquired and run is not None else []


def _end(repo: AgentRunRepository, rng: random.Random, name: str, run: AgentRun) -> list[AgentRun]:
    """End `run` one of five ways; returns the runs a finish-and-claim took next."""
    owner = run.worker_id
    assert owner is not None
    time.sleep(rng.uniform(0.005, 0.04))
    fate = rng.random()
    if fate < 0.3:
        repo.set_terminal_status(run.id, status="completed", worker_id=owner)
    elif fate < 0.6:
        _, claimed = repo.finish_runs_and_claim(
            [Finish(run.id, owner, "completed")],
            worker_ids=[f"{name}:{uuid.uuid4().hex}"],
            lease_seconds=LEASE,
        )
        return [c.run for c in claimed]
    elif fate < 0.75:
        repo.release_lease_for_retry(run.id, worker_id=owner)
    elif fate < 0.85:
        repo.request_cancel(run.id)
        repo.set_terminal_status(run.id, status="cancelled", worker_id=owner)
    # else: a crash, the run abandoned with its lease: the reconciler converges it
    return []


def _worker(dsn: str, seed: int, name: str, deadline: float, errors: list[BaseException]) -> None:
    rng = random.Random(seed)
    try:
        with agent_runs.connect(dsn) as conn:
            repo = AgentRunRepository(conn)
            held: list[AgentRun] = []
            while time.monotonic() < deadline:
                if not held:
                    held = _claim(repo, rng, name)
                if not held:
                    if _active(repo) == 0:
                        return
                    time.sleep(0.01)
                    continue
                run = held.pop()
                held.extend(_end(repo, rng, name, run))
    except BaseException as exc:  # reported by the process's exit code
        errors.append(exc)


def _reconciler(dsn: str, stop: threading.Event, errors: list[BaseException]) -> None:
    try:
        with agent_runs.connect(dsn) as conn:
            repo = AgentRunRepository(conn)
            while not stop.wait(0.1):
                repo.reconcile_expired_leases()
    except BaseException as exc:
        errors.append(exc)


def main(dsn: str, seed: int, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    errors: list[BaseException] = []
    stop = threading.Event()
    reconciler = threading.Thread(target=_reconciler, args=(dsn, stop, errors))
    reconciler.start()
    threads = [
        threading.Thread(
            target=_worker, args=(dsn, seed * 100 + i, f"p{seed}t{i}", deadline, errors)
        )
        for i in range(THREADS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    reconciler.join()
    if errors:
        print(f"{type(errors[0]).__name__}: {errors[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
