"""Batches and chains: many jobs written all or none, callbacks counted by child.

A batch is one record in Redis (``lua/include/batch.lua`` lays it out): its children's ids in
dispatch order, how each ended, and its counts. ``dispatch_batch`` validates every item; a
batch of at most :data:`WRITE_CHUNK` children is then written, opened and enqueued in one Lua
call (``lua/batch_dispatch.lua``: all or none by itself). A larger one's children are written
in chunks of :data:`WRITE_CHUNK` *staged*, beside the record and on no
queue (``lua/batch_write.lua``; while written the record expires after
:data:`WRITING_TTL_MS`, so a producer that dies half-way leaves nothing that ever runs), then
opens the batch (``lua/batch_commit.lua``: from here on its children may start) and moves them
onto their queues :data:`MOVE_STEP` per call. No single command holds Redis long, and no child
starts before every child was written. A producer that dies after the open leaves the rest
staged: the ends of the children moved already move them (``batch_child_ended``).

A child's end is counted by the settle that writes its last run record, in the same Lua call
(``lua/settle.lua``, extra +8), and likewise by every other way a message ends for good (a
cancel, a purge, the dead letter of a message delivered ``max_deliveries`` times): the count
sets the child's id in the batch's ``ended`` hash first, so a child redelivered, retried,
run twice or settled again after a fail-over counts once, never twice, never not at all. The
end that leaves no child pending enqueues ``on_complete`` (and ``on_success`` if every child
completed) in that same call: exactly once.

A chain is a record of its own and one batch per step (ids ``<chain id>.<n>``), all written
before it opens; a step that succeeds opens the next, in the Lua call that counts its last
child; one that does not ends the chain ``failed`` (``cancelled`` after ``cancel_batch``) and
the later steps never run. The last step's value is kept as the chain's result.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, Literal

from pydantic import BaseModel

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.errors import NotFoundError, PayloadError
from kumiko_dramatiq.ids import added_child_id, child_message_id
from kumiko_dramatiq.limits import check_dedup_key, check_priority
from kumiko_dramatiq.messages import build_message
from kumiko_dramatiq.payloads import payload_to_enqueue
from kumiko_dramatiq.shards.routing import new_id_in
from kumiko_dramatiq.workflows.results import decode_result

if TYPE_CHECKING:
    from dramatiq import Message

    from kumiko_dramatiq.broker.broker import KumikoBroker
    from kumiko_dramatiq.registry import JobDefinition, Registry
    from kumiko_dramatiq.settings import Settings
    from kumiko_dramatiq.worker.execution import Execution

#: Children per ``lua/batch_write.lua`` call, and staged children moved onto their queues
#: per ``lua/batch_commit.lua`` call: each well under a millisecond or two of Redis.
WRITE_CHUNK: Final = 250
MOVE_STEP: Final = 250

#: How long a batch being written lives unopened (ms): a producer that died half-way leaves
#: nothing behind for longer.
WRITING_TTL_MS: Final = 3_600_000

#: The states ``kumiko batches --state`` takes.
BATCH_STATES: Final = ("running", "succeeded", "failed", "cancelled")

BatchState = Literal["running", "succeeded", "failed", "cancelled"]
ChildStatus = Literal["completed", "dead", "cancelled"]
Item = tuple[str, "dict[str, Any] | BaseModel | None"]


@dataclass(frozen=True)
class BatchResult:
    """How one child of a batch ended (``ctx.batch.results()``), in dispatch order."""

    message_id: str
    job_name: str
    tenant_id: str | None
    status: ChildStatus
    #: what its handler returned (a model instance for a model-annotated handler), or None
    value: Any
    error_type: str | None
    error_message: str | None


@dataclass(frozen=True)
class BatchStatus:
    """A batch or chain as ``runner.batch(id)`` reads it."""

    id: str
    kind: Literal["batch", "chain"]
    state: BatchState
    total: int
    pending: int
    completed: int
    dead: int
    cancelled: int
    created_at: datetime
    ended_at: datetime | None


def batch_write(execution: Execution) -> str:
    """``Settlement.batch`` for the end of ``execution``'s attempt (``lua/settle.lua``, extra
    +8): ``"b <id>"`` for a batch child, ``"c <id>"`` for a callback, ``""`` otherwise."""
    options = execution.options
    if options.batch is not None:
        return f"b {options.batch}"
    if options.batch_callback is not None:
        return f"c {options.batch_callback}"
    if execution.job.has_callbacks and options.tenant_id is None:  # the wrapper: its batch's
        return f"b {execution.message_id}"
    return ""


def child_id_of(member: str) -> str:
    """The message id of a batch member: the id itself, or for a per-tenant child
    (``"<wrapper id>/<tenant>"``, ``lua/include/batch.lua``) the tenant child's id."""
    wrapper_id, sep, tenant = member.partition("/")
    return child_message_id(wrapper_id, tenant) if sep else member


def _ms_time(value: Any) -> datetime | None:
    if value in (None, b"", ""):
        return None
    return datetime.fromtimestamp(int(value) / 1000, tz=UTC)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Batches:
    """Writes and reads batches and chains (``runner.dispatch_batch`` and friends). Redis
    errors go through as they are (the runner turns them into ``RedisUnavailableError``)."""

    def __init__(self, broker: KumikoBroker, registry: Registry, settings: Settings) -> None:
        self.broker = broker
        self.registry = registry
        self.settings = settings
        self.prefix = settings.queue_prefix
        self.root = keys.root(settings.queue_prefix)

    # -- writing ----------------------------------------------------------
    def dispatch_batch(
        self,
        items: Sequence[Item],
        *,
        on_success: Item | None = None,
        on_complete: Item | None = None,
        idempotency_key: str | None = None,
        priority: int | None = None,
    ) -> str:
        """See ``JobRunner.dispatch_batch``."""
        priority = check_priority("dispatch_batch", priority)
        record = self._record("dispatch_batch", "batch", idempotency_key)
        batch_id = new_id_in(self.settings.shard, self.settings.shards)
        children = self._children(batch_id, items, "items", priority)
        header: dict[str, str] = {"kind": "batch"}
        for field, item in (("on_success", on_success), ("on_complete", on_complete)):
            if item is not None:
                header[field] = self._entry(self._callback(batch_id, item, field))
        if len(children) <= WRITE_CHUNK:  # one call: open, on the queues (no staging)
            args: list[Any] = [self.root, batch_id, int(time.time() * 1000), self._record_ttl_ms]
            header = self._header(header)
            args.append(len(header))
            for name, value in header.items():
                args += (name, value)
            for message in children:
                args += (str(message.message_id), *self._parts(message))
            reply = self.broker.lua.batch_dispatch(
                keys=[keys.batch(self.prefix, batch_id), *record], args=args
            )
            return batch_id if isinstance(reply, int) else _text(reply)
        first = self._first(record)
        if first is not None:
            return first
        self._write(batch_id, children, header)
        return self._open(batch_id, record)

    def dispatch_chain(
        self,
        steps: Sequence[Item | Sequence[Item]],
        *,
        idempotency_key: str | None = None,
        priority: int | None = None,
    ) -> str:
        """See ``JobRunner.dispatch_chain``."""
        if isinstance(steps, str | bytes) or not isinstance(steps, Sequence) or not steps:
            raise PayloadError("dispatch_chain", "steps", "must be a non-empty list of steps")
        priority = check_priority("dispatch_chain", priority)
        record = self._record("dispatch_chain", "chain", idempotency_key)
        chain_id = new_id_in(self.settings.shard, self.settings.shards)
        written: list[tuple[str, list[Message[Any]], bool]] = []
        for n, step in enumerate(steps, 1):
            group = isinstance(step, list)
            items: Sequence[Item] = step if isinstance(step, list) else [step]  # type: ignore[list-item]
            step_id = f"{chain_id}.{n}"
            written.append(
                (step_id, self._children(step_id, items, f"steps[{n - 1}]", priority), group)
            )
        first = self._first(record)
        if first is not None:
            return first
        for n, (step_id, children, group) in enumerate(written, 1):
            header = {"kind": "step", "chain": chain_id, "step": str(n)}
            if group:
                header["group"] = "1"
            self._write(step_id, children, header)
        self._write(chain_id, [], {"kind": "chain", "steps": str(len(written))})
        return self._open(chain_id, record)

    def _record(self, call: str, kind: str, idempotency_key: str | None) -> list[str]:
        """The keys of a batch script for ``idempotency_key``: its record, or none."""
        if idempotency_key is None:
            return []
        key = check_dedup_key(call, "idempotency_key", idempotency_key)
        return [keys.idempotency(self.prefix, kind, key)]

    def _first(self, record: list[str]) -> str | None:
        """The id a key's record holds already (then nothing is written: a shortcut; the
        open decides atomically, ``lua/batch_commit.lua``)."""
        if not record:
            return None
        found = self.broker.client.get(record[0])
        return None if found is None else _text(found)

    @property
    def _record_ttl_ms(self) -> int:
        return self.settings.idempotency_ttl_s * 1000

    def add(self, batch_id: str, adder_id: str, n: int, job_name: str, payload: Any) -> str:
        """A running child (``adder_id``) adds its ``n``-th child to ``batch_id``; returns
        the new child's id (derived, so a run that runs again adds the same children)."""
        job = self._job(job_name, "job_name")
        if job.has_callbacks:
            raise PayloadError(
                job.qualified_name, "job_name", "declares on_complete/on_success: not a child"
            )
        body = payload_to_enqueue(job, payload, max_bytes=self.settings.max_payload_bytes)
        child_id = added_child_id(adder_id, n)
        message = build_message(
            job,
            body,
            queue_prefix=self.prefix,
            trigger="manual",
            message_id=child_id,
            batch=batch_id,
        )
        queue, rid, encoded = self._parts(message)
        self.broker.lua.batch_add(
            keys=[keys.batch(self.prefix, batch_id)],
            args=[self.root, child_id, queue, rid, encoded],
        )
        return child_id

    def begin(self, job: JobDefinition, wrapper_id: str, payload: dict[str, Any]) -> str:
        """The batch of one dispatch of per-tenant ``job`` (which declares ``on_complete`` or
        ``on_success``), begun by its wrapper ``wrapper_id`` (once; again a no-op): id = the
        wrapper's, the callbacks get the wrapper's payload."""
        entries = []
        for field in ("on_complete", "on_success"):
            callback = getattr(job.options, field)
            entries.append(
                ""
                if callback is None
                else self._entry(self._callback(wrapper_id, (callback, payload), field))
            )
        self.broker.lua.batch_begin(
            keys=[keys.batch(self.prefix, wrapper_id)],
            args=[
                self.root,
                wrapper_id,
                int(time.time() * 1000),
                self.broker.namespace,
                self.settings.retention.completed_age_s * 1000,
                *entries,
            ],
        )
        return wrapper_id

    def join(self, batch_id: str, child_ids: Sequence[str]) -> int:
        """``child_ids`` join running ``batch_id`` before they are enqueued (a fan-out)."""
        return int(
            self.broker.lua.batch_join(
                keys=[keys.batch(self.prefix, batch_id)], args=[self.root, *child_ids]
            )
        )

    def cancel(self, batch_id: str, cancel_one: Callable[[str], bool]) -> int:
        """See ``JobRunner.cancel_batch``; ``cancel_one(message_id) -> bool`` cancels one
        child that has not started."""
        reply = self.broker.lua.batch_cancel(
            keys=[keys.batch(self.prefix, batch_id)],
            args=[self.root, batch_id, int(time.time() * 1000)],
        )
        if int(reply[0]) < 0:
            raise NotFoundError(f"{batch_id}: no such batch or chain (unknown, or expired)")
        dropped, later, open_ids = int(reply[0]), int(reply[1]), reply[2]
        cancelled = sum(1 for each in open_ids if cancel_one(child_id_of(_text(each))))
        return dropped + later + cancelled

    # -- reading ----------------------------------------------------------
    def status(self, batch_id: str) -> BatchStatus:
        """See ``JobRunner.batch``."""
        found = self._status(batch_id)
        if found is None:
            raise NotFoundError(f"{batch_id}: no such batch or chain (unknown, or expired)")
        return found

    def listed(self, *, state: str | None = None, limit: int = 100) -> list[BatchStatus]:
        """Batches and chains, newest first, at most ``limit`` (those in ``state``). An index
        entry whose record expired is dropped as it is met (so are those of batches that
        ended over a year ago, by each batch's end: ``lua/include/batch.lua``)."""
        found: list[BatchStatus] = []
        start = 0
        index = keys.batches(self.prefix)
        while len(found) < limit:
            ids = self.broker.client.zrevrange(index, start, start + 199)
            if not ids:
                break
            start += len(ids)
            gone: list[str] = []
            for each in ids:
                status = self._status(_text(each))
                if status is None:
                    gone.append(_text(each))
                elif state is None or status.state == state:
                    found.append(status)
                    if len(found) == limit:
                        break
            if gone:  # their records expired: the index forgets them as it meets them
                self.broker.client.zrem(index, *gone)
                start -= len(gone)
        return found

    def results(self, batch_id: str) -> list[BatchResult]:
        """How each child of ``batch_id`` ended, in dispatch order (only those that ended; a
        per-tenant child as its tenant children, in the order they joined)."""
        out: list[BatchResult] = []
        for child_id, head, value in self._ended(batch_id):
            name = str(head.get("j", "?"))
            job = self.registry.jobs.get(name)
            if job is not None and job.options.per_tenant and head.get("t") is None:
                continue  # a per-tenant wrapper: its tenant children are the results
            child_id = child_id_of(child_id)
            decoded = None if value in (None, "null") else decode_result(job, child_id, value)
            out.append(
                BatchResult(
                    message_id=child_id,
                    job_name=name,
                    tenant_id=head.get("t"),
                    status=head["s"],
                    value=decoded,
                    error_type=head.get("et"),
                    error_message=head.get("em"),
                )
            )
        return out

    def previous_result(self, step_batch_id: str) -> Any:
        """``ctx.previous_result`` of a child of chain step ``step_batch_id``: the value of
        the step before (a group's: the list of its values), None for the first step."""
        step = self.broker.client.hmget(keys.batch(self.prefix, step_batch_id), "chain", "step")
        if step[0] is None or step[1] is None or int(step[1]) <= 1:
            return None
        before = f"{_text(step[0])}.{int(step[1]) - 1}"
        group = self.broker.client.hget(keys.batch(self.prefix, before), "group") is not None
        values = [result.value for result in self.results(before)]
        if group:
            return values
        return values[0] if values else None

    def step_results(self, chain_id: str, step: int) -> list[BatchResult] | None:
        """How the children of step ``step`` (1-based) of ``chain_id`` ended; ``None`` past
        its last step."""
        if not self.broker.client.exists(keys.batch(self.prefix, f"{chain_id}.{step}")):
            return None
        return self.results(f"{chain_id}.{step}")

    def batch_of(self, message_id: str) -> str | None:
        """The batch (or chain) a message's runs belong to, as a child or a callback, read
        off its run records; ``None`` for none."""
        for raw in self.broker.client.hvals(keys.run_record(self.prefix, message_id)):
            record = json.loads(raw)
            found = record.get("b") or record.get("cb")
            if isinstance(found, str):
                chain, dot, _ = found.partition(".")  # a chain step's: the chain
                return chain if dot else found
        return None

    # -- internals --------------------------------------------------------
    def _job(self, name: Any, path: str) -> JobDefinition:
        job = self.registry.jobs.get(name) if isinstance(name, str) else None
        if job is None:
            raise PayloadError(
                "dispatch_batch", path, "names no declared job", name, note="see runner.job()"
            )
        return job

    def _item(self, item: Any, path: str) -> tuple[JobDefinition, dict[str, Any]]:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise PayloadError("dispatch_batch", path, "must be a (job_name, payload) pair", item)
        job = self._job(item[0], f"{path}[0]")
        body = payload_to_enqueue(
            job, item[1], max_bytes=self.settings.max_payload_bytes, path=f"{path}[1]"
        )
        return job, body

    def _children(
        self, batch_id: str, items: Sequence[Item], path: str, priority: int | None = None
    ) -> list[Message[Any]]:
        if isinstance(items, str | bytes) or not isinstance(items, Sequence) or not items:
            raise PayloadError("dispatch_batch", path, "must be a non-empty list of items")
        messages = []
        for i, item in enumerate(items):
            job, body = self._item(item, f"{path}[{i}]")
            if job.has_callbacks:
                raise PayloadError(
                    job.qualified_name,
                    f"{path}[{i}]",
                    "declares on_complete/on_success (each dispatch a batch of its own): "
                    "not a child of another batch",
                )
            messages.append(
                build_message(
                    job,
                    body,
                    queue_prefix=self.prefix,
                    trigger="manual",
                    batch=batch_id,
                    priority=priority,
                )
            )
        return messages

    def _callback(self, batch_id: str, item: Any, path: str) -> Message[Any]:
        job, body = self._item(item, path)
        return build_message(
            job, body, queue_prefix=self.prefix, trigger="event", batch_callback=batch_id
        )

    def _parts(self, message: Message[Any]) -> tuple[str, str, bytes]:
        prepared = self.broker.prepare(message, None)
        self.broker.emit_before("enqueue", prepared, None)
        return (
            prepared.queue_name,
            prepared.options["redis_message_id"],
            self.broker.encode(prepared, None),
        )

    def _entry(self, message: Message[Any]) -> str:
        queue, rid, encoded = self._parts(message)
        return f"{queue}\t{rid}\t{encoded.decode()}"

    def _header(self, header: dict[str, str]) -> dict[str, str]:
        """A batch record's fields: ``header`` and what every batch records."""
        return {
            **header,
            "ns": self.broker.namespace,
            "created": str(int(time.time() * 1000)),
            "ttl": str(self.settings.retention.completed_age_s * 1000),
        }

    def _write(self, batch_id: str, children: list[Message[Any]], header: dict[str, str]) -> None:
        header = self._header(header)
        key = keys.batch(self.prefix, batch_id)
        first = True
        for start in range(0, max(len(children), 1), WRITE_CHUNK):
            args: list[Any] = [WRITING_TTL_MS, len(header) if first else 0]
            if first:
                for name, value in header.items():
                    args += (name, value)
            for message in children[start : start + WRITE_CHUNK]:
                args += (str(message.message_id), *self._parts(message))
            self.broker.lua.batch_write(keys=[key], args=args)
            first = False

    def _open(self, batch_id: str, record: list[str]) -> str:
        """Open a written batch or chain and move its children; its id, or with an
        idempotency key's ``record`` that another dispatch opened first, that one's."""
        key = keys.batch(self.prefix, batch_id)
        while True:
            state, left, *first = self.broker.lua.batch_commit(
                keys=[key, *record],
                args=[
                    self.root,
                    batch_id,
                    int(time.time() * 1000),
                    MOVE_STEP,
                    self._record_ttl_ms,
                ],
            )
            if _text(state) == "taken":
                return _text(first[0])
            if _text(state) == "gone":
                raise NotFoundError(f"{batch_id}: the batch expired before it was opened")
            if int(left) == 0:
                return batch_id

    def _status(self, batch_id: str) -> BatchStatus | None:
        raw = self.broker.client.hmget(
            keys.batch(self.prefix, batch_id),
            "kind",
            "state",
            "total",
            "pending",
            "completed",
            "dead",
            "cancelled",
            "created",
            "ended",
        )
        kind, state = raw[0], raw[1]
        if kind is None or state is None or _text(kind) == "step" or _text(state) == "writing":
            return None
        counts = [int(each or 0) for each in raw[2:7]]
        created = _ms_time(raw[7])
        return BatchStatus(
            id=batch_id,
            kind="chain" if _text(kind) == "chain" else "batch",
            state=_text(state),  # type: ignore[arg-type]
            total=counts[0],
            pending=counts[1],
            completed=counts[2],
            dead=counts[3],
            cancelled=counts[4],
            created_at=created or datetime.now(UTC),
            ended_at=_ms_time(raw[8]),
        )

    def _ended(self, batch_id: str) -> list[tuple[str, dict[str, Any], str | None]]:
        key = keys.batch(self.prefix, batch_id)
        client = self.broker.client
        children = [_text(each) for each in client.lrange(f"{key}:children", 0, -1)]
        out = []
        for start in range(0, len(children), 1000):
            ids = children[start : start + 1000]
            for child_id, entry in zip(ids, client.hmget(f"{key}:ended", ids), strict=True):
                if entry is None:
                    continue
                head, _, value = _text(entry).partition("\n")
                out.append((child_id, json.loads(head), value or None))
        return out


class BatchHandle:
    """``ctx.batch`` of a batch child or callback: the batch's ``id``, ``results()`` (how its
    children ended, in dispatch order) and ``add(job_name, payload)`` (a child of a running
    batch adds another: the batch does not end before it does)."""

    def __init__(self, batches: Batches, batch_id: str, adder_id: str) -> None:
        self.id = batch_id
        self._batches = batches
        self._adder = adder_id
        self._added = 0

    def results(self) -> list[BatchResult]:
        return self._batches.results(self.id)

    def add(self, job_name: str, payload: dict[str, Any] | BaseModel | None = None) -> str:
        self._added += 1
        return self._batches.add(self.id, self._adder, self._added, job_name, payload)

    def __repr__(self) -> str:
        return f"BatchHandle({self.id!r})"
