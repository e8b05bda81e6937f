"""Sequential jobs: the lease of ``concurrency="sequential"`` jobs, and the hand-off.

At most one run of a sequential job at a time, across all workers and
processes of a dataset; for a per-tenant job, one per tenant (its children
lock per ``kumiko_tenant_id``; the fan-out wrapper takes no lock).

Place in the chain: after ``Retries``, before ``Dedup``, ``Hooks`` and
``TimeLimit``. So the lock is taken before ``on_job_start`` and before the
time limit starts, and (``after_*`` hooks run in reverse) it is released
after the terminal hooks and BEFORE ``Retries`` enqueues a retry: a retry
waiting out its backoff holds no lock and takes it again when it runs.

``before_process_message``
    One Lua call (``lua/lock_acquire.lua``): ``SET lock token NX PX ttl``.
    Acquired: the lease is kept in ``execution.lease``, renewed by this
    middleware's renewer thread and fenced (:mod:`kumiko_dramatiq.worker.fencing`):
    counted from when the command that took or last renewed it was sent, a lease
    that could not be renewed for ``0.75 * ttl`` interrupts its run
    (``LeaseLost``), and a run still executing at ``0.9 * ttl`` ends its worker
    process, so two runs never overlap, also when the holder is cut off from
    Redis. Held: a NEW message (``trigger="requeue"``,
    same payload, tenant, dedup key and cron tick, ``build_message_options(job)``
    and the failed attempts already spent), due after
    ``sequential_retry_delay_ms`` (+0..20 % jitter), goes into the delivery's
    settlement: the ack writes it in the same Lua call that acks the original
    (``lua/settle.lua``, as it writes a retry), so a crash can neither lose the
    hand-off nor write it twice, and a message redelivered after a crash simply
    checks the lock again. Its id is noted in ``execution.handoff_id``, so the
    actor body, the hooks and ``Retries`` do nothing. Logged at INFO. Any error (Redis down) raises
    :class:`~kumiko_dramatiq.errors.SequentialLockError`, a ``MiddlewareError``:
    the handler never runs without the lock, the attempt counts as failed.
``after_process_message`` / ``after_skip_message``
    Compare-and-delete of the lock if this delivery holds it, on every path
    (success, failure, ``TimeLimitExceeded``, graceful shutdown). A failed
    release is logged; the lock then expires within its TTL. A run fenced
    (``execution.fenced``) does not release it (it is no longer its own: it
    expires) and asks its ack to put the message back on its queue
    (``Settlement.requeue``): like a run cut short by a crash it spends no
    attempt, calls no failure hook and runs again later (the ack is retried until
    Redis answers; a worker that dies first leaves it to crash recovery).
``after_worker_shutdown``
    Asks the renewer thread to stop. A run still going then (a stop that timed
    out) keeps its lease renewed until it ends; then the thread ends.

Options read: ``job.options.concurrency``, ``job.options.per_tenant``;
message options ``kumiko_tenant_id`` and ``kumiko_failures`` (through
``execution.meta``), ``kumiko_dedup_key`` and ``kumiko_scheduled_at``
(copied onto the hand-off). Message options written: only those of the
hand-off message, all through :func:`~kumiko_dramatiq.messages.build_message`.
Setting: ``lock_ttl_ms`` (``JobRunner(lock_ttl_ms=...)`` or ``KUMIKO_LOCK_TTL_MS``).
Messages of other jobs return before any Redis call.

Redis keys: :func:`keys.sequential_lock` (the lease: value = owner token
``"<message id>:<uuid4 hex>"``, TTL ``lock_ttl_ms``, default 30 000 ms,
renewed every TTL/3 by one multi-key Lua call for all leases of the process).
A hand-off leaves no key of its own: it is enqueued by the ack.

Bounds: a worker killed with ``kill -9`` leaves its lock for at most
``lock_ttl_ms`` (the last renewal was at most TTL/3 earlier). A run cut off
from Redis is interrupted by an outage longer than ``0.75 * ttl``; it survives
one shorter than ``(0.75 - 1/3 - 1/10) * ttl`` less the socket timeout (renewals
every TTL/3, retried every TTL/10 after a failure, each waiting up to
``boot_redis_timeout_ms``). A
waiting message re-checks the lock once per ``sequential_retry_delay_ms``
(never sooner): N waiters cost at most N lock checks and N enqueues per
delay, never a hot loop. Waiters are not ordered (no FIFO).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from typing import Any, Protocol

import redis
from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Middleware
from dramatiq.worker import Worker

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.errors import SequentialLockError
from kumiko_dramatiq.ids import handoff_message_id, handoff_redis_id
from kumiko_dramatiq.messages import build_message
from kumiko_dramatiq.registry import JobDefinition
from kumiko_dramatiq.worker.execution import Execution, Lease, execution_of
from kumiko_dramatiq.worker.fencing import Fence, fence_deadlines, lost_deadlines
from kumiko_dramatiq.worker.interrupts import Interruptible
from kumiko_dramatiq.worker.runtime import Runtime

logger = logging.getLogger("kumiko_dramatiq")

#: A hand-off waits ``delay * (1 + JITTER_FRACTION * u)``, u uniform in [0, 1).
JITTER_FRACTION = 0.2

#: Reply codes of ``lua/lock_acquire.lua``.
HELD, ACQUIRED = 0, 1


# -- pure decisions ------------------------------------------------------
def is_locked(job: JobDefinition, is_wrapper: bool) -> bool:
    """Whether a delivery of ``job`` takes the sequential lock (wrappers never do)."""
    return job.options.concurrency == "sequential" and not is_wrapper


def lock_tenant(job: JobDefinition, tenant_id: str | None) -> str | None:
    """The tenant a lock is scoped to: the child's tenant for per-tenant jobs, else none."""
    return tenant_id if job.options.per_tenant else None


def handoff_delay_ms(base_ms: int, jitter: float) -> int:
    """Delay of a hand-off: ``base_ms`` plus up to 20 % (``jitter`` in [0, 1)).

    Never shorter than ``base_ms`` (the contract's "after
    ``sequential_retry_delay_ms``"); the jitter spreads a burst of waiters
    handed off together, so they do not re-check in lockstep.
    """
    return base_ms + int(base_ms * JITTER_FRACTION * jitter)


def renew_interval_ms(ttl_ms: int) -> int:
    """How often leases are extended: a third of the TTL, so two renewals may
    fail before a lease of a live run expires."""
    return max(1, ttl_ms // 3)


def retry_interval_ms(ttl_ms: int) -> int:
    """How soon a failed renewal is tried again: a tenth of the TTL, so a short
    outage costs no run (see :func:`kumiko_dramatiq.worker.fencing.fence_deadlines`)."""
    return max(1, ttl_ms // 10)


def new_token(message_id: str) -> str:
    """A lease owner token: the holder's message id plus a random part."""
    return f"{message_id}:{uuid.uuid4().hex}"


# -- the middleware ------------------------------------------------------
class Sequential(Middleware):
    """Takes, renews and releases the lease of sequential jobs; hands off when it is held.

    See the module docstring for the full contract.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.lock_ttl_ms = runtime.settings.lock_ttl_ms
        self._renewer = LeaseRenewer(self)

    # -- hooks -------------------------------------------------------------
    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        execution = execution_of(message)
        if execution is None or not is_locked(execution.job, execution.is_wrapper):
            return
        job = execution.job
        prefix = self.runtime.queue_prefix
        lock_key = keys.sequential_lock(
            prefix, job.qualified_name, lock_tenant(job, execution.meta.tenant_id)
        )
        token = new_token(execution.message_id)
        lua = self.runtime.broker.lua
        sent_at = time.monotonic()  # the lease runs from here at the latest
        try:
            state = lua.lock_acquire(keys=[lock_key], args=[token, self.lock_ttl_ms])
        except Exception as exc:
            raise SequentialLockError(job.qualified_name, "taking the lock", lock_key, exc) from exc
        if state == ACQUIRED:
            execution.lease = Lease(lock_key, token)
            self._renewer.hold(
                token,
                lock_key,
                sent_at=sent_at,
                run=execution.interruptible,
                what=f"{job.qualified_name} {execution.message_id} (lock {lock_key})",
            )
            return
        self._hand_off(execution, lock_key)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        self._release(execution_of(message))

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self._release(execution_of(message))

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        self._renewer.stop()

    # -- internals ---------------------------------------------------------
    def _hand_off(self, execution: Execution, lock_key: str) -> None:
        job, meta, options = execution.job, execution.meta, execution.options
        handoff_id = handoff_message_id(execution.message_id)
        delay_ms = handoff_delay_ms(
            self.runtime.settings.sequential_retry_delay_ms, random.random()
        )
        handoff = build_message(
            job,
            execution.delivery.args[0],
            queue_prefix=self.runtime.queue_prefix,
            trigger="requeue",
            message_id=handoff_id,
            tenant_id=options.tenant_id,
            failures=options.failures,
            dedup_key=options.dedup_key,
            scheduled_at=options.scheduled_at,
            origin_id=execution.origin_id,
            batch=options.batch,
            batch_callback=options.batch_callback,
            priority=options.priority,
            fair_key=options.fair_key,
        )
        broker = self.runtime.broker
        prepared = broker.prepare(
            handoff,
            delay_ms,
            redis_message_id=handoff_redis_id(
                execution.origin_id, execution.delivery.redis_message_id
            ),
        )
        broker.emit_before("enqueue", prepared, delay_ms)
        # the ack writes it (and acks the original) in one Lua call
        execution.delivery.settlement.handoff = (prepared, delay_ms)
        execution.handoff_id = handoff_id
        logger.info(
            "%s %s: lock %s is held; handed off to %s (trigger requeue, attempt %d of %d), "
            "which re-checks in %d ms",
            job.qualified_name,
            execution.message_id,
            lock_key,
            handoff_id,
            meta.attempt,
            meta.max_attempts,
            delay_ms,
            extra=execution.log_fields(),
        )

    def _release(self, execution: Execution | None) -> None:
        if execution is None or execution.lease is None:
            return
        lease, execution.lease = execution.lease, None
        # Drop it from the renewer and the fence first: a renewal racing the delete must
        # not report a lease we gave up as "lost".
        self._renewer.release(lease.token)
        if execution.fenced:
            execution.delivery.settlement.requeue = True
            logger.warning(
                "%s %s was interrupted: its lease of lock %s could not be renewed; the lock is "
                "left to expire, the message goes back to its queue and runs again (no attempt "
                "spent)",
                execution.job.qualified_name,
                execution.message_id,
                lease.lock_key,
                extra=execution.log_fields(),
            )
            return
        lua = self.runtime.broker.lua
        try:
            released = lua.lock_release(keys=[lease.lock_key], args=[lease.token])
        except redis.RedisError as exc:
            # compare-and-delete on the owner token: safe to write late, so the worker's
            # retry list writes it once Redis answers (the lock expires by itself anyway)
            logger.warning(
                "%s %s: could not release lock %s (%s: %s); retrying until Redis takes it",
                execution.job.qualified_name,
                execution.message_id,
                lease.lock_key,
                type(exc).__name__,
                exc,
            )
            self.runtime.deferred.add(
                f"release of lock {lease.lock_key}",
                lambda: lua.lock_release(keys=[lease.lock_key], args=[lease.token]),
                bound_ms=self.lock_ttl_ms,
            )
            return
        except Exception as exc:
            logger.warning(
                "%s %s: could not release lock %s (%s: %s); it expires within %d ms",
                execution.job.qualified_name,
                execution.message_id,
                lease.lock_key,
                type(exc).__name__,
                exc,
                self.lock_ttl_ms,
            )
            return
        if released != 1:
            logger.warning(
                "%s %s: lock %s was no longer ours at release (lease lost earlier); "
                "another run may have overlapped this one",
                execution.job.qualified_name,
                execution.message_id,
                lease.lock_key,
            )


class LeaseOwner(Protocol):
    """What a :class:`LeaseRenewer` serves: a runtime and the TTL of its leases."""

    runtime: Runtime
    lock_ttl_ms: int


class LeaseRenewer:
    """One daemon thread per :class:`Sequential` that extends the leases this process holds,
    and moves the fence of their runs (:class:`~kumiko_dramatiq.worker.fencing.Fence`).

    Every ``renew_interval_ms(ttl)`` it extends all held leases in ONE Lua call
    (``lua/lock_renew.lua``); after a failed call it tries again every
    ``retry_interval_ms(ttl)``. Each renewal moves its runs' fence deadlines
    (:func:`~kumiko_dramatiq.worker.fencing.fence_deadlines` from when the call was sent); a
    lease found gone (expired, or another owner's) is dropped, logged as lost, and fences its
    run at once. Started on the first :meth:`hold`; it ends when it finds nothing to renew,
    and a later :meth:`hold` starts a fresh one. A lease still held when the worker stops (a
    run that outlived the stop) is renewed until its run ends.
    """

    def __init__(self, owner: LeaseOwner, kind: str = "sequential locks") -> None:
        self._owner = owner
        self._kind = kind
        self._mutex = threading.Condition()
        self._leases: dict[str, str] = {}  # token -> lock key
        self._thread: threading.Thread | None = None

    @property
    def _fence(self) -> Fence:
        return self._owner.runtime.fence

    def hold(
        self, token: str, lock_key: str, *, sent_at: float, run: Interruptible, what: str
    ) -> None:
        """Renew ``lock_key`` (owned by ``token``, taken by a command sent at ``sent_at``,
        monotonic) and fence ``run`` by it until :meth:`release`."""
        interrupt_at, end_at = fence_deadlines(sent_at, self._owner.lock_ttl_ms)
        self._fence.guard(
            token,
            run,
            interrupt_at=interrupt_at,
            end_at=end_at,
            what=what,
            on_interrupt=lambda: self.drop(token),
        )
        with self._mutex:
            self._leases[token] = lock_key
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run,
                    name=f"kumiko-leases-{self._owner.runtime.queue_prefix}",
                    daemon=True,
                )
                self._thread.start()

    def drop(self, token: str) -> None:
        """Stop renewing ``token``'s lease (its run was fenced, or is ending)."""
        with self._mutex:
            self._leases.pop(token, None)

    def release(self, token: str) -> None:
        """The run of ``token`` ended: stop renewing its lease and fencing it."""
        self.drop(token)
        self._fence.release(token)

    def held(self) -> dict[str, str]:
        """A snapshot of the held leases (token -> lock key)."""
        with self._mutex:
            return dict(self._leases)

    def stop(self) -> None:
        """The worker stopped: the thread ends once it holds nothing (a run that outlived
        the stop keeps its lease renewed until it ends)."""
        with self._mutex:
            outliving = sorted(self._leases.values())
        if outliving:
            logger.warning(
                "the worker stopped while %d sequential run(s) still hold %s; their leases "
                "are renewed until they end",
                len(outliving),
                ", ".join(outliving),
            )

    def _run(self) -> None:
        ttl_ms = self._owner.lock_ttl_ms
        delay_s = renew_interval_ms(ttl_ms) / 1000
        while True:
            with self._mutex:
                if self._leases:
                    self._mutex.wait(delay_s)
                if not self._leases:
                    self._thread = None
                    return
            try:
                self.renew_once()
                delay_s = renew_interval_ms(ttl_ms) / 1000
            except Exception as exc:
                delay_s = retry_interval_ms(ttl_ms) / 1000
                logger.warning(
                    "could not renew %s (%s: %s); trying again in %d ms, their "
                    "runs are interrupted %d ms after the last renewal that went through",
                    self._kind,
                    type(exc).__name__,
                    exc,
                    retry_interval_ms(ttl_ms),
                    int(ttl_ms * 0.75),
                )

    def renew_once(self) -> None:
        """Extend every held lease now (one round trip); fence the runs of lost ones."""
        leases = list(self.held().items())
        if not leases:
            return
        ttl_ms = self._owner.lock_ttl_ms
        sent_at = time.monotonic()
        reply = self._owner.runtime.broker.lua.lock_renew(
            keys=[key for _, key in leases],
            args=[*(token for token, _ in leases), ttl_ms],
        )
        now = time.monotonic()
        for (token, lock_key), renewed in zip(leases, reply, strict=True):
            if renewed == 1:
                interrupt_at, end_at = fence_deadlines(sent_at, ttl_ms)
                self._fence.extend(token, interrupt_at=interrupt_at, end_at=end_at)
                continue
            with self._mutex:
                still_held = self._leases.pop(token, None) is not None
            if still_held:
                logger.warning(
                    "lost %s %s (token %s): it expired or was taken over while "
                    "its run continues; interrupting the run",
                    self._kind,
                    lock_key,
                    token,
                )
                interrupt_at, end_at = lost_deadlines(now, ttl_ms)
                self._fence.extend(token, interrupt_at=interrupt_at, end_at=end_at)
