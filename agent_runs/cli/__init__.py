"""The `agent-runs` command line (also `python -m agent_runs`): see `agent-runs --help`."""

from __future__ import annotations

from agent_runs.cli.main import main

__all__ = ["main"]
