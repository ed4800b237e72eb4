"""The phases about deployment and operation, each on a fresh database, and their targets."""

from __future__ import annotations

import math
from typing import Any, Final

from bench import (
    aio_phase,
    dashboard_phase,
    drain_phase,
    fanout_phase,
    heartbeat_scale_phase,
    langgraph_phase,
    limits_phase,
    operator_phase,
    pickup_phase,
    pooler_phase,
)
from bench.report import Target, log
from bench.server import BenchServer

# Phases about deployment and operation, each on a fresh database: pickup latency and idle load
# (wake-ups), the operator's queries at scale, the repository through PgBouncer, the asyncio
# repository beside the sync one, heartbeats of 10,000 live leases, and the drain rate of one
# worker process, and what a checkpointed LangGraph step costs next to an attempt.
DEPLOYMENT_PHASES: Final = (
    ("pickup", pickup_phase),
    ("operator", operator_phase),
    ("dashboard", dashboard_phase),
    ("pooler", pooler_phase),
    ("aio", aio_phase),
    ("heartbeat_scale", heartbeat_scale_phase),
    ("drain", drain_phase),
    ("fanout", fanout_phase),
    ("langgraph", langgraph_phase),
    ("limits", limits_phase),
)


def run_phases(server: BenchServer, quick: bool) -> dict[str, Any]:
    """Every deployment phase on its own fresh database; a phase that fails is left out."""
    results: dict[str, Any] = {}
    for key, module in DEPLOYMENT_PHASES:
        log(f"{key}: {module.__doc__.splitlines()[0] if module.__doc__ else key}")
        phase_url = server.fresh_database(key)
        try:
            results[key] = module.run_phase(phase_url, quick)
        except Exception as exc:  # one deployment phase failing keeps the other results
            log(f"{key}: failed ({type(exc).__name__}: {exc}); phase left out")
        finally:
            server.drop(phase_url)
    return results


def render_phases(r: dict[str, Any]) -> list[str]:
    """The deployment phases' own sections of the report, each after a blank line."""
    out: list[str] = []
    for key, module in DEPLOYMENT_PHASES:
        if key in r:
            out.append("")
            out.extend(module.render_phase(r[key]))
    return out


def deployment_targets(results: dict[str, Any]) -> list[Target]:
    """Pickup latency and idle load (wake-ups), the operator's queries at scale."""
    found: list[Target] = []
    pickup = results.get("pickup", {})
    if "idle" in pickup:
        found.append(
            Target("pickup p50, idle workers", pickup["idle"]["p50_ms"], 2.0, False, " ms")
        )
        found.append(
            Target("pickup p99, idle workers", pickup["idle"]["p99_ms"], 10.0, False, " ms")
        )
    if "idle_load" in pickup:
        load = pickup["idle_load"]["round_trips_per_s"]
        found.append(Target("idle worker process, round trips/s", load, 0.4, False, "/s"))
    limits = results.get("limits", {})
    if "blocked_over_no_limits" in limits:
        found.append(
            Target(
                "claim with the runs of full keys ahead ÷ with no limits, p50",
                limits["blocked_over_no_limits"],
                2.0,
                False,
                "x",
            )
        )
        found.append(
            Target(
                "claim of an unlimited run ÷ the claim without limits per key, p50",
                limits["unlimited_over_without_limits_sql"],
                1.1,
                False,
                "x",
            )
        )
        found.append(
            Target(
                "HOT lease renewals of keyed runs",
                limits["keyed_renewals_hot_ratio"],
                0.9,
                True,
                "%",
            )
        )
    operator = results.get("operator", {})
    for name, timing in operator.get("listings", {}).items():
        found.append(Target(f"runs listing by {name}, p50", timing["p50_ms"], 20.0, False, " ms"))
    if "stats_1h" in operator:
        found.append(
            Target("stats --since 1h, p50", operator["stats_1h"]["p50_ms"], 200.0, False, " ms")
        )
    if "prune" in operator:
        prune = operator["prune"]
        found.append(Target("prune rate", prune["runs_per_s"], 5000.0, True, " runs/s"))
        found.append(Target("longest prune batch", prune["longest_batch_ms"], 500.0, False, " ms"))
        during = operator["claims_during_prune"]["p50_ms"]
        ratio = during / operator["claims_before_prune"]["p50_ms"]
        found.append(Target("claim_next p50 during a prune ÷ before", ratio, 1.5, False, "x"))
    drain = results.get("drain", {})
    if "ratios" in drain:
        nan = math.nan
        for key, label, threshold in (
            ("durable_over_pgqueuer", "durable", 0.8),
            ("async_over_pgqueuer", "async completion", 1.0),
            ("cli_durable_over_pgqueuer", "as a user runs it, durable", 0.75),
            ("cli_async_over_pgqueuer", "as a user runs it, async completion", 0.9),
        ):
            found.append(
                Target(
                    f"drain, agent-runs worker ({label}) ÷ PgQueuer jobs/s",
                    drain["ratios"].get(key, nan),
                    threshold,
                    True,
                    "x",
                )
            )
    durable = drain.get("queues", {}).get("agent_runs_durable", {})
    if durable.get("worker_cpu_us_per_job") is not None:
        found.append(
            Target(
                "drain, agent-runs worker process CPU per job (durable)",
                durable["worker_cpu_us_per_job"],
                80.0,
                False,
                " µs",
            )
        )
    beats = results.get("heartbeat_scale", {})
    if "batch_over_single" in beats:
        found.append(
            Target(
                "renew_leases batch 100 ÷ single renewals/s",
                beats["batch_over_single"],
                20.0,
                True,
                "x",
            )
        )
    return found
