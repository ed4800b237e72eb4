"""The words of the explanation for attempts that resumed where an earlier one left off."""

from __future__ import annotations

from itertools import pairwise
from typing import Final

from agent_runs.models import AttemptOutcome, RunAttempt

# How an attempt that another resumed ended, in the resume's sentence.
LEFT_OFF: Final = {
    AttemptOutcome.LEASE_EXPIRED: "lost its lease",
    AttemptOutcome.RETRY_RELEASED: "was released for retry",
}


def resumes_text(attempts: list[RunAttempt]) -> str:
    """`; attempt 2 resumed at step 4 after attempt 1 lost its lease` for each resumed one."""
    said = []
    for before, attempt in pairwise(attempts):
        if attempt.resumed_from is not None:
            left = LEFT_OFF.get(before.outcome, f"ended {before.outcome}")  # type: ignore[arg-type]
            said.append(
                f"attempt {attempt.attempt_no} resumed at step {attempt.resumed_step} after "
                f"attempt {before.attempt_no} {left}"
            )
    return "".join(f"; {text}" for text in said)
