"""How an agent's execution ended, as the agent says it: `AgentResult`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent_runs.models import RunStatus


@dataclass(frozen=True, slots=True)
class AgentResult:
    """How an agent's execution ended; build it with one of the class methods."""

    status: RunStatus
    error_type: str | None = None
    error_message: str | None = None
    # The run's result (any JSON value, at most 1 MiB of JSON text); one the JSON rules refuse
    # fails the run `invalid_output`.
    output: Any = None

    @classmethod
    def completed(cls, output: Any = None) -> AgentResult:
        return cls(RunStatus.COMPLETED, output=output)

    @classmethod
    def failed(cls, error_type: str, message: str) -> AgentResult:
        return cls(RunStatus.FAILED, error_type, message)

    @classmethod
    def interrupted(cls, error_type: str, message: str, output: Any = None) -> AgentResult:
        """Ended waiting for something (a human's input); `output` may say what it waits for."""
        return cls(RunStatus.INTERRUPTED, error_type, message, output)
