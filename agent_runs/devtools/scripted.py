"""Deterministic agents for demos and end-to-end tests."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Final

from agent_runs.logs import logger
from agent_runs.models import AgentRun
from agent_runs.worker import AgentResult, RetryableError, RunContext

log = logger("agent_runs.agents")

CRASH_EXIT_CODE: Final = 137


class ScriptedAgent:
    """Follows `run.input_payload["script"]`: one step per attempt, the last step repeats.

    Steps: `ok`, `retry` (RetryableError), `fail:<error_type>`, `interrupt`, `sleep:<seconds>`
    (then ok; stops early when asked to), `wait_cancel` (until should_stop), `hang` (stop the
    heartbeat, ignore should_stop, sleep 1.5 x the lease, then claim completion, which the
    repository must refuse) and `crash` (`os._exit(137)` mid-run). No script means `["ok"]`; a
    malformed script or step fails the run with error_type `invalid_script`.
    """

    def __call__(self, run: AgentRun, ctx: RunContext) -> AgentResult:
        script = run.input_payload.get("script", ["ok"]) if run.input_payload else ["ok"]
        step = step_for_attempt(script, ctx.attempt_no)
        if step is None:
            return AgentResult.failed("invalid_script", f"not a list of steps: {script!r}")
        name, _, arg = step.partition(":")
        where = f"attempt {ctx.attempt_no}"

        if step == "ok":
            return AgentResult.completed()
        if step == "retry":
            raise RetryableError(f"scripted transient failure on {where}")
        if name == "fail" and arg:
            return AgentResult.failed(arg, f"scripted failure on {where}")
        if step == "interrupt":
            return AgentResult.interrupted("interrupted", f"scripted interrupt on {where}")
        seconds = _duration(arg) if name == "sleep" else None
        if seconds is not None:
            if ctx.wait(seconds):
                return _stopped(ctx, f"stopped during sleep:{arg} on {where}")
            return AgentResult.completed()
        if step == "wait_cancel":
            while not ctx.wait(3600):
                pass
            return _stopped(ctx, f"stopped while waiting for a cancel on {where}")
        if step == "hang":
            ctx.stop_heartbeat()
            time.sleep(1.5 * ctx.lease_seconds)  # deliberately deaf to should_stop
            return AgentResult.completed()
        if step == "crash":
            log.warning("run %s: scripted crash on %s (exit %d)", run.id, where, CRASH_EXIT_CODE)
            logging.shutdown()
            sys.stderr.flush()
            os._exit(CRASH_EXIT_CODE)
        return AgentResult.failed("invalid_script", f"unknown step {step!r} on {where}")


def step_for_attempt(script: object, attempt_no: int) -> str | None:
    """The step of a script for an attempt (the last step repeats), or None if malformed."""
    if (
        not isinstance(script, Sequence)
        or isinstance(script, str)
        or not script
        or not all(isinstance(step, str) for step in script)
    ):
        return None
    step = script[min(attempt_no, len(script)) - 1]
    assert isinstance(step, str)
    return step


def _duration(text: str) -> float | None:
    try:
        seconds = float(text)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _stopped(ctx: RunContext, message: str) -> AgentResult:
    # The worker maps this by the stop reason: cancel -> cancelled, shutdown -> released for
    # retry, lease lost -> nothing written.
    return AgentResult.interrupted("stop_requested", f"{message} ({ctx.stop_reason()})")
