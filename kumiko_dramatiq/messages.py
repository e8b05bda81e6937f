"""Building the Dramatiq message of a job: the one door every enqueue path uses.

:func:`build_message` always merges :func:`~kumiko_dramatiq.options.build_message_options`, so
no enqueue path (dispatch, event, cron tick, boot-once, per-tenant wrapper and child, sequential
hand-off, dedup follow-up) can forget the retry policy. The per-message options it writes
(trigger, spent failures, tenant, dedup key, cron tick) are encoded by
:mod:`kumiko_dramatiq.codec`. What a caller hands in is checked by
:mod:`kumiko_dramatiq.limits`.
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any, Final

from dramatiq.message import Message

from kumiko_dramatiq.codec import encode_run
from kumiko_dramatiq.context import Trigger
from kumiko_dramatiq.options import build_message_options
from kumiko_dramatiq.registry import JobDefinition

#: The version (4) and RFC 4122 variant bits of a UUID4, and the bits they replace.
_UUID4_KEEP: Final = ~((0xF000 << 64) | (0xC000 << 48)) & ((1 << 128) - 1)
_UUID4_SET: Final = (4 << 76) | (0x8000 << 48)


def new_message_id() -> str:
    """A random message id: what Dramatiq's ``generate_unique_id`` draws
    (``str(uuid.uuid4())``: 122 random bits from ``os.urandom``), without building a
    ``uuid.UUID``, at about half its cost (every dispatch draws one)."""
    bits = int.from_bytes(os.urandom(16), "big") & _UUID4_KEEP | _UUID4_SET
    hex_ = f"{bits:032x}"
    return f"{hex_[:8]}-{hex_[8:12]}-{hex_[12:16]}-{hex_[16:20]}-{hex_[20:]}"


def build_message(
    job: JobDefinition,
    payload: dict[str, Any],
    *,
    queue_prefix: str,
    trigger: Trigger,
    message_id: str | None = None,
    tenant_id: str | None = None,
    failures: int = 0,
    dedup_key: str | None = None,
    scheduled_at: datetime | None = None,
    origin_id: str | None = None,
    batch: str | None = None,
    batch_callback: str | None = None,
    priority: int | None = None,
    fair_key: str | None = None,
) -> Message[Any]:
    """The message that runs ``job`` once with ``payload``.

    A per-tenant job without ``tenant_id`` gets its wrapper actor; with one, the job's own
    actor (a child). ``failures`` carries spent attempts (a sequential hand-off keeps them;
    a retry is a copy, not a new build). ``origin_id``: the id the caller got back, when this
    message carries on another's work (a hand-off, a per-tenant child); ``None`` = its own.
    ``batch``: the batch or chain step it is a child of; ``batch_callback``: the batch it is a
    callback of (:mod:`kumiko_dramatiq.workflows.batches`). ``priority``: the message's own
    (``None``: the job's); ``fair_key``: the key it takes its turn under (a child without one
    takes its tenant's), both checked by the caller (:mod:`kumiko_dramatiq.limits`).
    """
    options = {
        **build_message_options(job),
        **encode_run(
            trigger,
            failures=failures,
            tenant_id=tenant_id,
            dedup_key=dedup_key,
            scheduled_at=scheduled_at,
            origin_id=origin_id,
            batch=batch,
            batch_callback=batch_callback,
            priority=job.options.priority if priority is None else priority,
            fair_key=fair_key,
        ),
    }
    is_wrapper = job.options.per_tenant and tenant_id is None
    return Message(
        queue_name=job.queue_name(queue_prefix),
        actor_name=job.wrapper_actor_name if is_wrapper else job.qualified_name,
        args=(payload,),
        kwargs={},
        options=options,
        message_id=new_message_id() if message_id is None else message_id,
    )
