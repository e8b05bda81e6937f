"""Run a sync kumiko call on an event loop: its code as it is, its bytes on the loop's connection.

:func:`carry` runs the call in a greenlet of its own, in a copy of the caller's context (so
a trace context or any other context variable of the request is seen by the hooks), with a
:class:`Courier` set as the context's carrier (:mod:`kumiko_dramatiq.broker.carrier`).
Whenever the call sends a command, the courier switches back to the coroutine that awaits
:func:`carry`, which awaits the command on the loop's client
(:class:`~kumiko_dramatiq.aio.clients.LoopClient`) and switches the reply (or the error)
back in. The loop runs other tasks meanwhile: nothing of the call blocks its thread
except the Python code between two commands, the same code the sync call runs.

So ``await carry(runner.dispatch, ...)`` builds the message, checks the guards and runs the
middleware hooks exactly as ``runner.dispatch`` does, with the same arguments, return value
and errors, and differs only in how its commands travel. A call cancelled while a command is
in flight (a timeout around the await, a client gone) has the cancellation raised inside the
call, at the command; the command's reply is read and dropped when it comes, and the
connection goes on serving the loop's other calls.

What the sync code must not do inside :func:`carry`, and does not: block on a lock or a
semaphore that another call on the same thread may hold across a command (greenlets of one
thread take turns: that would deadlock, not wait), or subscribe (``CarriedRedis.pubsub``
refuses).
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import greenlet
import redis
from redis.client import EMPTY_RESPONSE, NEVER_DECODE, Pipeline

from kumiko_dramatiq.aio.clients import LoopClient, packed_commands
from kumiko_dramatiq.broker.carrier import carry_on

T = TypeVar("T")


class _Carrying(greenlet.greenlet):
    """A greenlet that runs calls under :func:`carry`, one after another (a new greenlet
    costs more than a dispatch's own bookkeeping: idle ones wait in their courier's pool).
    Each call runs in the context it is handed; its commands go to the greenlet's parent,
    the coroutine that carries it."""

    def __init__(self) -> None:
        super().__init__(self._serve)

    @property
    def caller(self) -> greenlet.greenlet:
        """The greenlet of the coroutine that carries this one's call now."""
        parent = self.parent
        assert parent is not None
        return parent

    def _serve(self, job: _Job) -> None:
        while True:
            context, courier, call, args, kwargs = job
            try:
                done = _Done(context.run(_run, courier, call, args, kwargs), None)
            except greenlet.GreenletExit:
                raise
            except BaseException as exc:  # raised by carry(), in the caller
                done = _Done(None, exc)
            job = self.caller.switch(done)


_Job = tuple[contextvars.Context, "Courier", Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _run(
    courier: Courier, call: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> T:
    carry_on(courier)  # in the call's own copy of the caller's context
    return call(*args, **kwargs)


class _Done:
    """What a carried call ended with: its value, or what it raised."""

    __slots__ = ("error", "value")

    def __init__(self, value: Any, error: BaseException | None) -> None:
        self.value = value
        self.error = error


def _await(awaitable: Awaitable[Any]) -> Any:
    """Hand ``awaitable`` to the coroutine that carries the current call; return what it
    gave back (or raise what it raised)."""
    current = greenlet.getcurrent()
    if not isinstance(current, _Carrying):
        raise RuntimeError("kumiko: an async command outside of carry()")
    return current.caller.switch(awaitable)


async def carry(courier: Courier, call: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``call(*args, **kwargs)`` with its Redis commands sent on ``courier``'s loop client,
    awaited on the running loop (see the module docstring)."""
    idle = courier.idle
    runner: _Carrying | None = idle.pop() if idle else _Carrying()
    assert runner is not None
    runner.parent = greenlet.getcurrent()
    pending = runner.switch((contextvars.copy_context(), courier, call, args, kwargs))
    try:
        while type(pending) is not _Done:
            try:
                reply = await pending
            except BaseException as exc:  # handed back into the call
                pending = runner.throw(exc)
            else:
                pending = runner.switch(reply)
    except BaseException:
        runner = None  # a greenlet that did not finish its call is not used again
        raise
    finally:
        if runner is not None and len(idle) < _IDLE_KEPT:
            idle.append(runner)
    if pending.error is not None:
        raise pending.error
    return pending.value  # type: ignore[no-any-return]


#: how many idle greenlets a courier keeps (as many calls as ran at once, up to this)
_IDLE_KEPT: Final = 256


class Courier(redis.Redis):
    """A sync client whose commands are awaited on ``client`` (the running loop's
    :class:`~kumiko_dramatiq.aio.clients.LoopClient`) by the coroutine that carries the call.
    Every command method of redis-py's sync client works, since each goes through
    ``execute_command``, with redis-py's own reply callbacks; ``pipeline`` gives a
    :class:`_CourierPipeline`. A blocking command is refused: it would hold up every call
    of the loop, which share one connection. It opens no connection of its own."""

    def __init__(self, client: LoopClient) -> None:
        super().__init__(connection_pool=_NO_POOL)
        self.loop_client = client
        self._pack = client.packer.pack
        #: greenlets that finished their call, for the next ones (this loop's thread only)
        self.idle: list[_Carrying] = []

    def execute_command(self, *args: Any, **options: Any) -> Any:
        name = args[0]
        if name in _BLOCKING:
            raise RuntimeError(f"kumiko: {name} cannot be carried on a loop's shared connection")
        try:
            reply = _await(self.loop_client.call(self._pack(*args)))
        except redis.ResponseError:
            if EMPTY_RESPONSE in options:
                return options[EMPTY_RESPONSE]
            raise
        return self.parsed(name, reply, options)

    def parsed(self, name: str, reply: Any, options: dict[str, Any]) -> Any:
        """``reply`` to command ``name`` as redis-py's sync client returns it."""
        options.pop(NEVER_DECODE, None)
        options.pop(EMPTY_RESPONSE, None)
        options.pop("keys", None)
        callback = self.response_callbacks.get(name)  # type: ignore[no-untyped-call]
        if callback is None:
            return reply
        return callback(reply, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        return _CourierPipeline(self, transaction)

    def close(self) -> None:
        """Nothing to close: the loop's connection is closed on its loop."""


class _CourierPipeline(Pipeline):
    """A pipeline whose stacked commands go out together on the loop's connection (inside
    ``MULTI``/``EXEC`` for a transaction)."""

    def __init__(self, courier: Courier, transaction: bool) -> None:
        super().__init__(_NO_POOL, courier.response_callbacks, transaction, None)
        self.courier = courier
        self.atomic = transaction

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack, self.command_stack = self.command_stack, []
        if not stack:
            return []
        client = self.courier.loop_client
        commands = [args for args, _ in stack]
        if self.atomic:
            commands = [("MULTI",), *commands, ("EXEC",)]
        replies = _await(client.send(packed_commands(client.packer, commands), len(commands)))
        if self.atomic:
            queued, executed = replies[1:-1], replies[-1]
            failed = next((each for each in queued if isinstance(each, Exception)), None)
            if isinstance(executed, Exception) or failed is not None:
                raise failed or executed
            replies = executed
        out: list[Any] = []
        for (args, options), reply in zip(stack, replies, strict=True):
            if isinstance(reply, Exception):
                if raise_on_error:
                    raise reply
                out.append(reply)
            else:
                out.append(self.courier.parsed(args[0], reply, dict(options)))
        return out


#: the pool a courier is built on: never asked for a connection
_NO_POOL = redis.ConnectionPool()

#: commands that wait on the server (the shared connection would wait with them)
_BLOCKING: Final = frozenset(
    {"BLPOP", "BRPOP", "BLMOVE", "BRPOPLPUSH", "BZPOPMIN", "BZPOPMAX", "BLMPOP", "BZMPOP", "WAIT"}
)
