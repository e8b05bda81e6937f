"""``Sequential``: the lease of ``concurrency="sequential"`` jobs.

At most one run of a sequential job at a time, across all workers and
processes of a dataset; for a per-tenant job, one per tenant (its children
lock per ``kumiko_tenant_id``; the fan-out wrapper takes no lock).

Place in the chain: after ``Retries``, before ``Dedup``, ``Hooks`` and
``TimeLimit``. So the lock is taken before ``on_job_start`` and before the
time limit starts, and (``after_*`` hooks run in reverse) it is released
after the terminal hooks and BEFORE ``Retries`` enqueues a retry: a retry
waiting out its backoff holds no lock and takes it again when it runs.

``before_process_message``
    One Lua call (:data:`ACQUIRE`): if this message id already handed off
    (its hand-off guard exists: a redelivery after a crash, or a retry after a
    hand-off whose reply was lost), the delivery is a no-op; else
    ``SET lock token NX PX ttl``. Acquired: the token is kept in
    ``execution.notes["sequential.token"]`` and renewed by this middleware's
    renewer thread. Held: a NEW message (``trigger="requeue"``, same payload,
    tenant, dedup key and cron tick, ``build_message_options(job)`` and the
    failed attempts already spent) is enqueued after
    ``sequential_retry_delay_ms`` (+0..20 % jitter), its id noted in
    ``execution.notes["sequential.requeued_id"]``; ``execution.handed_off``
    is set, so the actor body, the hooks and ``Retries`` do nothing and the
    original is acked. Logged at INFO. Any error (Redis down) raises
    :class:`~kumiko_dramatiq.errors.SequentialLockError`, a ``MiddlewareError``:
    the handler never runs without the lock, the attempt counts as failed.
``after_process_message`` / ``after_skip_message``
    Compare-and-delete of the lock if this delivery holds it, on every path
    (success, failure, ``TimeLimitExceeded``, graceful shutdown). A failed
    release is logged; the lock then expires within its TTL.
``after_worker_shutdown``
    Stops the renewer thread (idempotent; it restarts lazily if needed). A
    run still going then (a stop that timed out) keeps its lock at most the TTL.

Options read: ``job.options.concurrency``, ``job.options.per_tenant``;
message options ``kumiko_tenant_id`` and ``kumiko_failures`` (through
``execution.meta``), ``kumiko_dedup_key`` and ``kumiko_scheduled_at``
(copied onto the hand-off). Message options written: only those of the
hand-off message, all through :func:`~kumiko_dramatiq.messages.build_message`.
Environment: ``KUMIKO_LOCK_TTL_MS`` (integer >= 100), read once per instance.
Messages of other jobs return before any Redis call.

Redis keys: :func:`keys.sequential_lock` (the lease: value = owner token
``"<message id>:<uuid4 hex>"``, TTL ``KUMIKO_LOCK_TTL_MS``, default 30 000 ms,
renewed every TTL/3 by one multi-key Lua call for all leases of the process);
:func:`keys.enqueue_guard` of the hand-off id (value = the original message
id, TTL ``retention.completed_age_s``), written in the same Lua call as the
hand-off message (the broker's ``guarded_enqueue``), so a crash can neither
lose the hand-off nor enqueue it twice; the lock script checks it, so a message redelivered
after its hand-off does nothing.

Bounds: a worker killed with ``kill -9`` leaves its lock for at most
``KUMIKO_LOCK_TTL_MS`` (the last renewal was at most TTL/3 earlier). A
waiting message re-checks the lock once per ``sequential_retry_delay_ms``
(never sooner): N waiters cost at most N lock checks and N enqueues per
delay, never a hot loop. Waiters are not ordered (no FIFO).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Middleware
from dramatiq.worker import Worker
from redis.commands.core import Script

from .. import keys
from ..broker import AtomicStep
from ..errors import JobConfigError, SequentialLockError
from ..ids import handoff_message_id
from ..messages import build_message
from ..registry import JobDefinition
from ..runtime import Execution, Runtime

logger = logging.getLogger("kumiko_dramatiq")

#: Lease TTL when ``KUMIKO_LOCK_TTL_MS`` is not set.
DEFAULT_LOCK_TTL_MS = 30_000
#: Below this the renewer (every TTL/3) would approach a busy loop.
MIN_LOCK_TTL_MS = 100
LOCK_TTL_ENV = "KUMIKO_LOCK_TTL_MS"
#: A hand-off waits ``delay * (1 + JITTER_FRACTION * u)``, u uniform in [0, 1).
JITTER_FRACTION = 0.2
#: Message options a hand-off carries over besides payload, tenant and failures.
CARRIED_OPTIONS = ("kumiko_dedup_key", "kumiko_scheduled_at")

NOTE_TOKEN = "sequential.token"
NOTE_LOCK_KEY = "sequential.lock_key"
NOTE_REQUEUED_ID = "sequential.requeued_id"

#: Reply codes of :data:`ACQUIRE`.
HELD, ACQUIRED, ALREADY_HANDED_OFF = 0, 1, 2

#: KEYS[1] = lock, KEYS[2] = hand-off guard of this message id;
#: ARGV[1] = owner token, ARGV[2] = TTL ms. Returns 2, 1 or 0 (see above).
ACQUIRE = """
if redis.call("exists", KEYS[2]) == 1 then
    return 2
end
local owner = redis.call("get", KEYS[1])
if owner == ARGV[1] then
    -- our own earlier call, re-sent by the client after a dropped connection
    redis.call("pexpire", KEYS[1], ARGV[2])
    return 1
end
if not owner then
    redis.call("set", KEYS[1], ARGV[1], "PX", ARGV[2])
    return 1
end
return 0
"""

#: KEYS = locks; ARGV[i] = the token expected in KEYS[i], ARGV[#KEYS + 1] = TTL ms.
#: Extends each lease still owned; returns one 1 (renewed) or 0 (lost) per key.
RENEW = """
local ttl = ARGV[#KEYS + 1]
local out = {}
for i, key in ipairs(KEYS) do
    if redis.call("get", key) == ARGV[i] then
        redis.call("pexpire", key, ttl)
        out[i] = 1
    else
        out[i] = 0
    end
end
return out
"""

#: KEYS[1] = lock, ARGV[1] = token. Deletes the lock only if we own it; 1 or 0.
RELEASE = """
if redis.call("get", KEYS[1]) == ARGV[1] then
    return redis.call("del", KEYS[1])
end
return 0
"""


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


def parse_lock_ttl_ms(raw: str | None) -> int:
    """``KUMIKO_LOCK_TTL_MS`` as an integer >= ``MIN_LOCK_TTL_MS``; unset -> default."""
    if raw is None or raw.strip() == "":
        return DEFAULT_LOCK_TTL_MS
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < MIN_LOCK_TTL_MS:
        raise JobConfigError(None, LOCK_TTL_ENV, f"must be an integer >= {MIN_LOCK_TTL_MS}", raw)
    return value


def new_token(message_id: str) -> str:
    """A lease owner token: the holder's message id plus a random part."""
    return f"{message_id}:{uuid.uuid4().hex}"


def carried_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The message options a hand-off keeps besides payload, tenant and failures."""
    return {name: options[name] for name in CARRIED_OPTIONS if options.get(name) is not None}


# -- the middleware ------------------------------------------------------
@dataclass(frozen=True)
class _Scripts:
    acquire: Script
    renew: Script
    release: Script


class Sequential(Middleware):
    """Takes, renews and releases the lease of sequential jobs; hands off when it is held.

    See the module docstring for the full contract.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.lock_ttl_ms = parse_lock_ttl_ms(os.environ.get(LOCK_TTL_ENV))
        self._renewer = LeaseRenewer(self)

    @functools.cached_property
    def scripts(self) -> _Scripts:
        client = self.runtime.broker.client
        return _Scripts(
            acquire=client.register_script(ACQUIRE),
            renew=client.register_script(RENEW),
            release=client.register_script(RELEASE),
        )

    # -- hooks -------------------------------------------------------------
    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        execution = self.runtime.current()
        if execution is None or not is_locked(execution.job, execution.is_wrapper):
            return
        job = execution.job
        prefix = self.runtime.queue_prefix
        lock_key = keys.sequential_lock(
            prefix, job.qualified_name, lock_tenant(job, execution.meta.tenant_id)
        )
        requeued_id = handoff_message_id(execution.message_id)
        guard_key = keys.enqueue_guard(prefix, requeued_id)
        token = new_token(execution.message_id)
        try:
            state = self.scripts.acquire(keys=[lock_key, guard_key], args=[token, self.lock_ttl_ms])
        except Exception as exc:
            raise SequentialLockError(job.qualified_name, "taking the lock", lock_key, exc) from exc
        if state == ACQUIRED:
            execution.notes[NOTE_TOKEN] = token
            execution.notes[NOTE_LOCK_KEY] = lock_key
            self._renewer.hold(token, lock_key)
            return
        if state == ALREADY_HANDED_OFF:
            self._mark_handed_off(execution, requeued_id)
            logger.info(
                "%s %s was already handed off to %s (a redelivery); nothing to do",
                job.qualified_name,
                execution.message_id,
                requeued_id,
            )
            return
        self._hand_off(execution, lock_key, requeued_id, guard_key)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        self._release()

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self._release()

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        self._renewer.stop()

    # -- internals ---------------------------------------------------------
    def _hand_off(
        self, execution: Execution, lock_key: str, requeued_id: str, guard_key: str
    ) -> None:
        job, meta = execution.job, execution.meta
        delay_ms = handoff_delay_ms(self.runtime.sequential_retry_delay_ms, random.random())
        requeued = build_message(
            job,
            execution.message.args[0],
            queue_prefix=self.runtime.queue_prefix,
            trigger="requeue",
            message_id=requeued_id,
            tenant_id=meta.tenant_id,
            failures=meta.attempt - 1,
            extra_options=carried_options(execution.message.options),
        )
        broker = self.runtime.broker
        step = AtomicStep(
            broker.kumiko_scripts.guarded_enqueue,
            keys=[guard_key],
            args=[self.runtime.retention.completed_age_s * 1000, execution.message_id],
        )
        try:
            broker.enqueue_atomic(requeued, step, delay=delay_ms)
        except Exception as exc:
            raise SequentialLockError(
                job.qualified_name, f"handing off to {requeued_id}", lock_key, exc
            ) from exc
        # Enqueued now, or by an earlier delivery of this message: either way
        # the work lives on in ``requeued_id``.
        self._mark_handed_off(execution, requeued_id)
        logger.info(
            "%s %s: lock %s is held; handed off to %s (trigger requeue, attempt %d of %d), "
            "which re-checks in %d ms",
            job.qualified_name,
            execution.message_id,
            lock_key,
            requeued_id,
            meta.attempt,
            meta.max_attempts,
            delay_ms,
        )

    @staticmethod
    def _mark_handed_off(execution: Execution, requeued_id: str) -> None:
        execution.handed_off = True
        execution.notes[NOTE_REQUEUED_ID] = requeued_id

    def _release(self) -> None:
        execution = self.runtime.current()
        if execution is None:
            return
        token = execution.notes.pop(NOTE_TOKEN, None)
        if token is None:
            return
        lock_key = execution.notes[NOTE_LOCK_KEY]
        # Drop it from the renewer first: a renewal racing the delete must not
        # report a lease we gave up as "lost".
        self._renewer.drop(token)
        try:
            released = self.scripts.release(keys=[lock_key], args=[token])
        except Exception as exc:
            logger.warning(
                "%s %s: could not release lock %s (%s: %s); it expires within %d ms",
                execution.job.qualified_name,
                execution.message_id,
                lock_key,
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
                lock_key,
            )


class LeaseRenewer:
    """One daemon thread per :class:`Sequential` that extends the leases this process holds.

    Every ``renew_interval_ms(ttl)`` it extends all held leases in ONE Lua
    call (:data:`RENEW`). A lease found owned by someone else is dropped and
    logged as lost. Started on the first :meth:`hold`; :meth:`stop` is
    idempotent and a later :meth:`hold` starts a fresh thread.
    """

    def __init__(self, owner: Sequential) -> None:
        self._owner = owner
        self._mutex = threading.Lock()
        self._leases: dict[str, str] = {}  # token -> lock key
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def hold(self, token: str, lock_key: str) -> None:
        with self._mutex:
            self._leases[token] = lock_key
            if self._thread is None or not self._thread.is_alive():
                self._stopping = threading.Event()
                self._thread = threading.Thread(
                    target=self._run,
                    args=(self._stopping,),
                    name=f"kumiko-leases-{self._owner.runtime.queue_prefix}",
                    daemon=True,
                )
                self._thread.start()

    def drop(self, token: str) -> None:
        with self._mutex:
            self._leases.pop(token, None)

    def held(self) -> dict[str, str]:
        """A snapshot of the held leases (token -> lock key)."""
        with self._mutex:
            return dict(self._leases)

    def stop(self) -> None:
        with self._mutex:
            thread, self._thread = self._thread, None
            self._stopping.set()
            abandoned = list(self._leases.values())
        if abandoned:
            logger.warning(
                "stopping lease renewal while %d sequential run(s) still hold %s; "
                "those locks expire within %d ms",
                len(abandoned),
                ", ".join(sorted(abandoned)),
                self._owner.lock_ttl_ms,
            )
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _run(self, stopping: threading.Event) -> None:
        interval_s = renew_interval_ms(self._owner.lock_ttl_ms) / 1000
        while not stopping.wait(interval_s):
            try:
                self.renew_once()
            except Exception as exc:
                logger.warning(
                    "could not renew sequential locks (%s: %s); leases expire within %d ms "
                    "unless a later renewal succeeds",
                    type(exc).__name__,
                    exc,
                    self._owner.lock_ttl_ms,
                )

    def renew_once(self) -> None:
        """Extend every held lease now (one round trip); drop and log lost ones."""
        leases = list(self.held().items())
        if not leases:
            return
        reply = self._owner.scripts.renew(
            keys=[key for _, key in leases],
            args=[*(token for token, _ in leases), self._owner.lock_ttl_ms],
        )
        for (token, lock_key), renewed in zip(leases, reply, strict=True):
            if renewed == 1:
                continue
            with self._mutex:
                still_held = self._leases.pop(token, None) is not None
            if still_held:
                logger.warning(
                    "lost sequential lock %s (token %s): it expired or was taken over while "
                    "its run continues",
                    lock_key,
                    token,
                )
