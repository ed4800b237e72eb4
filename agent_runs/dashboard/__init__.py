"""The web dashboard (`pip install agent_runs[dashboard]`): every run, its attempts and its
sub-agent tree, read only unless cancel is allowed. `create_app(pool)` returns an ASGI app;
`agent-runs dashboard` serves it."""

from __future__ import annotations

from agent_runs.dashboard.app import create_app

__all__ = ["create_app"]
