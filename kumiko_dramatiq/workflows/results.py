"""Results: the value a job's completed run returned, kept ``keep_result_s``, and the wait.

The worker's side (no round trip of its own): the actor body encodes what the handler of a
job with ``keep_result_s`` returned (:func:`encode_result`: the payload rules, at most
``KUMIKO_MAX_RESULT_BYTES``; a value that breaks them fails the attempt with
:class:`~kumiko_dramatiq.errors.ResultError`, retried like any failure) and keeps it on the
execution; ``History`` hands the settle call :func:`result_write`, and ``lua/settle.lua``
sets the value at :func:`~kumiko_dramatiq.broker.keys.result` (keyed by the id the caller got
back, its origin id) for ``keep_result_s`` and publishes that id on
:func:`~kumiko_dramatiq.broker.keys.results_channel`, in the same call that acknowledges the
message and writes its run record. A dead end publishes too (no value): its waiters learn at
once that there is none. A job without ``keep_result_s`` writes and publishes nothing.

The reader's side (:class:`Results`, ``runner.result``): one ``MULTI`` reads the value and
the message's run records together (so a run that ends between two reads is never taken for
one that kept nothing); a message with neither is looked for where it waits
(``Admin.waiting_state``). A wait with ``timeout_s`` listens on the channel through one
subscription per runner (:class:`ResultListener`, its own thread and connection, shared by
every waiter of the process: a thousand waiters cost Redis one idle connection, no polling)
and looks again when its id is announced (a settle, a cancel), when every id is (a purge),
when the subscription reconnects, and every :data:`RECHECK_S` in case an end was not
announced (a message dead-lettered unrun). A settle's announcement carries a value of at most
8 KiB with the id: the waiter takes it without a read of its own (a thousand waiters of ends
that come together do not queue for reads).

Memory: a kept result is one string key, its JSON plus about 110-130 bytes of key and expiry
(docs/workflows.md); it never blocks a dedup key, a retry or a new dispatch of the job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

import pydantic
import redis

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.errors import (
    JobFailedError,
    NotFoundError,
    PayloadError,
    ResultError,
    ResultPending,
)
from kumiko_dramatiq.limits import check_payload

if TYPE_CHECKING:
    from kumiko_dramatiq.ops.admin import Admin
    from kumiko_dramatiq.ops.history import JobRun
    from kumiko_dramatiq.registry import JobDefinition, Registry
    from kumiko_dramatiq.worker.execution import Execution

logger = logging.getLogger("kumiko_dramatiq")

#: How often a waiting ``result`` looks again without being told (s): an end nobody announced
#: (a message dead-lettered unrun, after ``max_deliveries`` or as poison) is noticed within
#: this; announced ends wake it at once. A thousand idle waiters cost Redis about 17 looks a
#: second.
RECHECK_S: Final = 60.0

#: The most looks a runner's waiters make at once: a thousand waiters woken together (a purge,
#: a reconnect, a burst of ends) queue here instead of taking every connection of the pool
#: (redis-py's default pool holds 100).
LOOKS_AT_ONCE: Final = 16

#: Announced instead of an id (a purge): every waiter looks again.
EVERY_RESULT: Final = "*"

#: The longest ``result`` waits (s): a day.
MAX_RESULT_WAIT_S: Final = 86_400

#: ``Settlement.result`` of a dead end: no value, its waiters are told.
DEAD_END: Final = "-"


class UnknownMessage(NotFoundError):
    """``result`` of an id its dataset has no trace of (the shards of a dataset ask the
    next shard then: :class:`~kumiko_dramatiq.shards.fleet.Fleet`)."""


class _Pending:
    """:meth:`Results.look`: the message has not ended; ``state`` says where it is."""

    def __init__(self, state: str) -> None:
        self.state = state


class _Found:
    """A value that came with an announcement (it may be falsy: ``0``, ``None``, ``[]``)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def encode_result(job: JobDefinition, value: Any, *, max_bytes: int) -> str:
    """The JSON that keeps ``value``, the return value of ``job``'s handler; raises
    :class:`ResultError` naming the job and what is wrong. A job whose handler's return
    annotation is a model keeps the model's dump (a dict that validates is accepted too);
    any other value must follow the payload rules."""
    name = job.qualified_name
    model = job.result_model
    if model is not None:
        try:
            value = (value if isinstance(value, model) else model.model_validate(value)).model_dump(
                mode="json"
            )
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "value"
            raise ResultError(name, f"must be a {model.__name__}: {where} {first['msg']}") from None
    elif isinstance(value, pydantic.BaseModel):
        value = value.model_dump(mode="json")
    try:
        check_payload(name, {"value": value}, max_bytes=2**62, path="result")
    except PayloadError as exc:
        got = "" if exc.value is ... else f", got {type(exc.value).__name__}"
        raise ResultError(name, f"{exc.path.removeprefix('result.')} {exc.problem}{got}") from None
    try:
        encoded = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ResultError(name, f"is not JSON: {exc}") from None
    size = len(encoded.encode())
    if size > max_bytes:
        raise ResultError(
            name, f"is {size} bytes encoded, more than KUMIKO_MAX_RESULT_BYTES ({max_bytes})"
        )
    return encoded


def decode_result(job: JobDefinition | None, message_id: str, encoded: str) -> Any:
    """The value kept as ``encoded``: a model instance (validated again) for a job whose
    handler's return annotation is a model, else the JSON value."""
    value = json.loads(encoded)
    model = None if job is None else job.result_model
    if model is None:
        return value
    try:
        return model.model_validate(value)
    except pydantic.ValidationError as exc:
        raise ResultError(
            job.qualified_name if job else "?",
            f"of {message_id} no longer validates as {model.__name__}: {exc.errors()[0]['msg']}",
        ) from None


def result_write(execution: Execution, status: str) -> str:
    """``Settlement.result`` for the end of ``execution``'s attempt (``lua/settle.lua``,
    extra +7): the value and its TTL for a completed run that kept one, :data:`DEAD_END` for a
    dead one, ``""`` otherwise (a job that keeps no result, a failed attempt to be retried).
    A batch child's value goes to its batch whatever its job keeps: TTL 0 when it keeps none."""
    keep_s = execution.job.options.keep_result_s
    if keep_s is None:
        if status == "completed" and execution.options.batch is not None:
            return f"0 {execution.result or 'null'}"  # for its batch only: TTL 0 keeps none
        return ""
    if status == "completed" and execution.result is not None:
        return f"{keep_s * 1000} {execution.result}"
    if status in ("dead", "cancelled"):
        return DEAD_END
    return ""


class Waker(Protocol):
    """What a waiter is woken through: a ``threading.Event``, or an asyncio waiter's."""

    def set(self) -> None: ...


class ResultListener:
    """One subscription to a dataset's results channel, shared by every waiter of a runner:
    a thread of its own that wakes the waiters of each announced id (and every waiter after a
    reconnect, since an announcement may have been missed meanwhile)."""

    def __init__(self, client: redis.Redis, queue_prefix: str) -> None:
        self._client = client
        self._channel = keys.results_channel(queue_prefix)
        self._lock = threading.Lock()
        self._waiters: dict[str, set[Waker]] = {}
        #: (job, encoded value) announced for an id that has waiters
        self._delivered: dict[str, tuple[str, str]] = {}
        self._ready = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def listen(
        self, message_id: str, *, ready_within_s: float, waker: Waker | None = None
    ) -> Waker:
        """``waker`` (default: a new ``threading.Event``), set when ``message_id`` is
        announced and whenever the subscription (re)connects; waits up to
        ``ready_within_s`` for the subscription to be live, so that an end after this call
        returns is not missed (a wait that starts before then still finds it by looking, see
        :class:`Results`, and is woken once the subscription is live)."""
        event = threading.Event() if waker is None else waker
        with self._lock:
            self._waiters.setdefault(message_id, set()).add(event)
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(
                    target=self._run, name="kumiko-results", daemon=True
                )
                self._thread.start()
        self._ready.wait(ready_within_s)
        return event

    def delivered(self, message_id: str) -> tuple[str, str] | None:
        """The (job, encoded value) announced with ``message_id``'s end, if it came with one."""
        with self._lock:
            return self._delivered.get(message_id)

    def forget(self, message_id: str, event: Waker) -> None:
        with self._lock:
            events = self._waiters.get(message_id)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiters[message_id]
                    self._delivered.pop(message_id, None)

    def close(self) -> None:
        self._closed.set()
        self._wake_all()

    def _wake_all(self) -> None:
        with self._lock:
            for events in self._waiters.values():
                for event in events:
                    event.set()

    def _run(self) -> None:
        backoff = 0.05
        while not self._closed.is_set():
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self._channel)
                pubsub.get_message(timeout=1.0)  # the subscription's confirmation
                self._ready.set()
                self._wake_all()  # an end may have been announced while not subscribed
                backoff = 0.05
                while not self._closed.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message is None or message.get("type") != "message":
                        continue
                    announced = message["data"]
                    if isinstance(announced, bytes):
                        announced = announced.decode()
                    if announced == EVERY_RESULT:
                        self._wake_all()
                        continue
                    message_id, _, value = announced.partition("\t")
                    with self._lock:
                        events = self._waiters.get(message_id, ())
                        if value and events:
                            job, _, encoded = value.partition("\t")
                            self._delivered[message_id] = (job, encoded)
                        for event in events:
                            event.set()
            except redis.RedisError as exc:
                self._ready.clear()
                logger.debug("kumiko: results subscription lost (%s); resubscribing", exc)
                self._closed.wait(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                with contextlib.suppress(redis.RedisError):
                    pubsub.close()


class Results:
    """The reads of kept results (``runner.result``, ``kumiko result``)."""

    def __init__(
        self,
        client: redis.Redis,
        queue_prefix: str,
        registry: Registry,
        admin: Callable[[], Admin],
    ) -> None:
        self.client = client
        self.prefix = queue_prefix
        self.registry = registry
        self._admin = admin
        self.listener = ResultListener(client, queue_prefix)
        self._looks = threading.BoundedSemaphore(LOOKS_AT_ONCE)

    def result(self, message_id: str, *, timeout_s: float = 0) -> Any:
        """The value the job of ``message_id`` returned (see ``JobRunner.result``)."""
        deadline = time.monotonic() + timeout_s
        found = self.look(message_id)
        if not self.pending(found) or timeout_s <= 0:
            return self.outcome(message_id, found, timeout_s)
        event = threading.Event()
        self.listener.listen(message_id, ready_within_s=min(timeout_s, 2.0), waker=event)
        try:
            while True:
                found = self.announced(message_id) or self.look(message_id)
                remaining = deadline - time.monotonic()
                if not self.pending(found) or remaining <= 0:
                    return self.outcome(message_id, found, timeout_s)
                event.wait(min(remaining, RECHECK_S))
                event.clear()
        finally:
            self.listener.forget(message_id, event)

    @staticmethod
    def pending(found: Any) -> bool:
        """Whether a :meth:`look` found the message not ended yet."""
        return isinstance(found, _Pending)

    def announced(self, message_id: str) -> Any:
        """The value that came with ``message_id``'s announcement, as :class:`_Found`, or
        ``None`` (none came: look)."""
        delivered = self.listener.delivered(message_id)
        if delivered is None:
            return None
        job, encoded = delivered
        return _Found(decode_result(self.registry.jobs.get(job), message_id, encoded))

    def announce(self, message_id: str) -> None:
        """Wake the waiters of ``message_id`` (a cancel: no settle announces it)."""
        self.client.publish(keys.results_channel(self.prefix), message_id)

    def close(self) -> None:
        self.listener.close()

    @staticmethod
    def outcome(message_id: str, found: Any, timeout_s: float) -> Any:
        """What ``result`` returns or raises for what a :meth:`look` found."""
        if isinstance(found, _Pending):
            raise ResultPending(message_id, timeout_s, found.state)
        if isinstance(found, _Found):
            return found.value
        return found

    def look(self, message_id: str, *, bounded: bool = True) -> Any:
        """The kept value of ``message_id``, or :class:`_Pending` if it has not ended; raises
        :class:`JobFailedError` or :class:`NotFoundError` when it ended without a value or is
        not known (see ``JobRunner.result``). ``bounded``: at most :data:`LOOKS_AT_ONCE` at a
        time (an asyncio caller bounds its looks on its loop instead: a thread's lock would
        not let the others of the loop take turns)."""
        if not bounded:
            return self._look(message_id)
        with self._looks:
            return self._look(message_id)

    def _look(self, message_id: str) -> Any:
        for last in (False, True):
            # a message that ends between these reads leaves the first look with nothing
            # certain: the second one reads its value or record
            encoded, records, chain = self._read(message_id)
            if chain is not None:
                return self._of_chain(message_id, encoded, chain)
            if encoded is not None:
                return decode_result(self._job_of(records), message_id, encoded)
            if records:
                return self._ended_without_value(message_id, records)
            admin = self._admin()
            state = admin.waiting_state(message_id)
            if state is not None:
                return _Pending(state)
            carried = [
                run
                for run in admin.history.runs(origin_id=message_id, limit=2)
                if run.message_id != message_id
            ]
            if carried and last:  # a sequential hand-off carried it on (an id of its own)
                return self._ended_without_value(message_id, [_record_of(carried[0])])
        raise UnknownMessage(f"{message_id}: no such message (unknown, or its records expired)")

    def _read(
        self, message_id: str
    ) -> tuple[str | None, list[dict[str, Any]], tuple[str, str, str] | None]:
        """The kept value, the run records, and for a chain id (state, step, steps)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.get(keys.result(self.prefix, message_id))
        pipe.hvals(keys.run_record(self.prefix, message_id))
        pipe.hmget(keys.batch(self.prefix, message_id), "kind", "state", "step", "steps")
        encoded, raw, batch = pipe.execute()
        records = sorted((json.loads(value) for value in raw), key=lambda r: int(r.get("a", 0)))
        text = encoded.decode() if isinstance(encoded, bytes) else encoded
        chain = None
        if batch[0] == b"chain":
            chain = (batch[1].decode(), (batch[2] or b"?").decode(), (batch[3] or b"?").decode())
        return text, records, chain

    @staticmethod
    def _of_chain(chain_id: str, encoded: str | None, chain: tuple[str, str, str]) -> Any:
        """A chain's result: its last step's value once it succeeded."""
        state, step, steps = chain
        if encoded is not None:
            return decode_result(None, chain_id, encoded)
        if state in ("running", "writing"):
            return _Pending("running")
        if state == "succeeded":
            raise NotFoundError(f"{chain_id}: succeeded, but its result is past its TTL")
        status = "cancelled" if state == "cancelled" else "dead"
        raise JobFailedError(
            chain_id, "chain", status, "ChainStopped", f"step {step} of {steps} did not complete"
        )

    def _job_of(self, records: list[dict[str, Any]]) -> JobDefinition | None:
        name = records[-1].get("j") if records else None
        return self.registry.jobs.get(name) if isinstance(name, str) else None

    def _ended_without_value(self, message_id: str, records: list[dict[str, Any]]) -> Any:
        last = records[-1]
        status, name = last.get("s"), str(last.get("j", "?"))
        if status in ("dead", "cancelled"):
            raise JobFailedError(message_id, name, status, last.get("et"), last.get("em"))
        if status == "completed":
            job = self.registry.jobs.get(name)
            if job is not None and job.options.keep_result_s is None:
                why = f"its job {name} keeps no result (keep_result_s is None)"
            else:
                why = f"its result is past its TTL (keep_result_s of {name})"
            raise NotFoundError(f"{message_id}: completed, but {why}")
        # running, or failed with a retry to come
        return _Pending("running" if status == "running" else "retrying")


def _record_of(run: JobRun) -> dict[str, Any]:
    """The fields of a run record that :meth:`Results.look` reads, from a :class:`JobRun`."""
    return {
        "j": run.job_name,
        "a": run.attempt,
        "s": run.status,
        "et": run.error_type,
        "em": run.error_message,
    }
