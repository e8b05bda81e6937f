"""A loop's client for a kumiko URL: the asyncio twin of :mod:`kumiko_dramatiq.broker.connection`.

Built from the same parsed URL (:func:`kumiko_dramatiq.broker.urls.parse`: TCP, TLS, a Unix
socket, Sentinel) with the same timeouts and retry policy as a runner's sync pool, on one
multiplexed connection per loop (:class:`~kumiko_dramatiq.aio.wire.Wire`). Connecting (DNS
included), the TLS handshake, ``HELLO 3``/``AUTH``/``SELECT``, asking the sentinels for the
primary (then ``ROLE``: a connection that reached a replica is dropped) and reconnecting all
run on the loop; concurrent callers share one connection attempt. With Sentinel, the client
follows the runner's :class:`~kumiko_dramatiq.broker.failover.PrimaryWatch` as the sync pool
does: a fail-over event reconnects it before its next command, and it never writes to a
primary behind the watch's barrier or demoted (a planned fail-over loses no dispatch that
returned an id).

As on the sync side: a command that meets a dropped connection (refused, reset, closed) is
sent once more on a new one after a short pause (kumiko's enqueue scripts write nothing
twice: ``lua/include/guarded.lua``), never after a timeout; a reply by which Redis refuses
writes for now (``READONLY``: a demoted primary; ``NOREPLICAS``; ``MASTERDOWN``) drops the
connection and counts as a dropped connection (so the retry finds the new primary); the
error messages read as redis-py's (``Error 111 connecting to host:port. Connection
refused.``, ``Timeout connecting to server``, ``Timeout reading from host:port``), which is
what ``RedisUnavailableError.maybe_enqueued`` is decided on.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Mapping, Sequence
from typing import Any, Final

import redis
from redis.sentinel import MasterNotFoundError

from kumiko_dramatiq.aio.wire import Wire
from kumiko_dramatiq.broker.failover import Address, PrimaryWatch
from kumiko_dramatiq.broker.packer import RespPacker
from kumiko_dramatiq.broker.refusals import unavailable_reply
from kumiko_dramatiq.broker.urls import Target, parse

#: the errors by which a command did not get its reply (a dropped connection, a timeout)
_UNAVAILABLE: Final = (redis.ConnectionError, redis.TimeoutError)

#: the pause before the one re-send after a dropped connection (s)
RETRY_PAUSE_S: Final = 0.05

_CERT_REQS: Final = {
    "required": ssl.CERT_REQUIRED,
    "optional": ssl.CERT_OPTIONAL,
    "none": ssl.CERT_NONE,
}


class LoopClient:
    """The commands of one event loop to the Redis of ``redis_url`` (see the module
    docstring). Opens no connection until a command needs one. Not for another loop."""

    def __init__(
        self, redis_url: str, *, timeout_s: float, watch: PrimaryWatch | None = None
    ) -> None:
        self.target: Target = parse(redis_url)
        #: a Sentinel URL's fail-over watch, shared with the runner's sync pool
        self.watch = watch
        self.timeout_s = timeout_s
        connection = self.target.connection
        self.packer = RespPacker(
            connection.get("encoding", "utf-8"), connection.get("encoding_errors", "strict"), 6000
        )
        self._ssl: ssl.SSLContext | None = None
        self._wire: Wire | None = None
        self._connecting: asyncio.Future[Wire] | None = None

    async def call(self, packed: list[bytes]) -> Any:
        """Send one packed command; its reply (an error reply raised). The common case (a
        connection that is up, a reply) takes one future and no other step; anything else
        goes the way of :meth:`send`."""
        wire = self._wire
        watch = self.watch
        sent = (
            wire is not None
            and wire.broken is None
            and (watch is None or wire.generation == watch.generation)
        )
        if sent:
            assert wire is not None
            future = wire.send_one(packed)
            try:
                return await future
            except redis.ResponseError as exc:
                if not unavailable_reply(exc):
                    raise
                _refused(wire, exc, watch)
            except redis.ConnectionError:
                pass
            await asyncio.sleep(RETRY_PAUSE_S)  # the one re-send, on a new connection
        (reply,) = await self.send(packed, 1, retried=sent)
        if isinstance(reply, redis.RedisError):
            raise reply
        return reply

    async def send(self, packed: list[bytes], replies: int, *, retried: bool = False) -> list[Any]:
        """Send packed commands that give ``replies`` replies; the replies, an error reply in
        its place. Raises ``ConnectionError`` / ``TimeoutError`` (after the one re-send;
        ``retried``: this is it)."""
        watch = self.watch
        for attempt in (1,) if retried else (0, 1):
            wire = self._wire
            if wire is None or wire.broken is not None:
                wire = await self._connected()
            elif watch is not None and wire.generation != watch.generation:
                wire.close()  # a fail-over moved on since it connected: find the primary
                wire = await self._connected()
            try:
                found = await _replies(wire, wire.send(packed, replies), watch)
                failed = next((each for each in found if isinstance(each, _UNAVAILABLE)), None)
                if failed is not None:
                    raise failed
                return found
            except redis.ConnectionError:
                if attempt:
                    raise
                await asyncio.sleep(RETRY_PAUSE_S)
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        """Drop the connection (on the loop's thread); a later command opens a new one."""
        if self._wire is not None:
            self._wire.close()
            self._wire = None

    def sever(self) -> None:
        """Drop the connection of a loop that no longer runs (:meth:`Wire.sever`)."""
        if self._wire is not None:
            self._wire.sever()
            self._wire = None

    # -- connecting -----------------------------------------------------------
    async def _connected(self) -> Wire:
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            wire = await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None
        self._wire = wire
        return wire

    async def _connect(self) -> Wire:
        target = self.target
        connection = target.connection
        if target.master is None:
            wire = await self._open(connection.get("host"), connection.get("port"))
            await self._hello(wire, connection, db=int(connection.get("db") or 0))
            return wire
        watch = self.watch
        generation = 0
        if watch is not None:
            watch.ensure_listening()
            generation = watch.generation
        host, port = await self._discover()
        if watch is not None and watch.barred((host, port)):
            watch.check_reported((host, port), await self._reports())
        wire = await self._open(host, port)
        await self._hello(wire, connection, db=int(connection.get("db") or 0))
        role = await wire.call(self.packer.pack("ROLE"))
        if not role or role[0] != b"master":
            wire.close()
            shown = role[0].decode() if role else "?"
            raise redis.ConnectionError(
                f"{host}:{port} is a {shown}, not the primary (a fail-over in progress?)"
            )
        wire.address, wire.generation = (host, port), generation
        if watch is not None:
            watch.connected((host, port))
        return wire

    async def _open(self, host: Any, port: Any) -> Wire:
        """A new connection to ``host:port`` (or the URL's Unix socket), under the connect
        timeout."""
        loop = asyncio.get_running_loop()
        connection = self.target.connection
        path = connection.get("path")
        name = str(path) if path else f"{host}:{port}"
        try:
            async with asyncio.timeout(self.timeout_s):
                if path:
                    _, wire = await loop.create_unix_connection(
                        lambda: Wire(name, self.timeout_s), path
                    )
                else:
                    tls = self._tls_context()
                    _, wire = await loop.create_connection(
                        lambda: Wire(name, self.timeout_s),
                        host,
                        port,
                        ssl=tls,
                        server_hostname=host if tls is not None else None,
                    )
        except TimeoutError:
            raise redis.TimeoutError("Timeout connecting to server") from None
        except OSError as exc:
            raise redis.ConnectionError(_connect_error(name, exc)) from exc
        if connection.get("socket_keepalive") and wire.transport is not None:
            sock = wire.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        return wire

    async def _hello(self, wire: Wire, auth: Mapping[str, Any], *, db: int) -> None:
        """``HELLO 3`` (with ``AUTH`` when the URL has credentials) and ``SELECT``."""
        hello: list[Any] = ["HELLO", 3]
        password = auth.get("password")
        if password is not None:
            hello += ["AUTH", auth.get("username") or "default", password]
        packed = self.packer.pack(*hello)
        replies = 1
        if db:
            packed += self.packer.pack("SELECT", db)
            replies += 1
        for future in wire.send(packed, replies):
            try:
                await future
            except BaseException:
                wire.close()
                raise

    async def _discover(self) -> tuple[str, int]:
        """The primary's address, from the first sentinel that knows it healthy (as
        ``KumikoSentinel.discover_master``: ``SENTINEL MASTERS``, the one command a sentinel
        user needs besides the fail-over events)."""
        master = str(self.target.master)
        problems: list[str] = []
        for where, state in await self._masters():
            if isinstance(state, Exception):
                problems.append(f"{where}: {str(state).rstrip('.')}")
            elif state is None:
                problems.append(f"{where}: does not monitor it")
            else:
                flags = state.get(b"flags", b"").split(b",")
                if b"master" not in flags or b"s_down" in flags or b"o_down" in flags:
                    problems.append(f"{where}: reports it down or not a primary")
                else:
                    return state[b"ip"].decode(), int(state[b"port"])
        raise MasterNotFoundError(f"No master found for {master!r} ({'; '.join(problems)})")

    async def _reports(self) -> list[tuple[Address | None, bool]]:
        """What each sentinel that answers says of the primary now: its address (``None``
        if it does not monitor it) and whether a fail-over is in progress (as
        ``KumikoSentinel.reports``, asked on the loop)."""
        found: list[tuple[Address | None, bool]] = []
        for _, state in await self._masters():
            if isinstance(state, Exception):
                continue
            if state is None:
                found.append((None, False))
                continue
            busy = b"failover_in_progress" in state.get(b"flags", b"")
            found.append(((state[b"ip"].decode(), int(state[b"port"])), busy))
        return found

    async def _masters(self) -> list[tuple[str, dict[bytes, Any] | Exception | None]]:
        """Per sentinel (``host:port``): what ``SENTINEL MASTERS`` says of the URL's primary
        (its fields, ``None`` if it does not monitor it), or why it could not be asked."""
        target = self.target
        master = str(target.master).encode()
        found: list[tuple[str, dict[bytes, Any] | Exception | None]] = []
        for host, port in target.sentinels:
            where = f"{host}:{port}"
            try:
                wire = await self._open(host, port)
                try:
                    await self._hello(wire, target.sentinel_auth, db=0)
                    masters = await wire.call(self.packer.pack("SENTINEL", "MASTERS"))
                finally:
                    wire.close()
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
                found.append((where, exc))
                continue
            state: dict[bytes, Any] | None = None
            for each in masters or ():
                fields = each if isinstance(each, dict) else _pairs(each)
                if fields.get(b"name") == master:
                    state = fields
            found.append((where, state))
        return found

    def _tls_context(self) -> ssl.SSLContext | None:
        if self.target.scheme != "rediss":
            return None
        if self._ssl is None:
            self._ssl = tls_context(self.target.connection)
        return self._ssl


async def _replies(
    wire: Wire, futures: list[asyncio.Future[Any]], watch: PrimaryWatch | None
) -> list[Any]:
    """The replies of ``futures``, an error in its place: a reply by which Redis refuses
    writes for now drops ``wire`` and stands as a ``ConnectionError`` (``READONLY`` tells
    ``watch`` that node was demoted). Cancelled while waiting: the rest are given up too
    (their replies are read and dropped)."""
    found: list[Any] = []
    try:
        for future in futures:
            try:
                found.append(await future)
            except redis.ResponseError as exc:
                if unavailable_reply(exc):
                    found.append(_refused(wire, exc, watch))
                else:
                    found.append(exc)
            except _UNAVAILABLE as exc:
                found.append(exc)
    except BaseException:
        for future in futures:
            future.cancel()
        raise
    return found


def _refused(
    wire: Wire, exc: redis.ResponseError, watch: PrimaryWatch | None
) -> redis.ConnectionError:
    """A reply by which Redis refuses writes for now: drop ``wire`` (``READONLY``: tell
    ``watch`` that node was demoted); the ``ConnectionError`` it stands for."""
    if isinstance(exc, redis.exceptions.ReadOnlyError) and watch is not None and wire.address:
        watch.demoted_reply(wire.address)
    wire.close()
    return redis.ConnectionError(f"Redis refuses writes for now: {exc}")


def tls_context(connection: Mapping[str, Any]) -> ssl.SSLContext:
    """The TLS settings of a ``rediss://`` URL's parsed options, as redis-py's sync
    ``SSLConnection`` applies them."""
    context = ssl.create_default_context(
        cafile=connection.get("ssl_ca_certs"), capath=connection.get("ssl_ca_path")
    )
    context.check_hostname = bool(connection.get("ssl_check_hostname"))
    context.verify_mode = _CERT_REQS[str(connection.get("ssl_cert_reqs", "required"))]
    certfile = connection.get("ssl_certfile")
    if certfile:
        context.load_cert_chain(certfile, connection.get("ssl_keyfile"))
    return context


def _pairs(flat: list[Any]) -> dict[Any, Any]:
    """A RESP2-style flat list of fields and values, as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _connect_error(name: str, exc: OSError) -> str:
    """redis-py's wording of a failed connect (``Error 111 connecting to ...``)."""
    if exc.errno is None:
        return f"Error connecting to {name}. {exc}."
    return f"Error {exc.errno} connecting to {name}. {exc.strerror}."


def packed_commands(packer: RespPacker, commands: Sequence[Sequence[Any]]) -> list[bytes]:
    """Every command of ``commands`` packed, in order."""
    out: list[bytes] = []
    for command in commands:
        out += packer.pack(*command)
    return out
