"""`python -m chaos` (`make chaos CHAOS_ARGS=...`): the fault-injection suite.

Always on its own embedded PostgreSQL (DATABASE_URL is ignored: the suite restarts the server,
and it only ever does that to a server it started). Exit 0 when every invariant holds, 1 when
one does not (the violating run ids are listed), 2 on bad usage, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import NoReturn

from chaos.options import Options
from chaos.report import render
from chaos.scenario import make_plan
from chaos.suite import run_chaos


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number: {text!r}")
    return value


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m chaos",
        description="Drive real workers against an embedded PostgreSQL while killing workers, "
        "dropping their connections and restarting the server; then check the invariants.",
    )
    p.add_argument("--seed", type=int, default=None, help="plan seed (default: random, printed)")
    p.add_argument("--runs", type=_count, default=300, help="scripted runs (default 300)")
    p.add_argument("--workers", type=_count, default=4, help="worker processes (default 4)")
    p.add_argument("--concurrency", type=_count, default=2, help="threads per worker (default 2)")
    p.add_argument("--lease-seconds", type=_positive_float, default=4.0, help="default 4")
    p.add_argument("--heartbeat-seconds", type=_positive_float, default=None, help="lease / 3")
    p.add_argument("--max-tries", type=_count, default=3, help="default 3")
    p.add_argument("--poll-seconds", type=_positive_float, default=0.25, help="default 0.25")
    p.add_argument(
        "--completion",
        choices=("durable", "async"),
        default="durable",
        help="how workers write a run's end (default durable)",
    )
    p.add_argument(
        "--duration", type=_positive_float, default=60.0, help="fault phase seconds (default 60)"
    )
    p.add_argument(
        "--drain-seconds",
        type=_positive_float,
        default=120.0,
        help="bounded wait for every run to be terminal after the faults (default 120)",
    )
    p.add_argument(
        "--deadline",
        type=_positive_float,
        default=210.0,
        help="hard bound on the faults and the drain together, in seconds (default 210)",
    )
    p.add_argument("--terminations", type=_count, default=24, help="pg_terminate_backend (24)")
    p.add_argument("--kills", type=_count, default=6, help="SIGKILLs of busy workers (default 6)")
    p.add_argument("--restarts", type=_count, default=1, help="PostgreSQL restarts (default 1)")
    p.add_argument(
        "--restart-downtime",
        type=_nonnegative_float,
        default=1.0,
        help="seconds the server stays down (default 1: stop, wait, start); 0: pg_ctl restart",
    )
    p.add_argument(
        "--max-lost-leases",
        type=int,
        default=2,
        help="the scripted agent's policy: lost leases retried (default 2; 0: none)",
    )
    p.add_argument(
        "--backoff",
        type=_nonnegative_float,
        default=0.5,
        help="the policy's first back-off delay, seconds (default 0.5; 0: none)",
    )
    p.add_argument("--keep-logs", action="store_true", help="keep worker logs even on success")
    p.add_argument("--quiet", action="store_true", help="no progress lines, only the summary")
    return p


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """First SIGINT/SIGTERM: unwind (every `finally` stops what it started). Later ones are
    ignored so that the clean-up itself is not cut short."""
    signal.signal(signal.SIGINT, _already_stopping)
    signal.signal(signal.SIGTERM, _already_stopping)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _already_stopping(signum: int, frame: FrameType | None) -> None:
    print("chaos: already stopping every process and the server...", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    print(
        f"chaos: seed {seed}  (reproduce: make chaos CHAOS_ARGS='--seed {seed}')",
        flush=True,
    )
    heartbeat = args.heartbeat_seconds or args.lease_seconds / 3
    if heartbeat >= args.lease_seconds:
        print("python -m chaos: error: --heartbeat-seconds must be < --lease-seconds", flush=True)
        return 2
    if args.max_lost_leases < 0:
        print("python -m chaos: error: --max-lost-leases must be >= 0", flush=True)
        return 2
    if args.runs < 9 or args.workers < 1 or args.concurrency < 1 or args.max_tries < 1:
        print("python -m chaos: error: need >= 9 runs, >= 1 worker, concurrency and tries")
        return 2
    if os.environ.get("DATABASE_URL"):
        print("chaos: DATABASE_URL is ignored: this suite restarts PostgreSQL, so it only runs on")
        print("       an embedded server it starts (and stops) itself")
    options = Options(
        seed=seed,
        runs=args.runs,
        workers=args.workers,
        concurrency=args.concurrency,
        lease_seconds=args.lease_seconds,
        heartbeat_seconds=heartbeat,
        max_tries=args.max_tries,
        poll_seconds=args.poll_seconds,
        completion=args.completion,
        duration=args.duration,
        drain_seconds=args.drain_seconds,
        deadline=args.deadline,
        terminations=args.terminations,
        kills=args.kills,
        restarts=args.restarts,
        restart_downtime=args.restart_downtime,
        keep_logs=args.keep_logs,
        quiet=args.quiet,
        max_lost_leases=args.max_lost_leases,
        backoff_seconds=args.backoff,
    )
    plan = make_plan(
        seed,
        runs=args.runs,
        duration=args.duration,
        terminations=args.terminations,
        kills=args.kills,
        restarts=args.restarts,
    )
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(plan.kind_counts().items()))
    faults = ", ".join(f"{k} {v}" for k, v in sorted(plan.fault_counts().items()))
    print(f"chaos: plan: {len(plan.runs)} runs ({kinds}); faults: {faults}", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)  # also when started with SIGINT ignored
    started = time.monotonic()
    try:
        summary = run_chaos(options, plan)
    except KeyboardInterrupt:
        print(
            f"\nchaos: interrupted after {time.monotonic() - started:.1f}s; every process and "
            f"the embedded server were stopped (seed {seed})",
            file=sys.stderr,
        )
        return 130
    print(render(summary), flush=True)
    return 0 if summary.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
