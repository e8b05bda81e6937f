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

**The hot path runs as Redis functions.** The scripts of :data:`FUNCTIONS` (an enqueue, a
lane fetch, a settle: every job passes them) are served from one function library
(:func:`library`, ``FUNCTION LOAD`` once per server, ``FCALL`` per call) instead of
``EVALSHA``. A script's code runs whole on every ``EVALSHA``: each call defines its includes'
dozens of functions again (a closure each, with their upvalues) before it does anything,
about 67,000 of Redis's instructions per settle call, 11,000 per enqueue. A library defines
them once, at load. Their source is the same file either way: what an include must do on
every call (read the call's ``KEYS`` and ``ARGV``, start a call's caches afresh) sits
between ``-- @per-call`` and ``-- @end per-call`` lines, each statement of it a ``local``
with a value; as a script it runs where it stands, in the library it becomes a function
each ``FCALL`` runs first. The library is named after a hash of its code
(``kumikofn_<hash>``), so workers of two versions share a server during a rolling upgrade,
and a server that lost it (a restart without persistence, ``FUNCTION FLUSH``) is given it
again on the first call that misses it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from functools import cache
from importlib import resources
from typing import Any, Final

import redis
from redis.commands.core import Script

_INCLUDE = re.compile(r"^-- @include ([a-z_]+)\s*$", re.MULTILINE)


def _read(path: str) -> str:
    return resources.files(__package__).joinpath(f"{path}.lua").read_text(encoding="utf-8")


def _pieces(name: str, read: Callable[[str], str]) -> list[str]:
    """The include pieces of script ``name``, depth first, each once."""
    seen: list[str] = []

    def collect(path: str) -> None:
        for included in _INCLUDE.findall(read(path)):
            piece = f"include/{included}"
            if piece not in seen:
                collect(piece)
                seen.append(piece)

    collect(name)
    return seen


@cache
def source(name: str) -> str:
    """The full text of script ``name``: its includes (depth first, each once), then itself."""
    return "\n".join([*(_read(piece) for piece in _pieces(name, _read)), _read(name)])


#: The scripts served as Redis functions (see the module docstring): every job runs them.
FUNCTIONS: Final[tuple[str, ...]] = ("guarded_enqueue", "fetch_lane", "settle")

_PER_CALL = re.compile(r"^-- @per-call\n(.*?)^-- @end per-call\n", re.MULTILINE | re.DOTALL)
_LOCAL = re.compile(r"^local (\w+(?:, \w+)*) =", re.MULTILINE)
_TOP_LOCAL = re.compile(r"^local (?:function )?(\w+(?:, \w+)*)", re.MULTILINE)


@dataclass(frozen=True)
class Library:
    """A Redis function library of kumiko's scripts: ``code`` for ``FUNCTION LOAD``, and the
    function name of each script."""

    name: str
    code: str
    functions: dict[str, str]


def _per_call(piece: str, text: str) -> tuple[str, list[str]]:
    """``text`` of include ``piece`` as the library holds it, and the names of the functions
    that do its per-call parts: each region's variables declared where it stood, its
    statements (``local`` dropped) in a function of the same place."""
    calls: list[str] = []

    def rewrite(found: re.Match[str]) -> str:
        region = found.group(1)
        names = [n for group in _LOCAL.findall(region) for n in group.split(", ")]
        statements = len(re.findall(r"^local ", region, re.MULTILINE))
        if "local function" in region or len(_LOCAL.findall(region)) != statements:
            raise ValueError(f"{piece}: a per-call region holds only `local <names> = ...`")
        function = f"per_call_{piece.removeprefix('include/')}_{len(calls) + 1}"
        calls.append(function)
        body = re.sub(r"^local ", "", region, flags=re.MULTILINE)
        return f"local {', '.join(names)}\nlocal function {function}()\n{body}end\n"

    return _PER_CALL.sub(rewrite, text), calls


@cache
def library(names: tuple[str, ...] = FUNCTIONS, read: Callable[[str], str] = _read) -> Library:
    """The function library of scripts ``names`` (their sources from ``read``, a script's
    or include's path without ``.lua`` -> its text): every include once, then one function
    per script that starts a call (``KEYS``, ``ARGV``, its includes' per-call parts in their
    order) and runs the script's own code. Two includes that declare the same name, or a
    per-call region that is not made of ``local`` statements, are refused (``ValueError``)."""
    pieces: list[str] = []
    for name in names:
        pieces += [piece for piece in _pieces(name, read) if piece not in pieces]
    texts: list[str] = []
    calls: dict[str, list[str]] = {}
    declared: dict[str, str] = {}
    for piece in pieces:
        text, calls[piece] = _per_call(piece, read(piece))
        for group in _TOP_LOCAL.findall(text):
            for local in group.split(", "):
                if declared.setdefault(local, piece) != piece:
                    raise ValueError(f"{piece} and {declared[local]} both declare {local}")
        texts.append(text)
    digest = hashlib.sha1("\n".join([*texts, *(read(n) for n in names)]).encode()).hexdigest()
    lib = f"kumikofn_{digest[:12]}"
    functions = {name: f"{lib}_{name}" for name in names}
    parts = [f"#!lua name={lib}", "local KEYS, ARGV", *texts]
    for name in names:
        starts = [call for piece in _pieces(name, read) for call in calls[piece]]
        parts += [
            f"redis.register_function({functions[name]!r}, function(keys, args)",
            "KEYS, ARGV = keys, args",
            *(f"{call}()" for call in starts),
            read(name),
            "end)",
        ]
    return Library(lib, "\n".join(parts), functions)


def _missing(exc: redis.ResponseError) -> bool:
    return str(exc).startswith("Function not found")


class LuaFunction:
    """A script of :data:`FUNCTIONS`, called as redis-py's ``Script`` is
    (``(keys=..., args=..., client=None)``), run by ``FCALL``; the library is loaded
    (``FUNCTION LOAD REPLACE``) when the server does not hold it."""

    def __init__(self, client: redis.Redis, name: str, lib: Library) -> None:
        self.registered_client = client
        self.library = lib
        self.name = lib.functions[name]

    def load(self, client: redis.Redis) -> None:
        client.function_load(self.library.code, replace=True)

    def call(self, client: redis.Redis, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """``FCALL`` on ``client``: its command sent as it is, loading the library if the
        server misses it."""
        command = client.execute_command
        try:
            return command("FCALL", self.name, len(keys), *keys, *args)  # type: ignore[no-untyped-call]
        except redis.ResponseError as exc:
            if not _missing(exc):
                raise
        self.load(client)
        return command("FCALL", self.name, len(keys), *keys, *args)  # type: ignore[no-untyped-call]

    def __call__(
        self,
        keys: Sequence[Any] = (),
        args: Sequence[Any] = (),
        client: redis.Redis | None = None,
    ) -> Any:
        return self.call(client or self.registered_client, keys, args)


@dataclass(frozen=True)
class LuaScripts:
    """Every kumiko script, registered on one client. Field name = file name."""

    # broker commands (Dramatiq's layout)
    enqueue: Script
    fetch: Script
    fetch_lane: LuaFunction
    ack: Script
    settle: LuaFunction
    move: Script
    schedule_legacy: Script
    nack: Script
    requeue: Script
    purge: Script
    qsize: Script
    # enqueue steps
    guarded_enqueue: LuaFunction
    guarded_enqueue_batch: Script
    idempotent_enqueue: Script
    idempotent_enqueue_batch: Script
    boot_once: Script
    cron_tick: Script
    schedule_fire_batch: Script
    dedup_dispatch: Script
    dedup_debounce: Script
    dedup_dispatch_batch: Script
    dedup_handover: Script
    # other kumiko records
    dedup_mark_running: Script
    dedup_requeue: Script
    dedup_finish: Script
    lock_acquire: Script
    lock_renew: Script
    lock_release: Script
    schedule_write: Script
    slot_release: Script
    run_put: Script
    # holds: what a worker claimed ahead of its threads (broker/holds.py)
    hold_renew: Script
    hold_answer: Script
    hold_takeover: Script
    hold_ask_job: Script
    hold_ask: Script
    # batches and chains (workflows/batches.py)
    batch_dispatch: Script
    batch_write: Script
    batch_commit: Script
    batch_add: Script
    batch_join: Script
    batch_begin: Script
    batch_cancel: Script
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
        lib = library()
        each: dict[str, Any] = {
            f.name: LuaFunction(client, f.name, lib)
            if f.name in FUNCTIONS
            else client.register_script(source(f.name))
            for f in fields(cls)
        }
        return cls(**each)

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
