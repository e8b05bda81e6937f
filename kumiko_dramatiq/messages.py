"""Building the Dramatiq message of a job: the one door every enqueue path uses.

:func:`build_message` always merges :func:`build_message_options`, so no
enqueue path (dispatch, event, cron tick, boot-once, per-tenant wrapper and
child, sequential re-enqueue) can forget the retry policy.

Kumiko's own message option keys (``kumiko_`` prefix, JSON-native):

``kumiko_trigger``    how the message came to be (``JobMeta.trigger``)
``kumiko_failures``   failed attempts already spent (absent = 0)
``kumiko_tenant_id``  tenant of a per-tenant child
``kumiko_dedup_key``  the dedup key the message holds
``kumiko_scheduled_at`` ISO-8601 tick of a cron message
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dramatiq.message import Message, generate_unique_id

from .context import JobMeta, Trigger
from .errors import PayloadError
from .options import build_message_options
from .registry import JobDefinition

WRAPPER_SUFFIX = ":fanout"


def wrapper_actor_name(job: JobDefinition) -> str:
    """Actor name of a per-tenant job's fan-out wrapper (contains the qualified name)."""
    return job.qualified_name + WRAPPER_SUFFIX


def queue_name(queue_prefix: str, job: JobDefinition) -> str:
    """The lane queue of ``job``: ``f"{queue_prefix}-{run_in}"``."""
    return f"{queue_prefix}-{job.options.run_in}"


def build_message(
    job: JobDefinition,
    payload: dict[str, Any],
    *,
    queue_prefix: str,
    trigger: Trigger,
    message_id: str | None = None,
    tenant_id: str | None = None,
    failures: int = 0,
    extra_options: Mapping[str, Any] | None = None,
) -> Message[Any]:
    """The message that runs ``job`` once with ``payload``.

    A per-tenant job without ``tenant_id`` gets its wrapper actor; with one,
    the job's own actor (a child). ``failures`` carries spent attempts (a
    sequential re-enqueue keeps them; a retry is a copy, not a new build).
    """
    options: dict[str, Any] = {**build_message_options(job), "kumiko_trigger": trigger}
    if failures:
        options["kumiko_failures"] = failures
    if tenant_id is not None:
        options["kumiko_tenant_id"] = tenant_id
    if extra_options:
        options.update(extra_options)
    is_wrapper = job.options.per_tenant and tenant_id is None
    return Message(
        queue_name=queue_name(queue_prefix, job),
        actor_name=wrapper_actor_name(job) if is_wrapper else job.qualified_name,
        args=(payload,),
        kwargs={},
        options=options,
        message_id=generate_unique_id() if message_id is None else message_id,
    )


def meta_from_options(options: Mapping[str, Any]) -> JobMeta:
    """Read a delivered message's options back into a :class:`JobMeta`."""
    from datetime import datetime

    failures = options.get("kumiko_failures", 0)
    scheduled = options.get("kumiko_scheduled_at")
    return JobMeta(
        attempt=failures + 1,
        max_attempts=options.get("kumiko_retries", 0) + 1,
        tenant_id=options.get("kumiko_tenant_id"),
        trigger=options.get("kumiko_trigger", "manual"),
        scheduled_at=None if scheduled is None else datetime.fromisoformat(scheduled),
        dedup_key=options.get("kumiko_dedup_key"),
    )


def validate_payload(job_name: str, payload: Any) -> dict[str, Any]:
    """Return ``payload`` (``None`` -> ``{}``) if it is a JSON object of JSON
    values, else raise :class:`PayloadError` naming the job and the path."""
    if payload is None:
        return {}
    if not isinstance(payload, dict):
        raise PayloadError(job_name, "payload", "must be a JSON object (dict)", payload)
    _check_json(job_name, "payload", payload)
    return payload


def _check_json(job_name: str, path: str, value: Any) -> None:
    if value is None or isinstance(value, str | bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise PayloadError(job_name, path, "must be a finite number", value)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise PayloadError(job_name, path, "must have string keys", key)
            _check_json(job_name, f"{path}[{key!r}]", item)
        return
    if isinstance(value, list):
        for index, item in enumerate(value):
            _check_json(job_name, f"{path}[{index}]", item)
        return
    raise PayloadError(job_name, path, "must be a JSON value", value)
