"""Settles in batches: the deliveries that end at about the same time share one Lua call.

A worker thread's ack (or nack) of a kumiko delivery is one call of ``lua/settle.lua``. Its
fixed cost (the round trip, the server reading and answering a request, the script's start)
is most of what Redis spends on a short job, so the settles of one queue are gathered: the
first thread to settle becomes the batch's leader, waits for the other deliveries of the
same queue this process holds to be settled too (at most one per worker thread, at most
:data:`LINGER_S`, and only while deliveries take less than that to process: slow jobs are
settled one by one, as before), and sends every gathered delivery in one call; each thread
returns when that call answered, with its own delivery's reply. One call per queue is in
flight at a time: a batch ready while the queue's previous call is still out waits for its
answer, and the settles that end meanwhile join it (a group commit). So nothing waits on an
idle Redis, and the busier Redis is (the longer a call takes), the more deliveries each call
settles: the per-call cost, most of what a settle of one delivery costs Redis, is shared just
when Redis is the bottleneck, however long the jobs run. Up to one delivery per worker thread:
a thread waits for its own settle, whose call claims its next message (a kumiko worker holds
no message its threads have not started, so ``cancel`` stops every one that has not), so the
more threads a process runs, the more a call can carry. The price: a settle may wait for the
call ahead of it, half a round trip on average while calls overlap (Dramatiq's own consumer
sends its acks one at a time too); measured with jobs of 2 ms and every command delayed 0.5 or
1 ms (a distant Redis), the drain kept its pace with half the settle calls or fewer. A delivery
that holds a capped job's slot is *urgent*: its batch is sent at once (a waiter may be due that
slot, and another run of the capped job is what the slot's holder waits for), with what has
gathered so far, beside a call in flight. Each settle may name the consumer that fetched its
delivery (its *claimer*): the flush is handed every entry's claimer, so the call can also claim
that consumer's next messages (``lua/settle.lua``). A thread blocks on its own ack as before,
so a ``kill -9`` can re-run exactly what it could before (a delivery whose handler returned and
whose ack had not been answered: at most one per worker thread); the batch adds no state that
a crash could lose.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import redis

#: How long a leader waits for the other running deliveries of its queue to finish.
LINGER_S: Final = 0.002
#: The most deliveries one call settles.
MAX_BATCH: Final = 64

#: How many settle calls of one queue a process has in flight at most (urgent ones and full
#: batches aside): a batch ready while that many are out waits for one to answer. One (a
#: group commit): measured with jobs of 2 ms, one call per 1.9 deliveries against 1.3 with
#: two in flight and 1.1 with no bound, and the least Redis CPU per job.
MAX_IN_FLIGHT: Final = 1

Flush = Callable[
    [str, Sequence[Sequence[Any]], "redis.Redis | None", Sequence[object | None]], list[int]
]


class _Batch:
    __slots__ = ("claimers", "closed", "done", "entries", "error", "results", "urgent")

    def __init__(self) -> None:
        self.entries: list[Sequence[Any]] = []
        self.claimers: list[object | None] = []
        self.urgent = False
        self.closed = False
        self.done = threading.Event()
        self.results: list[int] = []
        self.error: BaseException | None = None


class SettleBatcher:
    """Gathers the settles of each queue into batches (see the module's doc).

    ``flush(queue, entries, client, claimers)`` sends one batch and returns one reply per
    entry; ``expected(queue)`` says how many settles of ``queue`` a batch may wait for."""

    def __init__(
        self, flush: Flush, expected: Callable[[str], int], *, linger_s: float = LINGER_S
    ) -> None:
        self._flush = flush
        self._expected = expected
        self.linger_s = linger_s
        self._cond = threading.Condition()
        self._open: dict[str, _Batch] = {}
        #: queue -> how many of its calls are in flight (more than MAX_IN_FLIGHT only beside
        #: urgent ones and full batches)
        self._in_flight: dict[str, int] = {}
        #: ``flushing``: how many flushes this thread is inside of (a flush can settle: a claim
        #: it hands over may dead-letter a message that does not decode)
        self._local = threading.local()

    def settle(
        self,
        queue: str,
        entry: Sequence[Any],
        client: redis.Redis | None,
        *,
        claimer: object | None = None,
        urgent: bool = False,
    ) -> int:
        """Settle one delivery of ``queue`` (its settle arguments ``entry``); its reply.
        ``claimer``: the consumer the delivery came from (handed to the flush); ``urgent``:
        send the batch without waiting for more. A settle made inside a flush (by the thread
        sending a call) goes alone and at once: a batch it joined, or the call in flight it
        waited for, would wait for it."""
        if getattr(self._local, "flushing", 0):
            return self._flush(queue, [entry], client, [claimer])[0]
        with self._cond:
            batch = self._open.get(queue)
            leader = batch is None
            if batch is None:
                batch = self._open[queue] = _Batch()
            index = len(batch.entries)
            batch.entries.append(entry)
            batch.claimers.append(claimer)
            batch.urgent = batch.urgent or urgent
            if len(batch.entries) >= MAX_BATCH:
                batch.closed = True
                del self._open[queue]
            if not leader:
                self._cond.notify_all()
        if not leader:
            batch.done.wait()
            if batch.error is not None:
                raise _copy(batch.error)
            return batch.results[index]
        interrupted: BaseException | None = None
        try:
            self._gather(queue, batch)
        except BaseException as exc:  # an interruption while gathering: send what there is
            interrupted = exc
        with self._cond:
            if self._open.get(queue) is batch:
                del self._open[queue]
            batch.closed = True
            self._in_flight[queue] = self._in_flight.get(queue, 0) + 1
        self._local.flushing = getattr(self._local, "flushing", 0) + 1
        try:
            batch.results = self._flush(queue, batch.entries, client, batch.claimers)
        except BaseException as exc:
            batch.error = exc
            raise
        finally:
            self._local.flushing -= 1
            with self._cond:
                left = self._in_flight[queue] - 1
                if left:
                    self._in_flight[queue] = left
                else:
                    del self._in_flight[queue]
                self._cond.notify_all()
            batch.done.set()
        if interrupted is not None:
            raise interrupted
        return batch.results[index]

    def _gather(self, queue: str, batch: _Batch) -> None:
        """Until ``batch`` may be sent: the settles expected have joined it (or the linger
        ran out), and the queue's call in flight, if any, has answered (unless the batch is
        urgent or full); settles that end meanwhile join it."""
        deadline = time.monotonic() + self.linger_s
        with self._cond:
            while (
                not batch.closed and not batch.urgent and len(batch.entries) < self._expected(queue)
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            while (
                not batch.closed
                and not batch.urgent
                and self._in_flight.get(queue, 0) >= MAX_IN_FLIGHT
            ):
                self._cond.wait()


def _copy(error: BaseException) -> BaseException:
    """The leader's error for a follower to raise (its own object, not the leader's): a
    Redis error as itself; anything else (the leader's thread interrupted mid-call) as a
    connection error, which the ack retries (settling again is safe)."""
    if isinstance(error, redis.RedisError):
        try:
            return type(error)(*error.args)
        except Exception:
            pass
    return redis.ConnectionError(f"settle batch failed: {error!r}")
