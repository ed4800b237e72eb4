"""`agent-runs demo --langgraph`: a LangGraph agent's worker process crashes mid-graph; another
process resumes the run from its last checkpoint; then the attempt history and each step's side
effects (done once) are shown.

The graph has five steps; each records its side effect in `demo_langgraph_steps`. On the run's
first attempt the worker process dies (`os._exit(137)`, like a killed process) as the third step
starts. A recovery policy that allows one lost lease puts the run back to pending; the next
worker process resumes at the checkpoint of step 2. Without a DSN it runs on an embedded
PostgreSQL in a temporary directory.
"""

from __future__ import annotations

import operator
import os
import sys
import time
import uuid
from contextlib import ExitStack
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph

from agent_runs.db import connect
from agent_runs.devtools.worker_demo import Children, demo_database, sigterm_as_interrupt
from agent_runs.explain import explain_run
from agent_runs.langgraph import LangGraphAgent, run_context, setup
from agent_runs.report import render_history
from agent_runs.repository import AgentRunRepository

STEPS = ("research", "outline", "draft", "review", "publish")
CRASH_AT = "draft"
STEP_SECONDS = 0.3
TABLE_DDL = """
CREATE TABLE IF NOT EXISTS demo_langgraph_steps (
    run_id text NOT NULL, step text NOT NULL, attempt integer NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp())
"""


class Article(TypedDict, total=False):
    topic: str
    done: Annotated[list[str], operator.add]


def _step(name: str) -> Any:
    def node(state: Article) -> dict[str, Any]:
        ctx = run_context()
        if name == CRASH_AT and ctx.attempt_no == 1:
            print(f"[worker] {name}: the process dies now (attempt 1)", file=sys.stderr)
            os._exit(137)
        ctx.wait(STEP_SECONDS)  # the step's work (a model call, a tool)
        with ctx.pool.connection() as conn:
            conn.execute(
                "INSERT INTO demo_langgraph_steps (run_id, step, attempt) VALUES (%s, %s, %s)",
                (ctx.run_id, name, ctx.attempt_no),
            )
        return {"done": [name]}

    return node


def _graph() -> StateGraph[Any]:
    graph = StateGraph(Article)
    for name in STEPS:
        graph.add_node(name, _step(name))
    for before, after in zip((START, *STEPS), (*STEPS, END), strict=True):
        graph.add_edge(before, after)
    return graph


agent = LangGraphAgent(_graph())


def run_langgraph_demo(
    dsn: str | None, *, lease_seconds: float = 2.0, timeout: float = 60.0
) -> int:
    """Run the demo; 0 when the run completed with each step's side effect done once."""
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:5.1f}s] {message}", flush=True)

    with ExitStack() as stack:
        stack.enter_context(sigterm_as_interrupt())
        dsn = demo_database(stack, dsn, say, prefix="agent_runs-lgdemo-")
        setup(dsn)
        conn = stack.enter_context(connect(dsn))
        conn.execute(TABLE_DDL)
        repo = AgentRunRepository(conn)
        slug = f"lgdemo-{uuid.uuid4().hex[:8]}"
        repo.set_policy(slug, max_lost_leases=1)
        say(f"policy for {slug}: one lost lease may be retried (the graph resumes)")
        run = repo.create_run(
            thread_id=f"{slug}-article",
            agent_slug=slug,
            uid="demo-user",
            request_id=f"{slug}-1",
            input_payload={"topic": "durable agents"},
        )
        say(f"enqueued run {run.id}: {' -> '.join(STEPS)}; attempt 1 dies at {CRASH_AT}")
        children = Children(dsn=dsn, stream=sys.stderr)
        stack.callback(children.stop_all, lease_seconds + 3.0)
        children.start("reconciler", ["reconcile", "--every", f"{lease_seconds / 2:g}"])
        worker_args = [
            "--agent",
            "agent_runs.devtools.langgraph_demo:agent",
            "--agent-slug",
            slug,
            "--lease-seconds",
            f"{lease_seconds:g}",
            "--poll-seconds",
            "0.2",
            "--log-level",
            "WARNING",
        ]
        children.start("w1", ["worker", "--name", "demo-lg-w1", *worker_args])
        say("started worker process demo-lg-w1")
        replaced = False
        deadline = started + timeout
        while True:
            current = repo.get_run(run.id)
            assert current is not None
            if current.is_terminal or time.monotonic() > deadline:
                break
            died = children.started[-1].process.poll()
            if died is not None and not replaced:
                replaced = True
                say(f"worker process demo-lg-w1 died (exit code {died}) mid-graph")
                children.start("w2", ["worker", "--name", "demo-lg-w2", *worker_args])
                say("started worker process demo-lg-w2: it resumes from the last checkpoint")
            time.sleep(0.2)
        children.stop_all(lease_seconds + 3.0)
        ended = repo.get_run(run.id)
        assert ended is not None
        attempts = repo.list_run_attempts(run.id)
        print()
        print(render_history(ended, attempts, explain_run(ended, attempts)))
        print()
        print("side effects (step: attempt that did it):")
        rows = conn.execute(
            "SELECT step, attempt FROM demo_langgraph_steps WHERE run_id = %s ORDER BY at",
            (run.id,),
        ).fetchall()
        for step, attempt in rows:
            print(f"  {step:<10} attempt {attempt}")
        once = sorted(step for step, _ in rows) == sorted(STEPS)
        print(f"output: {ended.output}")
        say("done: each step ran once" if once and ended.status == "completed" else "UNEXPECTED")
        return 0 if once and ended.status == "completed" else 1
    return 1  # pragma: no cover - ExitStack does not swallow exceptions
