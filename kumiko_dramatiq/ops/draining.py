"""Draining a dataset: wait until it has nothing left to do, then say what ran meanwhile.

``JobRunner.drain(timeout_s=30)`` is a thin door to :class:`Drain`, made for tests: dispatch,
``drain()``, then assert on the returned run records, with no sleeps and no hooks to wait on.

**Idle** means that one atomic look at the dataset (:func:`pending_work`: one ``MULTI``/``EXEC``
of counts, so no message can move between two reads and be missed) finds, on BOTH lanes,
nothing queued (the lane list and its crash suspects), nothing delayed (``delay_ms``, a retry
waiting out its backoff, a sequential hand-off waiting for its lock: the delay queue) and
nothing running (claimed by a worker: the in-flight hash, which also holds messages a worker
fetched but has not started, and those of a worker that died until they are redelivered),
and nothing waiting for a capped job's slot or rate window (``keys.cap_waits``).
Every step of a message from one of these states to the next (fetch, retry, move of a due
delayed message, per-tenant fan-out, dedup follow-up, hand-off) is one Lua call, or happens
while the message is still claimed, so an idle look is never a message in transit. Parked
messages (their job is paused) and dead letters are not pending: they wait for an operator.
The look is repeated every :data:`POLL_S` until idle, or until ``timeout_s`` has passed:
then :class:`~kumiko_dramatiq.errors.DrainTimeoutError` names what is still pending (per lane
counts, up to :data:`NAMED` messages with job and state, and a lane with work but no live
worker). Any worker on the dataset counts: the runner's own once started, CLI workers, other
runners; a producer-only runner can drain too.

**The runs returned** are the attempts (completed, failed, dead, cancelled; never "running")
that ended since the previous ``drain`` of the same runner returned, or, for its first drain,
since the runner was built: so ``dispatch(); drain()`` sees a run even if it ended before
``drain`` was called, and two drains in a row never return a run twice. They come from the
run history, oldest first (by ``ended_at``). The window is measured on the wall clock and
compared with ``ended_at``, which the worker stamps with its own clock: exact in one process
or on one machine; across machines, skew between clocks shifts it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import redis
from dramatiq.common import dq_name
from dramatiq.message import Message

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.broker import KumikoBroker
from kumiko_dramatiq.broker.counts import in_order
from kumiko_dramatiq.broker.keys import queue_list, queue_messages
from kumiko_dramatiq.errors import DrainTimeoutError, JobConfigError
from kumiko_dramatiq.middleware.presence import live_processes
from kumiko_dramatiq.ops.history import JobRun, RunHistory
from kumiko_dramatiq.options import LANES, lane_queue
from kumiko_dramatiq.registry import Registry

#: How often ``drain`` looks at the dataset while it waits (seconds).
POLL_S: Final = 0.005
#: How many pending messages a ``DrainTimeoutError`` names.
NAMED: Final = 5
#: Run records read per history query while collecting a drain's runs.
PAGE: Final = 1_000


@dataclass(frozen=True)
class LanePending:
    """A lane's waiting messages: in its queue (or its suspects list) and in its delay queue."""

    lane: str
    queued: int
    delayed: int


@dataclass(frozen=True)
class PendingWork:
    """One atomic look at a dataset's unfinished work (see the module docstring)."""

    lanes: tuple[LanePending, ...]
    running: int
    #: messages waiting for a capped job's slot or rate window (``max_running``,
    #: ``rate_limit``), both lanes
    capped: int = 0

    @property
    def idle(self) -> bool:
        return (
            self.running == 0
            and self.capped == 0
            and all(lane.queued == 0 and lane.delayed == 0 for lane in self.lanes)
        )

    def describe(self) -> str:
        """``"worker lane: 1 queued, 0 delayed; api lane: 0 queued, 0 delayed; 2 running"``."""
        lanes = "; ".join(
            f"{lane.lane} lane: {lane.queued} queued, {lane.delayed} delayed" for lane in self.lanes
        )
        capped = f"; {self.capped} waiting for caps" if self.capped else ""
        return f"{lanes}; {self.running} running{capped}"


def pending_work(client: redis.Redis, queue_prefix: str) -> PendingWork:
    """Count the dataset's queued, delayed and running messages in one ``MULTI``/``EXEC``
    (ids that ``cancel`` withdrew, still listed until a fetch meets them, not counted)."""
    pipe = client.pipeline(transaction=True)
    for lane in LANES:
        queue = lane_queue(queue_prefix, lane)
        pipe.llen(queue_list(queue))
        pipe.llen(keys.suspects(queue_prefix, queue))
        pipe.scard(keys.queue_withdrawn(queue))
        pipe.hlen(queue_messages(dq_name(queue)))
    for lane in LANES:
        pipe.hgetall(keys.queue_levels(lane_queue(queue_prefix, lane)))
    pipe.hlen(keys.inflight(queue_prefix))
    pipe.hgetall(keys.cap_waits(queue_prefix))
    *counts, waits = pipe.execute()
    replies = [int(reply) for reply in counts[: 4 * len(LANES)]]
    ordered = [in_order(levels) for levels in counts[4 * len(LANES) : 5 * len(LANES)]]
    lanes = tuple(
        LanePending(
            lane,
            max(0, replies[4 * i] + ordered[i] + replies[4 * i + 1] - replies[4 * i + 2]),
            replies[4 * i + 3],
        )
        for i, lane in enumerate(LANES)
    )
    return PendingWork(lanes, int(counts[-1]), sum(max(0, int(count)) for count in waits.values()))


class Drain:
    """The ``drain`` of one runner: waits for an idle dataset and remembers where its
    window of returned runs ends (the only state it keeps; see the module docstring)."""

    def __init__(self, broker: KumikoBroker, registry: Registry, queue_prefix: str) -> None:
        self.broker = broker
        self.registry = registry
        self.queue_prefix = queue_prefix
        self.history = RunHistory(broker.client, broker.lua, queue_prefix)
        #: Runs that ended at or after this instant (epoch ms) were not returned yet, except
        #: those in ``_returned`` (run -> its end, epoch ms; only ends from ``_since_ms`` on).
        self._since_ms = _now_ms()
        self._returned: dict[tuple[str, int], int] = {}

    def __call__(self, timeout_s: float = 30) -> list[JobRun]:
        """Wait until the dataset is idle, then return the runs that ended in this drain's
        window, oldest first. Raises :class:`DrainTimeoutError` after ``timeout_s``."""
        if (
            not isinstance(timeout_s, int | float)
            or isinstance(timeout_s, bool)
            or not 0 <= timeout_s < float("inf")
        ):
            raise JobConfigError(None, "timeout_s", "must be a number of seconds >= 0", timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            checked_ms = _now_ms()
            work = pending_work(self.broker.client, self.queue_prefix)
            if work.idle:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DrainTimeoutError(
                    self.queue_prefix, timeout_s, work.describe(), self._named(work)
                )
            time.sleep(min(POLL_S, remaining))
        ended = [
            run for run in self._ended_since(self._since_ms) if _key(run) not in self._returned
        ]
        # A run that ends from now on started after the idle look, so at or after checked_ms:
        # the next window starts there, less what was returned from that instant on.
        returned = {**self._returned, **{_key(run): _ms(run.ended_at) for run in ended}}
        self._since_ms = checked_ms
        self._returned = {key: end for key, end in returned.items() if end >= checked_ms}
        return sorted(ended, key=_chronological)

    def _ended_since(self, since_ms: int) -> list[JobRun]:
        since = datetime.fromtimestamp(since_ms / 1000, UTC)
        found: dict[tuple[str, int], JobRun] = {}
        before: JobRun | None = None
        # Pages in the run order (attempt start, newest first), each after the last of the
        # previous one. The dataset was idle at since_ms (the previous drain's look), so a
        # run that ended since started since.
        while True:
            page = self.history.runs(since=since, before=before, limit=PAGE)
            for run in page:
                found[_key(run)] = run
            if len(page) < PAGE:
                break
            before = page[-1]
        return [
            run
            for run in found.values()
            if run.status != "running" and _ms(run.ended_at) >= since_ms
        ]

    def _named(self, work: PendingWork) -> list[str]:
        """Up to :data:`NAMED` pending messages as ``"<job> <message id> (<state>)"``, then the
        lanes with pending work but no live worker."""
        named = [
            f"{run.job_name} {run.message_id} (running, attempt {run.attempt})"
            for run in self.history.running()[:NAMED]
        ]
        client = self.broker.client
        for lane in work.lanes:
            queue = lane_queue(self.queue_prefix, lane.lane)
            if lane.queued and len(named) < NAMED:
                rids = client.lrange(queue_list(queue), 0, NAMED - len(named) - 1)
                bodies = client.hmget(queue_messages(queue), rids) if rids else []
                named += self._describe(bodies, "queued")
            if lane.delayed and len(named) < NAMED:
                _, entries = client.hscan(
                    queue_messages(dq_name(queue)), 0, count=NAMED - len(named)
                )
                delayed = list(entries.values()) if isinstance(entries, dict) else []
                named += self._describe(delayed[: NAMED - len(named)], "delayed")
        lanes = {
            process.lane
            for process in live_processes(client, self.queue_prefix)
            if process.role == "worker"
        }
        for lane in work.lanes:
            if (lane.queued or lane.delayed) and lane.lane not in lanes:
                named.append(f"no live worker consumes the {lane.lane} lane")
        return named

    def _describe(self, bodies: list[Any], state: str) -> list[str]:
        described = []
        for body in bodies:
            if body is None:
                continue
            try:
                message = Message.decode(body)
            except Exception:
                described.append(f"an undecodable message ({state})")
                continue
            entry = self.registry.actor(message.actor_name)
            job = entry[0].qualified_name if entry is not None else str(message.actor_name)
            described.append(f"{job} {message.message_id} ({state})")
        return described


def _now_ms() -> int:
    return int(time.time() * 1000)


def _ms(when: datetime | None) -> int:
    return -1 if when is None else round(when.timestamp() * 1000)


def _key(run: JobRun) -> tuple[str, int]:
    return run.message_id, run.attempt


def _chronological(run: JobRun) -> tuple[datetime, datetime, int]:
    epoch = datetime.fromtimestamp(0, UTC)
    return run.ended_at or epoch, run.started_at or epoch, run.attempt
