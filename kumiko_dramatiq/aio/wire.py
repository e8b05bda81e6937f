"""One asyncio connection to Redis, shared by every call of its loop: commands are written in
the order they are sent and their replies matched in that order (RESP3).

A command sent while none is in flight is written at once; those sent while replies are
awaited leave together in one write at the end of the loop's turn (a hundred coroutines
dispatching at once share their system calls and round trips). Replies are parsed as they
arrive, however they are split. Every reply has a deadline (the
read timeout): one that has not come by then fails every command waiting on the connection
with ``redis.TimeoutError`` and drops it (a late reply could not be told from the next
command's). A dropped connection fails every waiting command with ``redis.ConnectionError``.
A waiter that gives up (its task cancelled) leaves its reply to be read and discarded: the
connection stays good. Nothing here blocks the loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import Sequence
from typing import Any, Final

import redis

from kumiko_dramatiq.broker.seam import error_reply

#: the RESP3 type bytes
_BULK, _SIMPLE, _INT, _BIG, _ARRAY, _SET, _PUSH, _MAP = b"$+:(*~>%"
_ERROR, _BLOB_ERROR, _NULL, _BOOL, _DOUBLE, _VERBATIM, _ATTRIBUTE = b"-!_#,=|"


class _Short(Exception):
    """The buffer holds only part of the next reply."""


class Push(list[Any]):
    """An out-of-band message from the server (RESP3 push): no command's reply."""


def _error(text: bytes) -> Exception:
    return error_reply(text.decode("utf-8", errors="replace"))


def parse(buffer: bytes | bytearray, at: int) -> tuple[Any, int]:
    """The reply that starts at ``at`` in ``buffer`` and where the next one starts; raises
    :class:`_Short` when the buffer ends before it does. An error reply is the
    ``redis.ResponseError`` (or subclass) redis-py would raise, returned, not raised (inside an
    array it stays in its place)."""
    end = buffer.find(b"\r\n", at)
    if end < 0:
        raise _Short
    kind = buffer[at]
    line = buffer[at + 1 : end]
    at = end + 2
    if kind in (_BULK, _VERBATIM, _BLOB_ERROR):
        size = int(line)
        if size < 0:
            return None, at
        stop = at + size
        if len(buffer) < stop + 2:
            raise _Short
        value = bytes(buffer[at:stop])
        if kind == _VERBATIM:
            value = value[4:]  # "txt:"
        elif kind == _BLOB_ERROR:
            return _error(value), stop + 2
        return value, stop + 2
    if kind in (_INT, _BIG):
        return int(line), at
    if kind == _SIMPLE:
        return bytes(line), at
    if kind in (_ARRAY, _SET, _PUSH):
        count = int(line)
        if count < 0:
            return None, at
        items: list[Any] = Push() if kind == _PUSH else []
        for _ in range(count):
            item, at = parse(buffer, at)
            items.append(item)
        return items, at
    if kind in (_MAP, _ATTRIBUTE):
        mapping: dict[Any, Any] = {}
        for _ in range(int(line)):
            key, at = parse(buffer, at)
            mapping[key], at = parse(buffer, at)
        if kind == _ATTRIBUTE:  # metadata about the reply that follows it
            return parse(buffer, at)
        return mapping, at
    if kind == _ERROR:
        return _error(bytes(line)), at
    if kind == _NULL:
        return None, at
    if kind == _BOOL:
        return line == b"t", at
    if kind == _DOUBLE:
        return float(line), at
    raise redis.exceptions.InvalidResponse(
        f"Protocol Error: {bytes(buffer[at - 2 - len(line) - 1 : at])!r}"
    )


#: the most replies a connection hands to their waiters in one turn of the loop
REPLIES_PER_TURN: Final = 10

#: how long a connection waits for a command's reply when no timeout is given (s)
DEFAULT_TIMEOUT_S: Final = 5.0


class Wire(asyncio.Protocol):
    """One connection (see the module docstring). ``name`` (``host:port``) is for errors."""

    def __init__(self, name: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        #: why this connection can no longer be used (``None``: it can)
        self.broken: redis.ConnectionError | redis.TimeoutError | None = None
        self._waiting: deque[tuple[asyncio.Future[Any], float]] = deque()
        self._buffer = bytearray()
        self._out: list[bytes] = []
        self._timer: asyncio.TimerHandle | None = None
        #: whether a :meth:`_read` of what the buffer holds is due in the next turn
        self._reading_later = False
        #: the primary's address and the fail-over watch's generation it connected at
        self.address: tuple[str, int] | None = None
        self.generation = 0

    # -- asyncio.Protocol ---------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if not self._reading_later:
            self._read()

    def _read(self) -> None:
        """Hand the replies in the buffer to their waiters, at most :data:`REPLIES_PER_TURN`
        per turn of the loop: each waiter runs its next step in the next turn, and a hundred
        of them at once would hold the loop for milliseconds (the rest follow a turn later)."""
        self._reading_later = False
        if self.broken is not None:
            return
        buffer = self._buffer
        at = 0
        waiting = self._waiting
        handed = 0
        try:
            while at < len(buffer):
                if handed == REPLIES_PER_TURN:
                    self._reading_later = True
                    self.loop.call_soon(self._read)
                    break
                reply, at = parse(buffer, at)
                if type(reply) is Push:
                    continue
                if not waiting:
                    self._fail(redis.ConnectionError(f"{self.name}: a reply no command asked for"))
                    return
                future, _ = waiting.popleft()
                if future.done():  # its waiter gave up
                    continue
                handed += 1
                if isinstance(reply, redis.RedisError):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        except _Short:
            pass
        except (ValueError, redis.exceptions.InvalidResponse) as exc:
            self._fail(redis.ConnectionError(f"{self.name}: unreadable reply ({exc})"))
            return
        del buffer[:at]

    def connection_lost(self, exc: Exception | None) -> None:
        detail = f": {exc}" if exc is not None else ""
        self._fail(redis.ConnectionError(f"Connection to {self.name} lost{detail}"), close=False)

    # -- sending -----------------------------------------------------------------
    def send(self, packed: list[bytes], replies: int = 1) -> list[asyncio.Future[Any]]:
        """Queue ``packed`` (one or more commands, packed) for this turn's write; the futures
        of its ``replies`` replies, in order."""
        futures = [self.loop.create_future() for _ in range(replies)]
        self._queue(packed, futures)
        return futures

    def send_one(self, packed: list[bytes]) -> asyncio.Future[Any]:
        """:meth:`send` for one command: its reply's future."""
        future = self.loop.create_future()
        self._queue(packed, (future,))
        return future

    async def call(self, packed: list[bytes]) -> Any:
        """Send one command; its reply."""
        return await self.send_one(packed)

    def _queue(self, packed: list[bytes], futures: Sequence[asyncio.Future[Any]]) -> None:
        if self.broken is not None:
            raise self.broken
        loop = self.loop
        deadline = loop.time() + self.timeout_s
        idle = not self._waiting
        self._waiting.extend((future, deadline) for future in futures)
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._check_deadline)
        if idle and not self._out and self.transport is not None:
            # nothing in flight: no reply could come back sooner than this write goes out
            self.transport.write(b"".join(packed) if len(packed) > 1 else packed[0])
            return
        if not self._out:
            loop.call_soon(self._flush)
        self._out += packed

    def close(self) -> None:
        """Drop the connection; its waiting commands fail with ``ConnectionError``."""
        self._fail(redis.ConnectionError(f"Connection to {self.name} closed"))

    def sever(self) -> None:
        """Close the connection of a loop that no longer runs (its transport cannot be closed
        through the loop any more): the socket is shut down, so Redis drops its side now; its
        file is freed with the transport."""
        self.broken = self.broken or redis.ConnectionError(f"Connection to {self.name} closed")
        sock = None if self.transport is None else self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _flush(self) -> None:
        data = b"".join(self._out)
        self._out.clear()
        if self.broken is None and self.transport is not None:
            self.transport.write(data)

    def _check_deadline(self) -> None:
        self._timer = None
        if not self._waiting or self.broken is not None:
            return
        head = self._waiting[0][1]
        if head <= self.loop.time():
            self._fail(redis.TimeoutError(f"Timeout reading from {self.name}"))
        else:
            self._timer = self.loop.call_at(head, self._check_deadline)

    def _fail(
        self, error: redis.ConnectionError | redis.TimeoutError, *, close: bool = True
    ) -> None:
        if self.broken is None:
            self.broken = error
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self._waiting = self._waiting, deque()
        for future, _ in waiting:
            if not future.done():
                future.set_exception(type(self.broken)(*self.broken.args))
        self._out.clear()
        if close and self.transport is not None:
            self.transport.abort()
