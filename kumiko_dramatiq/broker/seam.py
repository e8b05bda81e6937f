"""The one seam to Dramatiq's and redis-py's internals.

Everything kumiko does that leans on more than the documented API of Dramatiq 2.2 or redis-py
lives in this module and nowhere else (``tests/unit/test_structure.py`` fails when another
module touches one of these names). Each piece has a test in ``tests/unit/test_seam.py``
that breaks when the host library changes what it relies on; see docs/upgrading.md.

1. **The broker's hook loops** (:class:`HookTable`, :func:`emit_before`,
   :func:`emit_after`): kumiko's broker emits its signals through its own loops, which keep
   Dramatiq's error handling (``Broker.emit_before``/``emit_after``) and add the guest rule
   below. They rely on a hook that a middleware does not override being the base class's
   no-op.
2. **No command fallback** (:class:`NoCommandFallback`): ``RedisBroker.__getattr__`` maps any
   unknown ``do_*`` name onto Dramatiq's own dispatch script; kumiko's broker turns that off.
3. **A worker's queues** (:func:`consumed_queues`, :func:`set_consumed_queues`): Dramatiq's
   ``Worker`` keeps the queues it consumes in ``consumer_whitelist`` (``None``: every queue),
   read by its consumer loop whenever a queue is declared.
4. **Any actor option** (:class:`AnyActorOptions`): ``dramatiq.actor`` checks
   ``set(options) - broker.actor_options``; a set whose reflected difference is empty
   accepts every option (the app loader's collector broker).
5. **The time limit's log line** (:func:`name_interruptions`): Dramatiq's ``TimeLimit``
   hands its logger to a timer (``time_limit.manager.logger``), which logs
   ``"Time limit exceeded. Raising exception in worker thread %r."`` with the thread id as
   the one argument.
6. **redis-py's argument encoder** (:func:`argument_encoder`), from ``redis._parsers``, which
   the command packer falls back on, and its error classes by reply (:func:`error_reply`),
   which the asyncio connection's reader uses.
7. **Asynchronous exceptions** (:func:`raise_in_thread`, :func:`clear_pending_in_thread`):
   CPython's ``PyThreadState_SetAsyncExc``, the mechanism Dramatiq's ``TimeLimit`` uses too,
   through ``ctypes``. An exception set for a thread is raised in it the next time it runs
   Python bytecode (not inside a blocking C call); setting ``NULL`` clears one not yet
   raised. :class:`kumiko_dramatiq.worker.interrupts.Interruptible` is built on them.
8. **A connection's socket** (:func:`has_socket`): redis-py's ``Connection._sock`` is
   ``None`` while a connection is not connected (it connects on its next command).
9. **redis-py's Sentinel connection**, which
   :class:`~kumiko_dramatiq.broker.connection.KumikoSentinelConnection` extends: it
   (re)connects through ``connect_to(address)`` with the primary's address from its pool,
   and turns a ``READONLY`` reply into a ``ConnectionError`` raised while handling it (the
   ``ReadOnlyError`` is its ``__context__``).
10. **A worker's consumer threads** (:func:`consumer_threads`, :func:`consumer_of`,
    :func:`restart_consumer`): Dramatiq's ``Worker`` keeps one ``ConsumerThread`` per queue
    in ``consumers`` (read by its worker threads on every ack: an entry is replaced, never
    removed), each with its ``consumer`` (``None`` until it runs) and ``paused`` flag
    (``Worker.pause()``: it sleeps without iterating), and built from the
    worker's ``queue_prefetch``/``delay_prefetch``, ``work_queue`` and ``worker_timeout``. A
    thread that ended (an exception its loop does not catch) is not restarted by Dramatiq.
11. **A message's copy and encoding** (:func:`copy_message`, :func:`encode_message`):
    ``Message.copy`` is ``dataclasses.replace`` with the options merged, and ``Message.encode``
    is the global encoder's ``encode`` of ``Message.asdict()`` (each field by name, in
    order); Dramatiq's ``JSONEncoder`` encodes with ``json.dumps(data, separators=(",",
    ":"))`` in UTF-8. Every enqueue copies its message once and encodes it once: these do
    the same for a plain ``Message``, at about half the cost.
12. **A consumer thread's hand-off to the worker threads** (:func:`work_handoff`): Dramatiq's
    ``ConsumerThread`` builds its consumer (``broker.consume``) in its own thread and puts
    each message it takes onto the worker's ``work_queue``, a ``PriorityQueue`` of
    ``_WorkQueueItem(actor priority, message)`` that the worker threads take from (and that
    ``Worker.stop`` requeues what is left of, once the worker threads have stopped), except
    a message with an ``eta`` (held in the thread's own delay queue) or of an unknown actor
    (failed at once).

Guests: the middleware added to a kumiko broker after it was built, and what they see.

A kumiko broker is built with kumiko's chain (:func:`kumiko_dramatiq.middleware.build_middleware`,
Dramatiq's default middleware among it). Middleware added later, such as Dramatiq's
``Prometheus``, ``Results`` or ``CurrentMessage`` or an app's own, are *guests*:
``add_middleware`` appends them after the chain, as Dramatiq appends to its defaults. Two
rules, applied by :class:`~kumiko_dramatiq.broker.KumikoBroker`:

- **a guest never sees a sequential hand-off.** A delivery whose run ``Sequential`` handed
  off to a new message (kumiko's ``Execution.handed_off``, decided in its
  ``before_process_message``) is not a processed message: it runs no handler and spends no
  attempt. So the guests get neither its ``before_process_message`` nor its
  ``after_process_message``; Dramatiq's ``Prometheus`` would otherwise count every
  hand-off as a processed message of about 0 ms (a ``SkipMessage`` would not help: it counts
  skipped messages as processed too). The message the work was handed off to is processed,
  and seen, like any other. Kumiko's chain sees every delivery. A middleware placed inside
  the chain (``add_middleware(m, before=...)`` or ``after=`` a member of the chain, or
  inserted into ``broker.middleware``) counts as part of it and sees every delivery too;
  :func:`guests_start` is where the chain ends. A guest that knows about hand-offs and wants
  them (it reads ``Execution.handoff_id``, say) sets the class attribute
  ``sees_handoffs = True``.
- **a middleware added after the process booted is booted at once** (its
  ``after_process_boot``), as if it had been there at boot: Dramatiq's ``Prometheus`` sets
  itself up there (added after ``JobRunner.start()`` it would fail on every message) and
  ``TimeLimit`` starts its timer thread there.

Everything else (enqueues, acks, nacks, worker hooks) every middleware sees, as on Dramatiq's
own brokers. The hook loops keep Dramatiq's error handling: a ``MiddlewareError`` raised by
a ``before_*`` hook propagates, any other exception is logged at CRITICAL and the loop goes
on.

Dispatch is precomputed (:class:`HookTable`): Dramatiq's broker looks up every hook of every
middleware for every signal (16 middleware, about 90 lookups and calls per message, most of
them the base class's no-ops); the table keeps, per signal, the bound hooks a middleware
actually overrides, and is rebuilt when ``broker.middleware`` changes (compared by identity
on each emit, a C-level list comparison).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Final

from dramatiq.broker import Broker, MessageProxy
from dramatiq.common import q_name
from dramatiq.encoder import JSONEncoder
from dramatiq.errors import ActorNotFound
from dramatiq.message import Message, get_encoder
from dramatiq.middleware import Middleware, MiddlewareError, TimeLimit
from dramatiq.worker import ConsumerThread, Worker, _WorkQueueItem
from redis._parsers.base import BaseParser
from redis._parsers.encoders import Encoder

#: A bound hook, with whether it is skipped for a handed-off delivery.
Hook = tuple[Middleware, Callable[..., Any], bool]


def guests_start(middleware: Sequence[Middleware], chain: Collection[int]) -> int:
    """The index of the first guest in ``middleware``: the first one after the last member
    of kumiko's chain (``chain`` holds their ``id()``)."""
    start = 0
    for index, each in enumerate(middleware):
        if id(each) in chain:
            start = index + 1
    return start


def handed_off(message: object) -> bool:
    """Whether ``message`` is a delivery whose run was handed off (``Execution.handed_off``)."""
    execution = getattr(message, "execution", None)
    return getattr(execution, "handed_off", False) is True


def sees_handoffs(middleware: Middleware) -> bool:
    """Whether a guest asked to see hand-offs (class attribute ``sees_handoffs = True``)."""
    return getattr(middleware, "sees_handoffs", False) is True


def _bound(middleware: Middleware, name: str) -> Callable[..., Any] | None:
    """``middleware``'s hook ``name``, or ``None`` when it is the base class's no-op. A
    middleware without the hook at all gets one that fails on call, as Dramatiq's loop would
    (it is logged, or propagates for a ``before_*`` hook raising ``MiddlewareError``)."""
    hook = getattr(middleware, name, None)
    if hook is None:
        return lambda *args, **kwargs: getattr(middleware, name)(*args, **kwargs)
    base = getattr(Middleware, name, None)
    if base is not None and getattr(hook, "__func__", None) is base:
        return None
    return hook  # type: ignore[no-any-return]


class HookTable:
    """The hooks of one middleware list, by signal (``before_ack``, ...), built on first use:
    in the order Dramatiq calls them (``after_*`` reversed), each with whether a handed-off
    delivery skips it (a guest that does not see hand-offs)."""

    def __init__(self, middleware: Sequence[Middleware], chain: Collection[int]) -> None:
        self.middleware = list(middleware)
        self._first_guest = guests_start(self.middleware, chain)
        self._by_signal: dict[str, tuple[Hook, ...]] = {}

    def __call__(self, signal: str) -> tuple[Hook, ...]:
        hooks = self._by_signal.get(signal)
        if hooks is None:
            order = list(enumerate(self.middleware))
            if signal.startswith("after_"):
                order.reverse()
            found = []
            for index, each in order:
                hook = _bound(each, signal)
                if hook is not None:
                    blind = index >= self._first_guest and not sees_handoffs(each)
                    found.append((each, hook, blind))
            hooks = self._by_signal[signal] = tuple(found)
        return hooks


def emit_before(broker: Broker, hooks: HookTable, signal: str, *args: Any, **kwargs: Any) -> None:
    """Dramatiq's ``emit_before`` over ``hooks``; for ``before_process_message``, a delivery
    handed off meanwhile skips the guests that do not see hand-offs."""
    process = signal == "before_process_message"
    for each, hook, blind in hooks(signal):
        if process and blind and handed_off(args[0]):
            continue
        try:
            hook(broker, *args, **kwargs)
        except MiddlewareError:
            raise
        except Exception:
            broker.logger.critical("Unexpected failure in %s of %r.", signal, each, exc_info=True)


def emit_after(broker: Broker, hooks: HookTable, signal: str, *args: Any, **kwargs: Any) -> None:
    """Dramatiq's ``emit_after`` over ``hooks``; the ``after_process_message`` of a
    handed-off delivery goes to kumiko's chain and the guests that see hand-offs."""
    skip_blind = signal == "after_process_message" and handed_off(args[0])
    for each, hook, blind in hooks(signal):
        if skip_blind and blind:
            continue
        try:
            hook(broker, *args, **kwargs)
        except Exception:
            broker.logger.critical("Unexpected failure in %s of %r.", signal, each, exc_info=True)


class NoCommandFallback:
    """Mixed into kumiko's broker before ``RedisBroker``: an attribute the broker lacks is an
    ``AttributeError``, not a command run through Dramatiq's dispatch script (every command
    kumiko supports is a method of its own)."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


def consumed_queues(worker: Worker) -> set[str] | None:
    """The queues ``worker`` consumes (``None``: every declared queue)."""
    queues: set[str] | None = worker.consumer_whitelist
    return queues


def worker_thread_count(worker: Worker) -> int:
    """How many worker threads ``worker`` runs (its ``worker_threads``)."""
    count = getattr(worker, "worker_threads", 0)
    return count if isinstance(count, int) else 0


def set_consumed_queues(worker: Worker, queues: set[str]) -> None:
    """Make ``worker`` consume ``queues`` (its consumer loop adds each when declared)."""
    worker.consumer_whitelist = queues


class AnyActorOptions(set[str]):
    """A broker's ``actor_options`` that accepts every option name: ``dramatiq.actor``
    computes ``set(options) - broker.actor_options``, which asks this reflected difference
    first."""

    def __rsub__(self, other: Any) -> set[str]:
        return set()


def name_interruptions(time_limit: TimeLimit, name: Callable[[int], str | None]) -> None:
    """Make ``time_limit``'s "time limit exceeded" line say ``name(thread id)`` instead, when
    that is not ``None`` (same logger, same level)."""
    manager = time_limit.manager
    manager.logger = _NamingLog(manager.logger, name)


class _NamingLog:
    """Stands in for the logger of a ``TimeLimit``'s timer (see :func:`name_interruptions`)."""

    def __init__(self, logger: Any, name: Callable[[int], str | None]) -> None:
        self._logger = logger
        self._name = name

    def warning(self, msg: str, *args: Any, **kwargs: Any) -> None:
        if msg.startswith("Time limit exceeded") and len(args) == 1 and isinstance(args[0], int):
            named = self._name(args[0])
            if named is not None:
                self._logger.warning("%s", named, **kwargs)
                return
        self._logger.warning(msg, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


def argument_encoder(encoding: str, errors: str) -> Callable[[Any], bytes]:
    """redis-py's encoder of command arguments (what its pure-Python packer takes)."""
    encode: Callable[[Any], bytes] = Encoder(encoding, errors, False).encode  # type: ignore[no-untyped-call]
    return encode


def error_reply(text: str) -> Exception:
    """The exception redis-py raises for the error reply ``text`` (``NOSCRIPT ...`` is a
    ``NoScriptError``, ``READONLY ...`` a ``ReadOnlyError``, ...), from ``redis._parsers``:
    the asyncio connection (:mod:`kumiko_dramatiq.aio.wire`) reads replies itself."""
    found: Exception = BaseParser.parse_error(text)  # type: ignore[no-untyped-call]
    return found


#: Dramatiq's ``JSONEncoder``'s ``json.dumps(..., separators=(",", ":"))``, built once
#: (``dumps`` builds an encoder per call when given an option); holds no state between calls.
_COMPACT_JSON: Final = json.JSONEncoder(separators=(",", ":"))


def copy_message(message: Message[Any], options: Mapping[str, Any]) -> Message[Any]:
    """``message.copy(options=options)``: the same message with ``options`` merged into its
    options, built directly for a plain ``Message``."""
    if type(message) is not Message:
        return message.copy(options=options)
    return Message(
        queue_name=message.queue_name,
        actor_name=message.actor_name,
        args=message.args,
        kwargs=message.kwargs,
        options={**message.options, **options},
        message_id=message.message_id,
        message_timestamp=message.message_timestamp,
    )


def encode_message(message: Message[Any]) -> bytes:
    """``message.encode()``: the same bytes, without ``asdict``'s field lookup and
    ``json.dumps``'s encoder per call when the global encoder is Dramatiq's ``JSONEncoder``
    and ``message`` a plain ``Message``."""
    if type(message) is not Message or type(get_encoder()) is not JSONEncoder:
        return message.encode()
    return _COMPACT_JSON.encode(
        {
            "queue_name": message.queue_name,
            "actor_name": message.actor_name,
            "args": message.args,
            "kwargs": message.kwargs,
            "options": message.options,
            "message_id": message.message_id,
            "message_timestamp": message.message_timestamp,
        }
    ).encode("utf-8")


def raise_in_thread(thread_id: int, exception: type[BaseException]) -> bool:
    """Raise ``exception`` in the thread ``thread_id`` as an asynchronous exception (CPython's
    ``PyThreadState_SetAsyncExc``): it is raised there the next time that thread runs Python
    bytecode. ``False`` when no such thread exists."""
    found = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exception)
    )
    return bool(found == 1)


def clear_pending_in_thread(thread_id: int) -> None:
    """Drop an asynchronous exception set for ``thread_id`` and not raised yet (a no-op when
    there is none)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None)


def has_socket(connection: Any) -> bool:
    """Whether a redis-py connection is connected now (``Connection._sock``)."""
    return getattr(connection, "_sock", None) is not None


def consumer_threads(worker: Worker) -> dict[str, threading.Thread]:
    """The consumer thread of each queue ``worker`` consumes (a copy)."""
    return dict(worker.consumers)


def consumer_of(thread: threading.Thread) -> Any:
    """The consumer a Dramatiq consumer thread iterates (``None`` before it runs; also
    ``None`` while the worker is paused, when the thread does not iterate on purpose)."""
    if getattr(thread, "paused", False) is True:
        return None
    return getattr(thread, "consumer", None)


def restart_consumer(worker: Worker, queue_name: str) -> None:
    """Replace ``worker``'s ended consumer thread of ``queue_name`` with a new one, started.

    The new thread takes over the old one's consumer until it builds its own, so a worker
    thread acking meanwhile finds one; the old consumer is closed (a delay-queue consumer
    puts back the delayed messages it held, or leaves them to its successor). Worker
    threads look the thread up in ``worker.consumers`` on each ack: the entry is replaced in
    one step, never missing."""
    old = worker.consumers[queue_name]
    delay = queue_name != q_name(queue_name)
    thread = ConsumerThread(
        broker=worker.broker,
        queue_name=queue_name,
        prefetch=worker.delay_prefetch if delay else worker.queue_prefetch,
        work_queue=worker.work_queue,
        worker_timeout=worker.worker_timeout,
    )
    thread.consumer = old.consumer
    if old.consumer is not None:
        with contextlib.suppress(Exception):
            old.consumer.close()
    worker.consumers[queue_name] = thread
    thread.start()


def work_handoff() -> Callable[[Broker, MessageProxy], bool] | None:
    """Called in ``broker.consume``: when a Dramatiq consumer thread is building its consumer
    (the calling thread), ``put(broker, message)``, which hands ``message`` to that worker's
    threads as the consumer thread would (``True``), or does nothing (``False``) for a
    message the consumer thread treats otherwise (an ``eta``, an unknown actor); ``None``
    when the caller is not a consumer thread."""
    thread = threading.current_thread()
    if not isinstance(thread, ConsumerThread):
        return None
    work_queue = thread.work_queue

    def put(broker: Broker, message: MessageProxy) -> bool:
        if "eta" in message.options:
            return False
        try:
            actor = broker.get_actor(message.actor_name)
        except ActorNotFound:
            return False
        work_queue.put(_WorkQueueItem(actor.priority, message))
        return True

    return put
