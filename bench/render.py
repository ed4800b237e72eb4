"""What `make bench` prints and checks: the targets, then the tables of every phase."""

from __future__ import annotations

from typing import Any, Final

from bench import deployment
from bench.deployment import deployment_targets
from bench.report import Target, fmt, table
from bench.settings import TARGET_THREADS
from bench.wal_summary import render_wal, wal_targets
from bench.workload import TRANSITIONS


def targets(results: dict[str, Any]) -> list[Target]:
    hot = results["heartbeats"]["repository"]["hot_ratio"]
    return [
        *throughput_targets(results["throughput"]),
        *wal_targets(results),
        Target("HOT lease renewals on agent_runs", hot["agent_runs"], 0.90, True, "%"),
        Target(
            "HOT lease renewals on agent_run_attempts", hot["agent_run_attempts"], 0.99, True, "%"
        ),
        Target(
            "claim_next p50 latency, large ÷ small backlog",
            results["claim_scaling"]["ratio_p50"],
            1.3,
            at_least=False,
            unit="x",
        ),
        *deployment_targets(results),
    ]


# Targets: the repository at its floor at every thread count, and the
# schema's own cost (the same statements on the project's schema ÷ on the lean one).
REPOSITORY_OVER_FLOOR: Final = 0.9
FLOOR_OVER_LEAN: Final = 0.75
FLOOR_OVER_LEAN_THREADS: Final = ("1", str(TARGET_THREADS))


def throughput_targets(throughput: dict[str, Any]) -> list[Target]:
    found = [
        Target(
            f"repository ÷ floor lifecycles/s at {threads} threads",
            entry["ratio"],
            REPOSITORY_OVER_FLOOR,
            at_least=True,
            unit="x",
        )
        for threads, entry in throughput.items()
    ]
    for threads in FLOOR_OVER_LEAN_THREADS:
        entry = throughput.get(threads)
        if entry is None:
            continue
        ratio = entry["floor"]["lifecycles_per_second"] / entry["lean"]["lifecycles_per_second"]
        found.append(
            Target(
                f"same-schema floor ÷ lean floor lifecycles/s at {threads} threads",
                ratio,
                FLOOR_OVER_LEAN,
                at_least=True,
                unit="x",
            )
        )
    return found


def render(payload: dict[str, Any]) -> str:
    r = payload["results"]
    s = payload["settings"]
    env = payload["environment"]
    out: list[str] = []
    out.append(
        f"agent_runs benchmark — PostgreSQL {env['server_version']} ({env['server']}), "
        f"{env['cpu_count']} cores, Python {env['python']}, psycopg {env['psycopg']}"
        + ("  [QUICK: smoke sizes, not a measurement]" if s["quick"] else "")
    )
    out.append(
        f"history: {s['history']:,} finished runs with attempts; {s['reps']} repetitions × "
        f"{s['seconds']:g} s per variant in {s['slices']} alternating slices; load "
        f"average before {env['load_before']}, after {env['load_after']}"
    )

    out.append("\nLifecycles/s (claim_next → 3 × renew_lease → set_terminal_status), medians")
    rows = []
    for threads, e in r["throughput"].items():
        rep, flo, ftx = e["repository"], e["floor"], e["floor_tx"]
        rows.append(
            [
                threads,
                fmt(rep["lifecycles_per_second"]),
                fmt(flo["lifecycles_per_second"]),
                f"{e['ratio']:.2f}",
                f"{e['lean_calls_ratio']:.2f}",
                fmt(ftx["lifecycles_per_second"]),
                f"{e['explicit_transaction_ratio']:.2f}",
                fmt(rep["wal_bytes_per_lifecycle"]),
                fmt(flo["wal_bytes_per_lifecycle"]),
            ]
        )
    out.append(
        table(
            [
                "threads",
                "repository",
                "floor",
                "repo÷floor",
                "worker calls÷floor**",
                "floor in tx*",
                "tx÷floor",
                "WAL B/lc repo",
                "WAL B/lc floor",
            ],
            rows,
        )
    )
    out.append(
        "  * diagnostic: the floor's own statements, each in its BEGIN … COMMIT over the"
        " repository's transport: what the explicit transaction per transition costs alone"
    )
    out.append(
        "  ** the repository's calls as its worker makes them: claim_next_attempt,"
        " renew_lease, finish_runs of one run"
    )
    if "wal" in r:
        out.extend(render_wal(r["wal"], r["throughput"]))

    out.append("\nLatency per transition, ms (all repetitions pooled)")
    rows = []
    for threads, e in r["throughput"].items():
        for name in TRANSITIONS:
            rl, fl = e["repository"]["latency_ms"][name], e["floor"]["latency_ms"][name]
            rows.append(
                [
                    f"{threads:>2} thr  {name}",
                    f"{rl['p50']:.2f}",
                    f"{rl['p99']:.2f}",
                    f"{fl['p50']:.2f}",
                    f"{fl['p99']:.2f}",
                ]
            )
    out.append(table(["", "repo p50", "repo p99", "floor p50", "floor p99"], rows))

    out.append(
        "\nSQL statements per call (libpq protocol trace: statements executed / messages sent"
        " / round trips)"
    )
    rows = []
    st = r["statements"]
    labels = {
        "claim": "claim_next",
        "renew": "renew_lease",
        "complete": "set_terminal_status",
    }

    def counts(c: dict[str, Any]) -> str:
        return f"{c['statements']} / {c['messages']} / {c['round_trips']}"

    for name in TRANSITIONS:
        rc, fc = st["repository"][name], st["floor"][name]
        lc = counts(st["lean"][name]) if "lean" in st else "-"
        rows.append([labels[name], counts(rc), " + ".join(rc["commands"]), counts(fc), lc])
    for name, c in st["repository_batches"].items():
        rows.append([name, counts(c), " + ".join(c["commands"]), "-", "-"])
    out.append(table(["call", "repository", "statements", "floor", "lean floor"], rows))

    out.append(
        f"\nLease renewals only ({s['heartbeat_threads']} threads × {s['held_per_thread']} "
        f"held runs × {s['heartbeat_rounds']} rounds): HOT share of updates, medians"
    )
    hb = r["heartbeats"]
    rows = []
    for table_name in hb["repository"]["hot_ratio"]:
        rows.append(
            [
                table_name,
                fmt(hb["repository"]["hot_ratio"][table_name], "%"),
                fmt(hb["floor"]["hot_ratio"][table_name], "%"),
            ]
        )
    rows.append(
        [
            "WAL bytes per renewal",
            fmt(hb["repository"]["wal_bytes_per_renewal"]),
            fmt(hb["floor"]["wal_bytes_per_renewal"]),
        ]
    )
    rows.append(
        [
            "renewals/s",
            fmt(hb["repository"]["renewals_per_second"]),
            fmt(hb["floor"]["renewals_per_second"]),
        ]
    )
    out.append(table(["", "repository", "floor"], rows))

    out.append("\nrenew_leases (one connection, all held leases renewed in batches)")
    rows = [
        [
            str(b["batch"]),
            fmt(b["calls_per_second"]),
            fmt(b["renewals_per_second"]),
            f"{b['call_p50_ms']:.2f}",
        ]
        for b in r["renew_leases"]
    ]
    out.append(table(["batch", "calls/s", "renewals/s", "call p50 ms"], rows))

    rc = r["reconcile"]
    out.append(
        f"\nReconciler: {rc['expired_leases']:,} expired leases in {rc['batches']} batches of "
        f"≤ {rc['limit']}: {fmt(rc['runs_per_second'])} runs/s, longest batch "
        f"{rc['longest_batch_ms']:.0f} ms (median {rc['median_batch_ms']:.0f} ms)"
    )

    cs = r["claim_scaling"]
    out.append("\nclaim_next latency as backlog and history grow (interleaved, ms)")
    rows = [
        [
            f"{cs[n]['pending']:,} pending + {cs[n]['finished']:,} finished",
            f"{cs[n]['p50_ms']:.2f}",
            f"{cs[n]['p99_ms']:.2f}",
            str(cs[n]["claims"]),
        ]
        for n in ("small", "large")
    ]
    rows.append(["ratio large ÷ small", f"{cs['ratio_p50']:.2f}", f"{cs['ratio_p99']:.2f}", ""])
    out.append(table(["backlog", "p50", "p99", "claims"], rows))

    out.append("\nTargets (medians of the repetitions; the hot path's, then deployment)")
    out.extend(Target(**_target_args(t)).line() for t in payload["targets"])
    at4 = r["throughput"].get(str(TARGET_THREADS))
    if at4 is not None:
        out.append(
            f"  info  the floor's own statements in explicit transactions reach "
            f"{at4['explicit_transaction_ratio']:.2f} of the floor at {TARGET_THREADS} threads: "
            "the most a BEGIN … COMMIT per transition allows here"
        )
        out.append(
            f"  info  the repository's calls as its worker makes them reach "
            f"{at4['lean_calls_ratio']:.2f} of the floor at {TARGET_THREADS} threads"
        )
    out.extend(deployment.render_phases(r))
    return "\n".join(out)


def _target_args(t: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": t["name"],
        "value": t["value"],
        "threshold": t["threshold"],
        "at_least": t["comparison"] == ">=",
        "unit": t["unit"],
    }
