"""Pure deterministic message-id functions.

Every id is a UUID5 over an unambiguous encoding (a JSON array) of its
inputs, so no choice of strings can make two different inputs collide the
way naive ``f"{a}:{b}"`` joining does.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import UTC, datetime
from typing import Final

_NAMESPACE = uuid.UUID("6f1c1d2e-8a43-5b7e-9c1a-4b5d8e2f7a90")
_NAMESPACE_BYTES: Final = _NAMESPACE.bytes
#: ``json.dumps(..., ensure_ascii=False)`` built once (``dumps`` builds an encoder per call
#: when given an option); holds no state between calls.
_JSON: Final = json.JSONEncoder(ensure_ascii=False)
#: The version (5) and RFC 4122 variant bits of a UUID5, and the bits they replace.
_UUID5_KEEP: Final = ~((0xF000 << 64) | (0xC000 << 48)) & ((1 << 128) - 1)
_UUID5_SET: Final = (5 << 76) | (0x8000 << 48)


def _uuid5(*parts: str) -> str:
    """``str(uuid.uuid5(_NAMESPACE, json.dumps(list(parts), ensure_ascii=False)))``, the same
    string for the same parts (a unit test compares them), built without ``uuid.UUID``:
    every enqueue derives its redis id here (:func:`redis_message_id`), and the ``UUID``
    object and ``dumps``'s per-call encoder were most of its cost."""
    name = _JSON.encode(list(parts)).encode("utf-8")
    digest = hashlib.sha1(_NAMESPACE_BYTES + name, usedforsecurity=False).digest()
    bits = int.from_bytes(digest[:16], "big") & _UUID5_KEEP | _UUID5_SET
    hex_ = f"{bits:032x}"
    return f"{hex_[:8]}-{hex_[8:12]}-{hex_[12:16]}-{hex_[16:20]}-{hex_[20:]}"


def child_message_id(wrapper_message_id: str, tenant_id: str) -> str:
    """Id of the child that wrapper ``wrapper_message_id`` enqueues for ``tenant_id``."""
    return _uuid5("child", wrapper_message_id, tenant_id)


def added_child_id(adder_message_id: str, n: int) -> str:
    """Id of the ``n``-th child (1-based) that a running batch child ``adder_message_id`` adds
    to its batch (``ctx.batch.add``): a run that runs again adds the same children."""
    return _uuid5("batch-add", adder_message_id, str(n))


def boot_message_id(job_name: str, queue_prefix: str, generation: int = 0) -> str:
    """The fixed id of a ``run_on_boot`` job in a dataset: one per ``generation`` (how many
    times ``reset-boot`` reset it; 0 before the first reset), so a run after a reset never
    overwrites the run records of the one before."""
    if generation == 0:
        return _uuid5("boot", queue_prefix, job_name)
    return _uuid5("boot", queue_prefix, job_name, str(generation))


def cron_tick_id(job_name: str, fire_time: datetime) -> str:
    """The id of the message of tick ``fire_time`` (aware) of cron job ``job_name``."""
    if fire_time.tzinfo is None:
        raise ValueError("fire_time must be timezone-aware")
    instant = fire_time.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return _uuid5("cron", job_name, instant)


def schedule_tick_id(schedule_id: str, tick_ms: int) -> str:
    """The id of the message of tick ``tick_ms`` (ms since the epoch) of runtime schedule
    ``schedule_id``."""
    return _uuid5("schedule", schedule_id, str(tick_ms))


def handoff_message_id(message_id: str) -> str:
    """The id of the message that sequential message ``message_id`` hands off to
    when it finds its lock held.

    Deterministic, so a redelivery of the same message (a crash after the
    hand-off, before the ack) finds the hand-off already made. A message is
    acked right after its hand-off, so it never needs a second one.
    """
    return _uuid5("requeue", message_id)


def redis_message_id(message_id: str, attempt: int | None = None) -> str:
    """The redis id kumiko writes a kumiko message under (Dramatiq draws a random one): its
    first write (``attempt`` ``None``), or the retry that starts ``attempt`` (>= 2).

    Derived from the message id, so that ``cancel`` finds a queued message by its id among a
    handful of candidates (:func:`redis_id_candidates`) instead of searching its queue, and no
    index has to be written on the hot path. Every live copy of a message id has its own:
    a retry is a new attempt, and a first write happens once per id (a deterministic id sits
    behind its guard).
    """
    return _uuid5("redis", message_id, "" if attempt is None else str(attempt))


def handoff_redis_id(origin_id: str, current_redis_id: str) -> str:
    """The redis id of a sequential hand-off of work first dispatched as ``origin_id``, made
    by the delivery whose redis id is ``current_redis_id``: one of two ids per origin, never
    the current one (the ack that writes the hand-off deletes the current message). So a
    hand-off, whose own message id is new at every hand-off, is found by its origin id."""
    first, second = (_uuid5("redis-handoff", origin_id, side) for side in ("0", "1"))
    return second if current_redis_id == first else first


def redis_id_candidates(message_id: str, last_recorded_attempt: int) -> list[str]:
    """Every redis id a waiting or running copy of ``message_id`` (or of a sequential hand-off
    whose origin it is) can have, given its last attempt with a run record (0: none): its
    first write, the retry after that attempt and the one after it (a retry written while the
    caller read), and the two hand-off ids. At most five, however often it was retried."""
    retries = (n for n in (last_recorded_attempt + 1, last_recorded_attempt + 2) if n >= 2)
    return [
        redis_message_id(message_id),
        *(redis_message_id(message_id, n) for n in retries),
        *(_uuid5("redis-handoff", message_id, side) for side in ("0", "1")),
    ]
