"""create_runs: many runs in one statement (a parent spawning its sub-agents), each with
create_run's arguments and rules. Mixed into AgentRunRepository.

An item's request_id seen before (in the database, or earlier in the same batch) gives the
existing run, whatever its status. An item that would be a second active run on its
(uid, agent_slug, thread_id) makes the whole call raise ThreadBusy naming the item, and nothing
is written. A run may name as its parent (created_by_run_id) a run_id given to an earlier or
later item of the same batch. With telemetry, each item has create_run's span and metric, its
trace context stored by the batch's one INSERT.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

from psycopg import errors as pg_errors
from psycopg.types.json import Jsonb

from agent_runs import validation as check
from agent_runs.errors import UQ_ONE_ACTIVE_PER_THREAD, InvalidArgument, ThreadBusy
from agent_runs.ids import new_run_id
from agent_runs.models import AgentRun
from agent_runs.rows import run_of as _run
from agent_runs.steps import Execute, Plan, planned
from agent_runs.transport import Row, statement

if TYPE_CHECKING:  # never imported at run time: telemetry off costs no import
    from agent_runs.telemetry import Telemetry

_REQUIRED: Final = ("thread_id", "agent_slug", "uid", "request_id")
_OPTIONAL: Final = (
    "input_payload",
    "run_type",
    "created_by_run_id",
    "run_id",
    "priority",
    "available_at",
    "concurrency_key",
)
_ARGUMENTS: Final = frozenset(_REQUIRED + _OPTIONAL)
# A refusal the database gives while the cause has moved on (a concurrent creator committed
# one of our request_ids, the run that made a thread busy ended): the batch is run again.
_TRIES: Final = 3


@dataclass(frozen=True, slots=True)
class _Item:
    index: int
    run_id: str
    request_id: str
    thread_id: str
    agent_slug: str
    uid: str
    run_type: str
    created_by_run_id: str | None
    input_payload: dict[str, Any]
    priority: int = 0
    available_at: datetime | None = None
    concurrency_key: str | None = None

    @property
    def thread(self) -> tuple[str, str, str]:
        return (self.uid, self.agent_slug, self.thread_id)


def _item(index: int, value: object) -> _Item:
    if not isinstance(value, Mapping):
        raise InvalidArgument(
            f"items[{index}] must be a mapping of create_run's arguments, "
            f"got {type(value).__name__}"
        )
    unknown = sorted(str(key) for key in value if key not in _ARGUMENTS)
    if unknown:
        raise InvalidArgument(f"items[{index}]: unknown argument(s) {', '.join(unknown)}")
    for name in _REQUIRED:
        if name not in value:
            raise InvalidArgument(f"items[{index}]: {name} is required")
    try:
        payload = value.get("input_payload")
        run_id = value.get("run_id")
        item = _Item(
            index=index,
            run_id=new_run_id() if run_id is None else check.identifier("run_id", run_id),
            request_id=check.identifier("request_id", value["request_id"]),
            thread_id=check.identifier("thread_id", value["thread_id"]),
            agent_slug=check.identifier("agent_slug", value["agent_slug"]),
            uid=check.identifier("uid", value["uid"]),
            run_type=check.run_type(value.get("run_type", "chat")),
            created_by_run_id=check.optional_identifier(
                "created_by_run_id", value.get("created_by_run_id")
            ),
            input_payload=check.json_object("input_payload", {} if payload is None else payload),
            priority=check.priority(value.get("priority", 0)),
            available_at=check.available_at(value.get("available_at")),
            concurrency_key=check.optional_concurrency_key(value.get("concurrency_key")),
        )
    except InvalidArgument as exc:
        raise InvalidArgument(f"items[{index}]: {exc}") from None
    if item.created_by_run_id is not None and item.created_by_run_id == item.run_id:
        raise InvalidArgument(
            f"items[{index}]: created_by_run_id {item.created_by_run_id!r} is the run's own "
            "run_id: a run cannot be its own parent"
        )
    return item


def _items(value: object) -> tuple[list[_Item], list[_Item]]:
    """Every item validated, and the ones to insert: the first item of each request_id."""
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise InvalidArgument(f"items must be a list of mappings, got {type(value).__name__}")
    raw = list(value)
    if not 1 <= len(raw) <= check.MAX_BATCH:
        raise InvalidArgument(f"items must hold 1 to {check.MAX_BATCH} items, got {len(raw)}")
    items = [_item(index, item) for index, item in enumerate(raw)]
    sent: dict[str, _Item] = {}
    run_ids: dict[str, int] = {}
    for item in items:
        if item.request_id in sent:
            continue  # the same request again: the earlier item's run
        if item.run_id in run_ids:
            raise InvalidArgument(
                f"items[{item.index}]: run_id {item.run_id!r} is also the run_id of "
                f"items[{run_ids[item.run_id]}]"
            )
        run_ids[item.run_id] = item.index
        sent[item.request_id] = item
    _refuse_loops(list(sent.values()))
    return items, list(sent.values())


def _refuse_loops(sent: list[_Item]) -> None:
    """Lineage is a tree: parent links among the batch's new runs must not close a loop (runs
    outside the batch are in a tree already, and a new run is nobody's parent yet)."""
    parent_of = {item.run_id: item.created_by_run_id for item in sent}
    settled: set[str] = set()  # run_ids known to lead out of the batch
    for item in sent:
        path: list[str] = []
        node: str | None = item.run_id
        while node is not None and node in parent_of and node not in settled:
            if node in path:
                raise InvalidArgument(
                    f"items[{item.index}]: created_by_run_id {item.created_by_run_id!r} closes "
                    "a loop of parents inside the batch (lineage is a tree)"
                )
            path.append(node)
            node = parent_of[node]
        settled.update(path)


def _params(sent: list[_Item]) -> dict[str, Any]:
    return {
        "run_ids": [i.run_id for i in sent],
        "request_ids": [i.request_id for i in sent],
        "thread_ids": [i.thread_id for i in sent],
        "agent_slugs": [i.agent_slug for i in sent],
        "uids": [i.uid for i in sent],
        "run_types": [i.run_type for i in sent],
        "created_by_run_ids": [i.created_by_run_id for i in sent],
        "concurrency_keys": [i.concurrency_key for i in sent],
        "input_payloads": Jsonb([i.input_payload for i in sent]),
        "priorities": [i.priority for i in sent],
        "available_ats": [i.available_at for i in sent],
        "trace_contexts": None,  # telemetry off
    }


class RunBatches:
    """create_runs of the repository (a plan, see agent_runs.steps)."""

    if TYPE_CHECKING:
        telemetry: Telemetry | None

    @planned
    def create_runs(self, items: Iterable[Mapping[str, Any]]) -> Plan[list[AgentRun]]:
        """create_run for each item (a mapping of create_run's keyword arguments), in one
        statement; returns one run per item, in the items' order.

        The same request_id again (in the database or earlier in `items`) gives the existing
        run. ThreadBusy names the first item that would be a second active run on its thread
        (an active run there already, or an earlier item of the batch); InvalidArgument names
        the item and argument it refuses. Either way nothing is written. Give a parent item a
        run_id to name it as a child's created_by_run_id in the same batch.
        """
        checked, sent = _items(items)
        params = _params(sent)
        telemetry = self.telemetry
        if telemetry is None:
            runs, _ = yield from _create_batch(checked, sent, params)
            return runs
        with telemetry.sending_many([(i.agent_slug, i.run_id) for i in checked]) as sendings:
            params["trace_contexts"] = Jsonb([sendings[i.index].trace_context for i in sent])
            runs, created = yield from _create_batch(checked, sent, params)
            for index, (sending, run) in enumerate(zip(sendings, runs, strict=True)):
                sending.sent(run, created=index in created)
            return runs


def _create_batch(
    checked: list[_Item], sent: list[_Item], params: dict[str, Any]
) -> Plan[tuple[list[AgentRun], set[int]]]:
    """create_runs' statements: a run per item of `checked`, and the indexes of the items whose
    run this call created (the first item of each request_id that was new)."""
    for tries_left in range(_TRIES - 1, -1, -1):
        try:
            rows: list[Row] = yield Execute(statement("create_runs"), params)
            break
        except (pg_errors.UniqueViolation, pg_errors.ForeignKeyViolation) as exc:
            refusal = yield from _refusal(sent, params, exc)
        except pg_errors.DeadlockDetected:
            # Concurrent batches creating runs on the same threads in opposite orders: the
            # database chose this one to give way (nothing of it stays); run it again.
            refusal = None
        if refusal is not None:
            raise refusal from None
        if not tries_left:
            raise InvalidArgument("items: the batch kept conflicting with concurrent writes")
    runs = {run.request_id: run for run in map(_run, rows)}
    new = {row["request_id"] for row in rows if row["is_new"]}
    missing = [i.request_id for i in sent if i.request_id not in runs]
    if missing:  # committed by a concurrent creator after our snapshot: a new statement
        existing: list[Row] = yield Execute(
            statement("create_runs.existing"), {"request_ids": missing}
        )
        runs.update((run.request_id, run) for run in map(_run, existing))
    for item in checked:
        if item.request_id not in runs:  # pragma: no cover - deleted in between
            raise InvalidArgument(
                f"items[{item.index}]: request_id {item.request_id!r} is being reused; retry"
            )
    created = {item.index for item in sent if item.request_id in new}
    return [runs[item.request_id] for item in checked], created


def _refusal(
    sent: list[_Item], params: Mapping[str, Any], error: pg_errors.IntegrityError
) -> Plan[Exception | None]:
    """The error naming the item the refused batch ran into, or None when the cause is gone
    (run it again). Read after the refusal, in a statement of its own."""
    if isinstance(error, pg_errors.ForeignKeyViolation):
        cause: str | None = "created_by_run_id"
    else:
        cause = error.diag.constraint_name
    if cause not in {UQ_ONE_ACTIVE_PER_THREAD, "agent_runs_pkey", "created_by_run_id"}:
        return error
    rows: list[Row] = yield Execute(statement("create_runs.conflicts"), params)
    requests = {r["a"] for r in rows if r["kind"] == "request"}
    threads = {(r["a"], r["b"], r["c"]) for r in rows if r["kind"] == "thread"}
    ids = {r["a"] for r in rows if r["kind"] == "run_id"}
    creating = [item for item in sent if item.request_id not in requests]
    if cause == UQ_ONE_ACTIVE_PER_THREAD:
        for item in creating:
            if item.thread in threads:
                return ThreadBusy(
                    f"items[{item.index}]: thread {item.thread_id!r} of uid {item.uid!r} "
                    f"already has an active run of agent {item.agent_slug!r}"
                )
            threads.add(item.thread)
    elif cause == "agent_runs_pkey":
        for item in creating:
            if item.run_id in ids:
                return InvalidArgument(
                    f"items[{item.index}]: run_id {item.run_id!r} already exists"
                )
    else:
        batch_ids = {item.run_id for item in creating}
        for item in creating:
            parent = item.created_by_run_id
            if parent is not None and parent not in ids and parent not in batch_ids:
                return InvalidArgument(
                    f"items[{item.index}]: created_by_run_id {parent!r} is not an existing "
                    "run nor a run_id of a new run of this batch"
                )
    return None
