"""Per-tenant fan-out: the body of a per-tenant job's wrapper actor.

A job declared ``per_tenant=True`` is started (dispatch, event, cron tick,
boot) as a *wrapper* message, actor ``f"{qualified_name}:fanout"``. One
attempt of the wrapper:

1. calls ``get_active_tenant_ids`` (sync, ``async def``, or returning an
   async iterable) and validates its output completely (:func:`tenant_ids`):
   an iterable that is not a string, of valid tenant ids (non-empty strings of
   at most 256 bytes without control characters); duplicates
   collapse, first-seen order kept. Anything else raises
   :class:`~kumiko_dramatiq.errors.TenantListError` (naming the job and the
   bad value) before any child is enqueued. So does a resolver that raises:
   either way the attempt fails and the ``Retries`` middleware retries the
   wrapper on the same message id, like any failure;
2. enqueues one child per tenant, :data:`CHILD_BATCH_SIZE` children per
   Lua call (:meth:`KumikoBroker.enqueue_guarded_batch`; every child passes
   the broker's ``before_enqueue``/``after_enqueue``). A child's id is
   :func:`~kumiko_dramatiq.ids.child_message_id` (wrapper id, tenant id); the
   script sets its guard ``keys.enqueue_guard(prefix, child_id)`` (``SET NX
   PX``, value = the wrapper id, TTL ``retention.completed_age_s * 1000`` ms)
   and writes the message, or does nothing for that child if the guard
   exists.

A wrapper that runs again with the same id (a retry after failing midway, a
redelivery after a worker crash, the same message enqueued twice) therefore
enqueues only the children it has not enqueued yet; a new dispatch has a new
wrapper id and fans out again. ``JobRunner`` refuses a per-tenant job whose
worst-case retry window is not below ``completed_age_s``, so the guards
outlive every retry of their wrapper.

A child is built by :func:`~kumiko_dramatiq.messages.build_message` with
``trigger="fanout"`` and ``tenant_id``: it carries ``build_message_options``
(its own retries, counted from attempt 1), ``kumiko_tenant_id`` and the
wrapper's payload. It inherits the wrapper's ``kumiko_scheduled_at`` (a cron
tick's children know their tick) and its origin id (``kumiko_origin_id``: the
id the dispatch returned finds the children's runs) and nothing else: not its
``kumiko_dedup_key`` (a dedup key covers the wrapper only) nor its spent
attempts. Locking of sequential children is the ``Sequential`` middleware's
business (per child, i.e. per tenant); wrappers are never locked.

A wrapper that is a batch child (``dispatch_batch``), or of a job that declares
``on_complete``/``on_success`` (each dispatch a batch of its own, begun by the wrapper's
first attempt, id = the wrapper's), has its children join that batch before they are
enqueued, and they carry it: the batch ends when the wrapper and every tenant child ended
(:mod:`kumiko_dramatiq.workflows.batches`).

Redis keys written: ``keys.enqueue_guard`` per child, plus the queue's
message hash and list (through the script). Never deleted by kumiko: a guard
expires after ``completed_age_s``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, Iterator, Sequence
from datetime import datetime
from typing import Any

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.errors import TenantListError
from kumiko_dramatiq.ids import child_message_id
from kumiko_dramatiq.limits import tenant_id_problem
from kumiko_dramatiq.messages import build_message
from kumiko_dramatiq.registry import JobDefinition
from kumiko_dramatiq.worker.execution import Execution
from kumiko_dramatiq.worker.runtime import Runtime

logger = logging.getLogger("kumiko_dramatiq")

#: Children enqueued per Lua call (one round trip). 10,000 tenants cost 20 calls.
CHILD_BATCH_SIZE = 500

_RESOLVER = "get_active_tenant_ids()"


def fan_out(runtime: Runtime, execution: Execution, payload: dict[str, Any]) -> None:
    """Run one attempt of the wrapper ``execution``: resolve, validate, enqueue children.

    Raises (failing the attempt) when the resolver raises or returns bad
    output, and when Redis fails mid-way; a later attempt skips the children
    already enqueued.
    """
    job = execution.job
    wrapper_id = execution.message_id
    batch = execution.options.batch
    if batch is None and job.has_callbacks:
        batch = runtime.batches.begin(job, wrapper_id, payload)
    tenants = tenant_ids(job.qualified_name, _resolve(runtime))
    if not tenants:
        logger.info(
            "%s wrapper %s: no active tenants, nothing to fan out", job.qualified_name, wrapper_id
        )
        return
    fresh = enqueue_children(
        runtime,
        job,
        wrapper_id,
        payload,
        tenants,
        scheduled_at=execution.options.scheduled_at,
        origin_id=execution.origin_id,
        batch=batch,
        priority=execution.options.priority,
    )
    logger.info(
        "%s wrapper %s fanned out to %d tenant(s): %d newly enqueued, %d already enqueued",
        job.qualified_name,
        wrapper_id,
        len(tenants),
        fresh,
        len(tenants) - fresh,
    )


def tenant_ids(job_name: str, resolved: Any) -> list[str]:
    """Validate what ``get_active_tenant_ids`` returned for ``job_name``.

    Returns the ids without duplicates, in first-seen order. Raises
    :class:`TenantListError` when ``resolved`` is a string (or bytes), is not
    iterable, or yields anything but a non-empty ``str``; the error names the
    job, the position of the bad value and the value.
    """
    if isinstance(resolved, str | bytes | bytearray | memoryview):
        raise TenantListError(
            job_name, _RESOLVER, "must return an iterable of tenant ids, not a string", resolved
        )
    try:
        iterator = iter(resolved)
    except TypeError:
        raise TenantListError(
            job_name, _RESOLVER, "must return an iterable of tenant ids", resolved
        ) from None
    unique: dict[str, None] = {}
    for index, tenant in enumerate(iterator):
        problem = tenant_id_problem(tenant)
        if problem is not None:
            raise TenantListError(job_name, f"{_RESOLVER}[{index}]", problem, tenant)
        unique.setdefault(tenant, None)
    return list(unique)


def batches(items: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    """Consecutive slices of ``items`` of at most ``size`` (> 0) elements."""
    if size <= 0:
        raise ValueError(f"batch size must be positive, got {size}")
    for start in range(0, len(items), size):
        yield items[start : start + size]


def enqueue_children(
    runtime: Runtime,
    job: JobDefinition,
    wrapper_id: str,
    payload: dict[str, Any],
    tenants: Sequence[str],
    *,
    scheduled_at: datetime | None = None,
    origin_id: str | None = None,
    batch: str | None = None,
    priority: int | None = None,
) -> int:
    """Enqueue the child of each tenant not enqueued before; return how many were new.

    One Lua call (round trip) per :data:`CHILD_BATCH_SIZE` tenants (read at
    call time). A failure raises after the earlier batches were enqueued;
    their guards make the next attempt skip them. Each child takes ``priority`` (the
    wrapper's; ``None``: the job's) and its tenant as its fair key. With ``batch`` the
    children join that batch first, chunk by chunk (``lua/batch_join.lua``), before they are
    enqueued: the wrapper is a child itself until it ends, so the batch cannot end in
    between.
    """
    prefix = runtime.queue_prefix
    fresh = 0
    for chunk in batches(tenants, CHILD_BATCH_SIZE):
        messages, guards = [], []
        for tenant in chunk:
            child_id = child_message_id(wrapper_id, tenant)
            messages.append(
                build_message(
                    job,
                    payload,
                    queue_prefix=prefix,
                    trigger="fanout",
                    message_id=child_id,
                    tenant_id=tenant,
                    scheduled_at=scheduled_at,
                    origin_id=origin_id,
                    batch=batch,
                    priority=priority,
                )
            )
            guards.append(keys.enqueue_guard(prefix, child_id))
        if batch is not None:  # counted by origin and tenant (lua/include/batch.lua)
            runtime.batches.join(batch, [f"{origin_id or wrapper_id}/{tenant}" for tenant in chunk])
        fresh += sum(
            runtime.broker.enqueue_guarded_batch(
                messages,
                guards,
                guard_ttl_ms=runtime.settings.retention.completed_age_s * 1000,
                guard_value=wrapper_id,
            )
        )
    return fresh


def _resolve(runtime: Runtime) -> Any:
    resolved = runtime.resolve_tenants()
    if isinstance(resolved, AsyncIterable) and not hasattr(resolved, "__iter__"):
        return runtime.loop.run(_collect(resolved))
    return resolved


async def _collect(items: AsyncIterable[Any]) -> list[Any]:
    return [item async for item in items]
