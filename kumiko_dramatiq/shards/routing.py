"""Which shard a message lives in: pure functions, no Redis.

- A job whose guarantees span all its messages, a *pinned* job (capped or rate-limited,
  sequential, boot-once, cron), lives in the shard of its name.
- A keyed message (a dedup key, an idempotency key) lives in the shard of its job and key.
- A batch or chain lives, with every child and callback, in one shard: that of its pinned
  jobs if it has any (they must agree), of its idempotency key if given, else any.
- Anything else is spread: its id is drawn so that it hashes to the shard chosen (the
  shards in turn), so a message's id names its shard (:func:`shard_of_id`) and lookups by id
  read one shard first.
"""

from __future__ import annotations

import zlib
from typing import Final

from kumiko_dramatiq.cron import Cron
from kumiko_dramatiq.messages import new_message_id
from kumiko_dramatiq.registry import JobDefinition

#: What joins a shard's number to the dataset's queue prefix (shard 0 keeps the prefix).
SHARD_SEPARATOR: Final = ".shard"


def shard_prefix(queue_prefix: str, shard: int) -> str:
    """The queue prefix of ``shard`` of the dataset ``queue_prefix``: the prefix itself for
    shard 0 (a dataset that grows from 1 shard keeps its data), ``f"{prefix}.shard{i}"``
    after it (a name no other dataset of the same Redis may take)."""
    return queue_prefix if shard == 0 else f"{queue_prefix}{SHARD_SEPARATOR}{shard}"


def shard_of(key: str, shards: int) -> int:
    """The shard of a routing key: CRC-32 of its UTF-8 bytes, modulo ``shards``."""
    return zlib.crc32(key.encode()) % shards


def shard_of_id(message_id: str, shards: int) -> int:
    """The shard a message id drawn by :func:`new_id_in` names."""
    return shard_of(message_id, shards)


def new_id_in(shard: int, shards: int) -> str:
    """A random message id (:func:`~kumiko_dramatiq.messages.new_message_id`) that hashes to
    ``shard``: ``shards`` draws on average (one when there is one shard)."""
    if shards == 1:
        return new_message_id()
    while True:
        message_id = new_message_id()
        if shard_of(message_id, shards) == shard:
            return message_id


def is_pinned(job: JobDefinition) -> bool:
    """Whether all of ``job``'s messages must live in one shard: its cap or rate limit, its
    sequential lock, its boot-once marker or its cron ticks span them."""
    options = job.options
    return (
        job.is_capped
        or options.concurrency == "sequential"
        or options.run_on_boot
        or isinstance(options.trigger, Cron)
    )


def pinned_shard(job: JobDefinition, shards: int) -> int | None:
    """The shard of a pinned job (the shard of its qualified name), ``None`` for others."""
    return shard_of(job.qualified_name, shards) if is_pinned(job) else None


def keyed_shard(job: JobDefinition, key: str, shards: int) -> int:
    """The shard of ``job``'s message keyed ``key`` (a dedup or idempotency key): the job's
    own when it is pinned, else that of the job and key."""
    pinned = pinned_shard(job, shards)
    return pinned if pinned is not None else shard_of(f"{job.qualified_name}\n{key}", shards)
