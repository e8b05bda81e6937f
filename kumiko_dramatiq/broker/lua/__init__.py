"""kumiko's Lua scripts: one ``<name>.lua`` file per script, one registry per broker.

Every script file starts with a comment header that names its ``KEYS`` and ``ARGV`` and what
it returns. A line ``-- @include <piece>`` pulls in the shared piece ``include/<piece>.lua`` (once,
before the script's own code; pieces may include pieces). Two calling conventions:

- **broker commands** include ``dispatch``: ``KEYS[1]`` is Dramatiq's namespace and
  ``ARGV[1..6]`` queue, now, worker id, heartbeat timeout, dead-message TTL and a maintenance
  flag, as Dramatiq's own dispatch script takes them; they write Dramatiq's Redis layout and
  are called only by :mod:`kumiko_dramatiq.broker`. Dramatiq's own commands (``enqueue``,
  ``fetch``, ``ack``, ``nack``, ``requeue``, ``purge``, ``qsize``) behave exactly as
  Dramatiq's; kumiko's lane queues use ``fetch_lane`` and ``settle``, which add the poison
  message bound, the run history, the "already completed" markers and the ack-with-retry;
  delayed messages wait on a schedule by due time (``include/enqueue.lua``), due ones move
  onto their queue by ``move``, and ``schedule_legacy`` moves what an older writer left on
  Dramatiq's delay queue list onto the schedule;
- **enqueue steps** (scripts that write a message together with kumiko's own records):
  ``KEYS[1]`` the queue's message hash, ``KEYS[2]`` its list, ``ARGV[1]`` the redis message
  id, ``ARGV[2]`` the encoded message; their own keys and arguments follow. They run through
  :meth:`kumiko_dramatiq.broker.KumikoBroker.enqueue_step`.

:class:`LuaScripts` registers every script on a client (``EVALSHA``, loaded again only when
the server lost it); ``broker.lua.<name>(keys=..., args=...)`` runs one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from functools import cache
from importlib import resources

import redis
from redis.commands.core import Script

_INCLUDE = re.compile(r"^-- @include ([a-z_]+)\s*$", re.MULTILINE)


def _read(path: str) -> str:
    return resources.files(__package__).joinpath(f"{path}.lua").read_text(encoding="utf-8")


@cache
def source(name: str) -> str:
    """The full text of script ``name``: its includes (depth first, each once), then itself."""
    seen: list[str] = []

    def collect(path: str) -> None:
        for included in _INCLUDE.findall(_read(path)):
            piece = f"include/{included}"
            if piece not in seen:
                collect(piece)
                seen.append(piece)

    collect(name)
    parts = [_read(piece) for piece in seen]
    return "\n".join([*parts, _read(name)])


@dataclass(frozen=True)
class LuaScripts:
    """Every kumiko script, registered on one client. Field name = file name."""

    # broker commands (Dramatiq's layout)
    enqueue: Script
    fetch: Script
    fetch_lane: Script
    ack: Script
    settle: Script
    move: Script
    schedule_legacy: Script
    nack: Script
    requeue: Script
    purge: Script
    qsize: Script
    # enqueue steps
    guarded_enqueue: Script
    guarded_enqueue_batch: Script
    boot_once: Script
    cron_tick: Script
    dedup_dispatch: Script
    dedup_dispatch_batch: Script
    dedup_handover: Script
    # other kumiko records
    dedup_mark_running: Script
    dedup_requeue: Script
    dedup_finish: Script
    lock_acquire: Script
    lock_renew: Script
    lock_release: Script
    slot_release: Script
    run_put: Script
    # operating
    cancel: Script
    move_now: Script
    retry_dead: Script
    resume: Script
    count_attempt: Script
    runs_from: Script
    purge_step: Script
    delete_dead: Script
    counts_backfill: Script
    # the start-up check of a user's permissions
    probe: Script

    @classmethod
    def register(cls, client: redis.Redis) -> LuaScripts:
        return cls(**{f.name: client.register_script(source(f.name)) for f in fields(cls)})

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


_CALL = re.compile(r'redis\.p?call\("([a-z]+)"')


def commands() -> list[str]:
    """Every Redis command kumiko's scripts run (the probe's own excepted), sorted."""
    found: set[str] = set()
    for name in LuaScripts.names():
        if name != "probe":
            found.update(_CALL.findall(source(name)))
    return sorted(found)
