"""Agents shipped with agent_runs: `ScriptedAgent`, for demos and end-to-end tests."""

from __future__ import annotations

from agent_runs.devtools.scripted import CRASH_EXIT_CODE, ScriptedAgent, step_for_attempt

__all__ = ["CRASH_EXIT_CODE", "ScriptedAgent", "step_for_attempt"]
