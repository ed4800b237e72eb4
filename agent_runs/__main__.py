"""`python -m agent_runs`: the same command line as `agent-runs`."""

from __future__ import annotations

from agent_runs.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
