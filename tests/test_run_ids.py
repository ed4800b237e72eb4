"""Run ids: new ones are UUIDv7, ordered by time; a given one is kept."""

from __future__ import annotations

import uuid

from agent_runs import AgentRun, AgentRunRepository
from agent_runs.ids import new_run_id


def _create(repo: AgentRunRepository, key: str) -> AgentRun:
    return repo.create_run(thread_id=key, agent_slug="a", uid="u", request_id=key)


def test_new_run_ids_are_uuid7_ordered_by_time(repo: AgentRunRepository) -> None:
    ids = [new_run_id() for _ in range(200)]
    assert len(set(ids)) == len(ids)
    for value in ids:
        parsed = uuid.UUID(value)
        assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
        assert str(parsed) == value
    millis = [uuid.UUID(v).int >> 80 for v in ids]
    assert millis == sorted(millis)
    run = _create(repo, "r1")
    assert uuid.UUID(run.id).version == 7
    assert uuid.UUID(run.id).int >> 80 >= millis[-1]


def test_a_given_run_id_is_kept(repo: AgentRunRepository) -> None:
    given = str(uuid.uuid4())
    run = repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r", run_id=given)
    assert run.id == given
