"""Fencing: a run holding a lease stops before the lease can expire, or its process ends.

A lease (a sequential job's lock, :mod:`kumiko_dramatiq.middleware.sequential`) is an owner
token with a TTL in Redis, renewed while its run lasts. A worker cut off from Redis cannot
renew it: once it expires, another worker may take it and start a run of its own. So the
holder fences itself:

- **lease time is counted from when the command that took or renewed it was sent**
  (``time.monotonic()`` read before the send). Redis starts the TTL when the command arrives,
  later, so the lease is valid at least until ``sent + ttl``; a monotonic clock cannot jump,
  and the margins below absorb a slightly fast or slow clock;
- at ``sent + INTERRUPT_AT * ttl`` (:func:`fence_deadlines`) with no later renewal, the run
  is **interrupted** (:class:`LeaseLost`, through its
  :class:`~kumiko_dramatiq.worker.interrupts.Interruptible`: an asynchronous exception in
  a sync handler's thread, a cancelled task for an ``async def`` one) and its lease is given
  up: it is no longer renewed and, once it expired, no longer this run's;
- at ``sent + END_PROCESS_AT * ttl``, a run still executing (inside a blocking C call the
  interruption cannot reach, or a handler that swallowed it) **ends its worker process**:
  one CRITICAL line, then ``os._exit(FENCE_EXIT_STATUS)``, as ``kill -9`` would. What it was
  running comes back like any run cut short by a crash.

A renewal that finds the lease gone (expired, or another owner's) fences at once: the
interruption now, the end of the process ``(END_PROCESS_AT - INTERRUPT_AT) * ttl`` later.

:class:`Fence` is the watchdog: one daemon thread per runner (started on the first
:meth:`~Fence.guard`, gone after :data:`IDLE_EXIT_S` with nothing to guard) that sleeps until
the earliest deadline of the runs it guards. Whoever holds leases (sequential locks; the
concurrency slots of later releases) guards each run under a key, extends its deadlines on
each renewal and releases it when the run ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dramatiq.middleware import Interrupt

from kumiko_dramatiq.worker.interrupts import Interruptible

logger = logging.getLogger("kumiko_dramatiq")

#: A lease's run is interrupted this fraction of the TTL after the last renewal was sent.
INTERRUPT_AT = 0.75
#: A run still executing this fraction of the TTL after it ends its worker process.
END_PROCESS_AT = 0.9
#: The exit status of a worker process ended by the fence.
FENCE_EXIT_STATUS = 5
#: The watchdog thread ends after this long with nothing to guard.
IDLE_EXIT_S = 10.0


class LeaseLost(Interrupt):
    """Raised in a handler whose lease could not be renewed in time: the run is interrupted
    before the lease can expire, and runs again later (no attempt spent, no failure hook).
    A Dramatiq ``Interrupt``, so ``except Exception`` in a handler does not catch it."""


class HoldLost(LeaseLost):
    """Raised in a run started from a message its worker held ahead of its threads, whose
    start could not be reported before the worker's hold ran out, or was reported too late
    (the message was taken over meanwhile: :mod:`kumiko_dramatiq.broker.holds`). Like a lost
    lease: no attempt spent, no failure hook, no record; the run counts as never started."""


def fence_deadlines(sent_at_s: float, ttl_ms: int) -> tuple[float, float]:
    """When to interrupt a run whose lease was last taken or renewed by a command sent at
    ``sent_at_s`` (monotonic seconds) with a TTL of ``ttl_ms``, and when to end its process
    if it still runs. Pure."""
    ttl_s = ttl_ms / 1000
    return sent_at_s + INTERRUPT_AT * ttl_s, sent_at_s + END_PROCESS_AT * ttl_s


def lost_deadlines(now_s: float, ttl_ms: int) -> tuple[float, float]:
    """Deadlines for a run whose lease was found gone at ``now_s``: interrupt now, end the
    process as long after as a fenced run would have to wind down. Pure."""
    return now_s, now_s + (END_PROCESS_AT - INTERRUPT_AT) * ttl_ms / 1000


def end_process(reason: str) -> None:
    """End this process now, as ``kill -9`` would, after one CRITICAL log line."""
    logger.critical("%s", reason)
    for handler in [*logging.getLogger().handlers, *logger.handlers]:
        with contextlib.suppress(Exception):  # the process ends either way
            handler.flush()
    os._exit(FENCE_EXIT_STATUS)


@dataclass
class _Guard:
    run: Interruptible
    interrupt_at: float
    end_at: float
    what: str
    exception: type[BaseException]
    on_interrupt: Callable[[], None] | None
    #: interrupted (or found ended) already; the end of the process checked already
    fired: bool = False
    done: bool = False

    def next_deadline(self) -> float | None:
        if not self.fired:
            return self.interrupt_at
        if not self.done:
            return self.end_at
        return None


class Fence:
    """The watchdog of the runs that hold leases in one runner (see the module docstring).

    ``end_process`` is called with the CRITICAL line when a run must end its process (tests
    pass their own)."""

    def __init__(self, name: str, *, end_process: Callable[[str], None] = end_process) -> None:
        self._name = name
        self._end_process = end_process
        self._cond = threading.Condition()
        self._guards: dict[str, _Guard] = {}
        self._thread: threading.Thread | None = None

    def guard(
        self,
        key: str,
        run: Interruptible,
        *,
        interrupt_at: float,
        end_at: float,
        what: str,
        exception: type[BaseException] = LeaseLost,
        on_interrupt: Callable[[], None] | None = None,
    ) -> None:
        """Watch ``run`` under ``key``: interrupt it with ``exception`` at ``interrupt_at``
        (monotonic seconds; ``on_interrupt`` is called first, e.g. to stop renewing), end the
        process at ``end_at`` if it still executes. ``what`` names the run in log lines."""
        with self._cond:
            self._guards[key] = _Guard(run, interrupt_at, end_at, what, exception, on_interrupt)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._watch, name=f"kumiko-fence-{self._name}", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def extend(self, key: str, *, interrupt_at: float, end_at: float) -> bool:
        """New deadlines for ``key`` (a renewal, or a lease found gone); ``False`` if it was
        released or fired already (a renewal that came too late changes nothing)."""
        with self._cond:
            guard = self._guards.get(key)
            if guard is None or guard.fired:
                return False
            guard.interrupt_at, guard.end_at = interrupt_at, end_at
            self._cond.notify()
            return True

    def release(self, key: str) -> None:
        """Stop watching ``key`` (its run ended and gave its lease back, or was fenced)."""
        with self._cond:
            self._guards.pop(key, None)

    def guarded(self) -> list[str]:
        with self._cond:
            return list(self._guards)

    def _watch(self) -> None:
        idle_since: float | None = None
        while True:
            with self._cond:
                now = time.monotonic()
                upcoming = [
                    (deadline, guard)
                    for guard in self._guards.values()
                    if (deadline := guard.next_deadline()) is not None
                ]
                due = [guard for deadline, guard in upcoming if deadline <= now]
                if not due:
                    if not self._guards:
                        idle_since = now if idle_since is None else idle_since
                        if now - idle_since >= IDLE_EXIT_S:
                            self._thread = None
                            return
                        self._cond.wait(IDLE_EXIT_S)
                    else:
                        idle_since = None
                        soonest = min((deadline for deadline, _ in upcoming), default=None)
                        self._cond.wait(IDLE_EXIT_S if soonest is None else soonest - now)
                    continue
            for guard in due:
                self._fire(guard, now)

    def _fire(self, guard: _Guard, now: float) -> None:
        if not guard.fired:
            guard.fired = True
            if guard.on_interrupt is not None:
                try:
                    guard.on_interrupt()
                except Exception:
                    logger.exception("fencing %s: giving up its lease failed", guard.what)
            if guard.run.interrupt(guard.exception):
                logger.error(
                    "%s: its lease could not be renewed in time; interrupting the run before "
                    "the lease can expire (it runs again later, no attempt spent; still "
                    "running in %.1f s, it ends this worker process)",
                    guard.what,
                    max(0.0, guard.end_at - now),
                )
            if guard.run.ended:
                guard.done = True
        if now >= guard.end_at and not guard.done:
            guard.done = True
            if guard.run.running:
                self._end_process(
                    f"{guard.what}: still running {now - guard.interrupt_at:.1f} s after it "
                    "was interrupted because its lease could not be renewed (a blocking C "
                    "call cannot be interrupted): ending this worker process before the "
                    f"lease expires (exit status {FENCE_EXIT_STATUS}), as a kill would"
                )
