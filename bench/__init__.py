"""`make bench`: the hot path of agent_runs measured against its own hand-minimal SQL floor."""

from __future__ import annotations
