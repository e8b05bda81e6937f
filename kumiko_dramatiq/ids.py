"""Pure deterministic message-id functions.

Every id is a UUID5 over an unambiguous encoding (a JSON array) of its
inputs, so no choice of strings can make two different inputs collide the
way naive ``f"{a}:{b}"`` joining does.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

_NAMESPACE = uuid.UUID("6f1c1d2e-8a43-5b7e-9c1a-4b5d8e2f7a90")


def _uuid5(*parts: str) -> str:
    return str(uuid.uuid5(_NAMESPACE, json.dumps(list(parts), ensure_ascii=False)))


def child_message_id(wrapper_message_id: str, tenant_id: str) -> str:
    """Id of the child that wrapper ``wrapper_message_id`` enqueues for ``tenant_id``."""
    return _uuid5("child", wrapper_message_id, tenant_id)


def boot_message_id(job_name: str, queue_prefix: str) -> str:
    """The one fixed id of a ``run_on_boot`` job in a dataset."""
    return _uuid5("boot", queue_prefix, job_name)


def cron_tick_id(job_name: str, fire_time: datetime) -> str:
    """The id of the message of tick ``fire_time`` (aware) of cron job ``job_name``."""
    if fire_time.tzinfo is None:
        raise ValueError("fire_time must be timezone-aware")
    instant = fire_time.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return _uuid5("cron", job_name, instant)


def handoff_message_id(message_id: str) -> str:
    """The id of the message that sequential message ``message_id`` hands off to
    when it finds its lock held.

    Deterministic, so a redelivery of the same message (a crash after the
    hand-off, before the ack) finds the hand-off already made. A message is
    acked right after its hand-off, so it never needs a second one.
    """
    return _uuid5("requeue", message_id)
