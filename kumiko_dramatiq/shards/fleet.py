"""``Fleet``: the runners of a dataset's shards, behind the one runner the app builds.

``JobRunner(..., shards=N)`` builds a runner per shard (each a whole runner: its broker,
pool, middleware, worker) and routes through a :class:`Fleet` every call that depends on
where messages live:

- an enqueue goes to the shard :mod:`~kumiko_dramatiq.shards.routing` names for it (and
  everything that follows from the message stays there);
- a read or action on one message or batch asks the shard its id names first, then the
  others (an id that is not its shard's, as a boot job's or a cron tick's, costs a look at
  each shard);
- a listing asks every shard and merges the answers in the listing's own order, cut to its
  limit; counts add up; ``pause``, ``resume`` and ``purge`` act on every shard;
- ``start`` starts shard 0's worker, and :class:`ShardWorkers` (on shard 0's broker) starts
  and stops the worker of every other shard with it, so ``dramatiq kumiko_dramatiq.app``
  processes consume every shard too, each with the process's thread count.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar

from dramatiq.broker import Broker
from dramatiq.middleware import Middleware
from dramatiq.worker import Worker
from pydantic import BaseModel

from kumiko_dramatiq.errors import JobConfigError, NotFoundError, PayloadError, ResultPending
from kumiko_dramatiq.middleware.presence import live_processes
from kumiko_dramatiq.ops.draining import pending_work
from kumiko_dramatiq.ops.stats import JobStats, read_stats_over
from kumiko_dramatiq.shards.routing import keyed_shard, pinned_shard, shard_of, shard_of_id
from kumiko_dramatiq.workflows.results import UnknownMessage

if TYPE_CHECKING:
    from kumiko_dramatiq.middleware.presence import ProcessInfo
    from kumiko_dramatiq.ops.dead import DeadLetter
    from kumiko_dramatiq.ops.guards import DedupInfo, LockInfo
    from kumiko_dramatiq.ops.history import JobRun
    from kumiko_dramatiq.ops.jobs import JobInfo
    from kumiko_dramatiq.ops.status import Status
    from kumiko_dramatiq.ops.waiting import QueuedMessage
    from kumiko_dramatiq.registry import JobDefinition
    from kumiko_dramatiq.runner import JobRunner
    from kumiko_dramatiq.workflows.batches import BatchStatus, Item

logger = logging.getLogger("kumiko_dramatiq")

T = TypeVar("T")

#: How long a stopping ``dramatiq`` worker process waits for the running handlers of its
#: other shards' workers (Dramatiq's own ``Worker.stop`` default).
SHARD_STOP_S: Final = 600


class Fleet:
    """The runners of shards 0 to N-1 of one dataset (see the module docstring)."""

    def __init__(self, shards: Sequence[JobRunner]) -> None:
        self.shards = tuple(shards)
        self.count = len(self.shards)
        self._turns = itertools.count()
        self.shards[0].broker.add_middleware(ShardWorkers(self))

    @property
    def first(self) -> JobRunner:
        return self.shards[0]

    # -- routing ----------------------------------------------------------
    def for_job(self, job: JobDefinition, key: object = None) -> JobRunner:
        """The shard of a message of ``job``: its job's if pinned, its key's if it has one
        (a dedup or idempotency key), else the next in turn."""
        pinned = pinned_shard(job, self.count)
        if pinned is not None:
            return self.shards[pinned]
        if isinstance(key, str):
            return self.shards[keyed_shard(job, key, self.count)]
        return self.shards[next(self._turns) % self.count]

    def for_id(self, message_id: str) -> list[JobRunner]:
        """Every shard, the one ``message_id`` names first."""
        named = shard_of_id(message_id, self.count)
        return [self.shards[named], *(s for i, s in enumerate(self.shards) if i != named)]

    def _found(self, message_id: str, call: Callable[[JobRunner], T]) -> T:
        """``call`` on the shard that knows ``message_id``: the first that does not raise
        ``NotFoundError`` (the first's error when none knows it)."""
        missing: NotFoundError | None = None
        for shard in self.for_id(message_id):
            try:
                return call(shard)
            except NotFoundError as exc:
                missing = missing or exc
        assert missing is not None
        raise missing

    # -- producing --------------------------------------------------------
    def dispatch(
        self,
        job_name: str,
        payload: dict[str, Any] | BaseModel | None = None,
        **options: Any,
    ) -> str:
        job = self.first._job(job_name)
        key = options.get("dedup_key")
        if key is None:
            key = options.get("idempotency_key")
        return self.for_job(job, key).dispatch(job_name, payload, **options)

    def dispatch_many(
        self, job_name: str, payloads: Iterable[dict[str, Any] | BaseModel | None], **options: Any
    ) -> list[str]:
        many = self.first._checked_many(
            job_name,
            payloads,
            dedup_keys=options.get("dedup_keys"),
            delay_ms=options.get("delay_ms"),
            idempotency_keys=options.get("idempotency_keys"),
            priority=options.get("priority"),
            fair_key=options.get("fair_key"),
        )
        unknown = set(options) - {
            "dedup_keys",
            "delay_ms",
            "idempotency_keys",
            "priority",
            "fair_key",
        }
        if unknown:
            raise TypeError(f"dispatch_many() got an unexpected keyword argument {min(unknown)!r}")
        if not many.bodies:
            return []
        parts: dict[int, list[int]] = {}
        spread = pinned_shard(many.job, self.count) is None and many.key(0) is None
        for index in range(len(many.bodies)):
            if spread:  # even parts, one after another, so each part goes in few calls
                shard = index * self.count // len(many.bodies)
            else:
                shard = self.shards.index(self.for_job(many.job, many.key(index)))
            parts.setdefault(shard, []).append(index)
        ids = [""] * len(many.bodies)
        for shard, indexes in parts.items():
            for index, message_id in zip(
                indexes, self.shards[shard]._enqueue_many(many.part(indexes)), strict=True
            ):
                ids[index] = message_id
        return ids

    def handle_event(
        self, event_name: str, payload: dict[str, Any] | BaseModel | None = None
    ) -> list[str]:
        return [
            self.for_job(job, dedup_key)._enqueue_event(event_name, job, body, dedup_key)
            for job, body, dedup_key in self.first._event_parts(event_name, payload)
        ]

    def dispatch_batch(self, items: Sequence[Item], **options: Any) -> str:
        named = [*_items(items), options.get("on_success"), options.get("on_complete")]
        shard = self._for_batch("dispatch_batch", named, options.get("idempotency_key"))
        return shard.dispatch_batch(items, **options)

    def dispatch_chain(self, steps: Sequence[Item | Sequence[Item]], **options: Any) -> str:
        named: list[object] = []
        for step in steps if isinstance(steps, Sequence) else ():
            named += _items(step) if isinstance(step, list) else [step]
        shard = self._for_batch("dispatch_chain", named, options.get("idempotency_key"))
        return shard.dispatch_chain(steps, **options)

    def _for_batch(self, call: str, items: Iterable[object], key: object) -> JobRunner:
        """The shard of a batch or chain: that of its pinned jobs (all its children and
        callbacks live in one shard, and a pinned job's messages in its own), of its
        idempotency key if it has one, else the next in turn."""
        pinned: dict[int, str] = {}
        for item in items:
            name = item[0] if isinstance(item, tuple | list) and item else None
            job = self.first.registry.jobs.get(name) if isinstance(name, str) else None
            if job is not None and (shard := pinned_shard(job, self.count)) is not None:
                pinned.setdefault(shard, job.qualified_name)
        if len(pinned) > 1:
            a, b = sorted(pinned.values())[:2]
            raise PayloadError(
                call,
                "items",
                f"puts {a} and {b} in one batch, but with shards={self.count} their messages "
                "live in different shards (each is capped, sequential, boot-once or cron)",
            )
        if pinned:
            return self.shards[next(iter(pinned))]
        if isinstance(key, str):
            return self.shards[shard_of(f"batch\n{key}", self.count)]
        return self.shards[next(self._turns) % self.count]

    # -- one message, one batch -------------------------------------------
    def job_state(self, message_id: str) -> str:
        state = "unknown"
        for shard in self.for_id(message_id):
            state = shard.job_state(message_id)
            if state != "unknown":
                break
        return state

    def run_record(self, message_id: str) -> list[JobRun]:
        for shard in self.for_id(message_id):
            if runs := shard.run_record(message_id):
                return runs
        return []

    def result(self, message_id: str, *, timeout_s: float = 0) -> Any:
        """The shard that knows ``message_id`` (it answers, or says it is pending) answers,
        waiting there up to ``timeout_s``."""
        unknown: UnknownMessage | None = None
        for shard in self.for_id(message_id):
            try:
                return shard.result(message_id, timeout_s=0)
            except ResultPending:
                return shard.result(message_id, timeout_s=timeout_s)
            except UnknownMessage as exc:
                unknown = unknown or exc
        assert unknown is not None
        raise unknown

    def retry_dead(self, message_id: str) -> str | Literal[False]:
        return self._found(message_id, lambda shard: shard.retry_dead(message_id))

    def delete_dead(self, message_id: str) -> bool:
        return self._found(message_id, lambda shard: shard.delete_dead(message_id))

    def cancel(self, message_id: str) -> bool:
        return self._found(message_id, lambda shard: shard.cancel(message_id))

    def run_now(self, message_id: str) -> bool:
        return self._found(message_id, lambda shard: shard.run_now(message_id))

    def stop_run(self, message_id: str) -> bool:
        return self._found(message_id, lambda shard: shard.stop_run(message_id))

    def batch(self, batch_id: str) -> BatchStatus:
        return self._found(batch_id, lambda shard: shard.batch(batch_id))

    def cancel_batch(self, batch_id: str) -> int:
        return self._found(batch_id, lambda shard: shard.cancel_batch(batch_id))

    # -- every shard --------------------------------------------------------
    def pause(self, job: str) -> None:
        for shard in self.shards:
            shard.pause(job)

    def resume(self, job: str) -> None:
        for shard in self.shards:
            shard.resume(job)

    def purge(self, job: str, *, state: str = "queued", dry_run: bool = False) -> int:
        return sum(shard.purge(job, state=state, dry_run=dry_run) for shard in self.shards)

    def runs(self, job: str | None = None, **filters: Any) -> list[JobRun]:
        limit = filters.get("limit", 50)
        return _newest(
            (shard.runs(job, **filters) for shard in self.shards),
            key=lambda run: run.order_key,
            limit=limit,
        )

    def stats(self, job: str | None = None, *, hours: int = 24) -> list[JobStats]:
        self.first.stats(job, hours=hours)  # checks the arguments
        jobs = [job] if job is not None else list(self.first.registry.jobs)
        with self.first._redis("reading the job stats"):
            return read_stats_over(
                [(shard.broker.client, shard.queue_prefix) for shard in self.shards],
                jobs,
                hours,
                datetime.now(UTC),
            )

    def batches(self, *, state: str | None = None, limit: int = 100) -> list[BatchStatus]:
        return _newest(
            (shard.batches(state=state, limit=limit) for shard in self.shards),
            key=lambda batch: (batch.created_at, batch.id),
            limit=limit,
        )

    def dead_letters(self, job: str | None = None, *, limit: int = 100) -> list[DeadLetter]:
        return _newest(
            (shard.dead_letters(job, limit=limit) for shard in self.shards),
            key=lambda letter: (letter.dead_at, letter.message_id),
            limit=limit,
        )

    def running(self, job: str | None = None) -> list[JobRun]:
        runs = [run for shard in self.shards for run in shard.running(job)]
        return sorted(runs, key=lambda run: (run.started_at or run.enqueued_at, run.run_id))

    def locks(self, *, limit: int = 1_000) -> list[LockInfo]:
        return [lock for shard in self.shards for lock in shard.locks(limit=limit)][:limit]

    def dedup_keys(self, job: str | None = None, *, limit: int = 1_000) -> list[DedupInfo]:
        return [key for shard in self.shards for key in shard.dedup_keys(job, limit=limit)][:limit]

    def job_counts(self) -> dict[str, dict[str, int]]:
        total: dict[str, dict[str, int]] = {}
        for shard in self.shards:
            for job, counts in shard.job_counts().items():
                into = total.setdefault(job, dict.fromkeys(counts, 0))
                for state, count in counts.items():
                    into[state] = into.get(state, 0) + count
        return total

    def jobs(self, now: datetime | None = None) -> list[JobInfo]:
        """Each job as the shard its messages live in sees it (shard 0 for a spread job:
        a pause is written to every shard)."""
        per_shard = [
            {info.name: info for info in shard.jobs(now)} if i == 0 or self._pins(i) else {}
            for i, shard in enumerate(self.shards)
        ]
        listed = []
        for info in per_shard[0].values():
            job = self.first.registry.jobs[info.name]
            pinned = pinned_shard(job, self.count)
            listed.append(per_shard[pinned or 0].get(info.name, info))
        return listed

    def _pins(self, shard: int) -> bool:
        return any(
            pinned_shard(job, self.count) == shard for job in self.first.registry.jobs.values()
        )

    def status(self) -> Status:
        """The whole dataset: each lane's counts added up over the shards, every live
        process once, every problem (named by its shard), and each shard's own status."""
        each = [shard.status() for shard in self.shards]
        lanes = [
            replace(
                lane,
                queued=sum(s.lanes[n].queued for s in each),
                delayed=sum(s.lanes[n].delayed for s in each),
                running=sum(s.lanes[n].running for s in each),
                dead=sum(s.lanes[n].dead for s in each),
                parked=sum(s.lanes[n].parked for s in each),
            )
            for n, lane in enumerate(each[0].lanes)
        ]
        problems = [
            problem if i == 0 else f"shard {i}: {problem}"
            for i, status in enumerate(each)
            for problem in status.problems
        ]
        return replace(
            each[0],
            lanes=lanes,
            workers=_once(p for s in each for p in s.workers),
            schedulers=_once(p for s in each for p in s.schedulers),
            paused=sorted({job for s in each for job in s.paused}),
            problems=problems,
            shards=each,
        )

    def queued(
        self,
        job: str | None = None,
        *,
        state: str | None = None,
        limit: int = 50,
        after: QueuedMessage | None = None,
    ) -> list[QueuedMessage]:
        """Shard by shard, each in its own order; ``after`` goes on in the shard of that
        message (walking pages yields every waiting message once)."""
        start = 0
        if after is not None:
            start = self.shards.index(self._holder(after.message_id))
        found: list[QueuedMessage] = []
        for shard in self.shards[start:]:
            found += shard.queued(job, state=state, limit=limit - len(found), after=after)
            after = None
            if len(found) >= limit:
                break
        return found

    def _holder(self, message_id: str) -> JobRunner:
        """The shard where ``message_id`` waits (the one its id names if none)."""
        for shard in self.for_id(message_id):
            if shard.admin.waiting_state(message_id) is not None:
                return shard
        return self.for_id(message_id)[0]

    def drain(self, timeout_s: float = 30) -> list[JobRun]:
        """Drain every shard, until one look at all of them finds nothing pending (a job on
        one shard may dispatch onto another)."""
        deadline = time.monotonic() + timeout_s
        ended: list[JobRun] = []
        while True:
            for shard in self.shards:
                ended += shard.drain(max(0.0, deadline - time.monotonic()))
            with self.first._redis("draining"):
                if all(
                    pending_work(shard.broker.client, shard.queue_prefix).idle
                    for shard in self.shards
                ):
                    return sorted(ended, key=lambda run: run.order_key)

    # -- consuming --------------------------------------------------------
    def check_redis(self) -> None:
        """Check every shard's Redis, and that every live process of the dataset spreads it
        over as many shards as this runner."""
        for shard in self.shards:
            shard.check_redis()
        check_shard_count(self.first)

    def start(self) -> None:
        check_shard_count(self.first)
        self.first._start(self.first.worker_threads)  # ShardWorkers starts the others

    def stop(self, timeout_s: float = 30) -> None:
        for shard in reversed(self.shards):  # the others first, each given ``timeout_s``
            shard.stop(timeout_s)


class ShardWorkers(Middleware):
    """On shard 0's broker: a worker of shard 0 (``runner.start()``, or a ``dramatiq
    kumiko_dramatiq.app`` process) starts the worker of every other shard once it booted, with
    its own thread count, and stops them before it stops."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        for shard in self.fleet.shards[1:]:
            shard._start(worker.worker_threads)

    def before_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        for shard in self.fleet.shards[1:]:  # already stopped, when runner.stop() stops
            shard.stop(SHARD_STOP_S)


def check_shard_count(runner: JobRunner) -> None:
    """``JobConfigError`` when a live process of ``runner``'s dataset spreads it over another
    number of shards (its messages would then be looked for in the wrong shards)."""
    with runner._redis("reading the live processes"):
        processes = live_processes(runner.broker.client, runner.queue_prefix)
    for process in processes:
        if process.shards != runner.settings.shards:
            raise JobConfigError(
                None,
                "shards",
                f"must be {process.shards} like the live {process.role} {process.host}:"
                f"{process.pid} of dataset {runner.queue_prefix}: every process of a dataset "
                "uses the same number of shards",
                runner.settings.shards,
            )


def _items(items: object) -> list[object]:
    return list(items) if isinstance(items, list | tuple) else []


def _newest(pages: Iterable[list[T]], *, key: Callable[[T], Any], limit: int) -> list[T]:
    """Pages each sorted newest first, merged newest first, cut to ``limit``."""
    merged: Iterator[T] = heapq.merge(*pages, key=key, reverse=True)
    return list(itertools.islice(merged, limit))


def _once(processes: Iterable[ProcessInfo]) -> list[ProcessInfo]:
    """Each live process once (a worker of several shards registers in each)."""
    seen: dict[tuple[str, int, str], ProcessInfo] = {}
    for process in processes:
        seen.setdefault((process.host, process.pid, process.role), process)
    return sorted(seen.values(), key=lambda info: (info.role, info.started_at))
