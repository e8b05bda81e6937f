"""The one place that turns a kumiko Redis URL into a connection pool.

Every Redis connection kumiko opens (a runner's pool, the start-up probe, ``reset_boot`` by
URL) is built by :func:`connection_pool` or :func:`client` from one of these URL forms:

=========================================================== ====================================
``redis://[[user]:password@]host[:port][/db][?options]``     plain TCP (port 6379, db 0 default)
``rediss://[[user]:password@]host[:port][/db][?options]``    TLS
``unix://[[user]:password@]/path/to/redis.sock[?db=N]``      a Unix socket
``redis+sentinel://[[user]:password@]host[:port][,host[:port]...][/db]?master=NAME[&options]``
                                                             the primary of ``NAME``, as Sentinel
                                                             reports it (sentinel port 26379
                                                             default)
=========================================================== ====================================

The user and password are those of the Redis data nodes (``AUTH user password``; percent-encode
``@ : / ?`` in them). Options are query parameters; each may appear once, and a name not listed
here is refused (a typo never passes silently):

- every form: ``db`` (a number, instead of the path's ``/db``; not both),
  ``health_check_interval`` (seconds, a ``PING`` before a connection idle this
  long is reused), ``socket_keepalive`` (``true``/``false``);
- ``rediss://`` only: ``ssl_ca_certs`` (PEM file of the CA certificates to trust; without it,
  the system's), ``ssl_ca_path`` (a directory of them), ``ssl_certfile`` and ``ssl_keyfile``
  (a client certificate, for servers with ``tls-auth-clients yes``; the key may be inside the
  certificate file), ``ssl_cert_reqs`` (``required``, the default: the server's certificate
  must verify; ``optional``; ``none``: not checked — encryption without authentication of
  the server), ``ssl_check_hostname`` (``true``, the default with ``required``: the
  certificate must name the host of the URL; ``false``). Files are checked when the URL is
  validated (``JobRunner`` construction): a missing or unreadable one is an error naming the
  option and the path. An encrypted private key is not supported (no password in URLs beyond
  the user's);
- ``redis+sentinel://`` only: ``master`` (required: the name Sentinel monitors),
  ``sentinel_username`` and ``sentinel_password`` (when the sentinels themselves require
  ``AUTH``; never shown in errors). TLS with Sentinel is not supported.

Every problem is one line naming the option and the value (:func:`url_problem`; passwords are
shown as ``***``). Reusing redis-py's own parsing where it has one (``redis.connection.parse_url``
for the host, port, database and credentials of the three single-server forms), this module
adds the check of option names and values, the TLS options' typing and files, and the
Sentinel form, built on redis-py's :class:`redis.sentinel.Sentinel` and
:class:`~redis.sentinel.SentinelConnectionPool`: a connection asks the sentinels for the
primary's address whenever it (re)connects, and a connection still talking to a primary that
was demoted (``READONLY``) is dropped, so a fail-over is a few failed commands, then the same
pool works against the new primary.

:func:`tls_problem` recognises, in a connection error, a TLS failure that retrying cannot cure
(a certificate that does not verify, a server that does not speak TLS, a client certificate
refused): the start-up check reports it at once, in one line, instead of waiting out
``boot_redis_timeout_ms``.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import parse_qs, unquote

import redis
from redis._parsers.encoders import Encoder
from redis.backoff import NoBackoff
from redis.connection import (
    Connection,
    PythonRespSerializer,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.utils import HIREDIS_AVAILABLE

from .errors import JobConfigError, redact_url

#: The schemes a kumiko Redis URL may have.
SCHEMES: Final = ("redis", "rediss", "unix", "redis+sentinel")
SENTINEL_SCHEME: Final = "redis+sentinel"
DEFAULT_PORT: Final = 6379
DEFAULT_SENTINEL_PORT: Final = 26379
_EXPECTED: Final = "must be a redis://, rediss://, unix:// or redis+sentinel:// URL"
_BOOLEANS: Final = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
_CERT_REQS: Final = ("required", "optional", "none")


# -- options --------------------------------------------------------------------------------
def _number(value: str) -> int:
    if not (value.isascii() and value.isdigit()):
        raise ValueError("must be a whole number")
    return int(value)


def _boolean(value: str) -> bool:
    try:
        return _BOOLEANS[value.lower()]
    except KeyError:
        raise ValueError("must be true or false") from None


def _file(value: str) -> str:
    if not (os.path.isfile(value) and os.access(value, os.R_OK)):
        raise ValueError("names no readable file")
    return value


def _directory(value: str) -> str:
    if not os.path.isdir(value):
        raise ValueError("names no directory")
    return value


def _cert_reqs(value: str) -> str:
    if value.lower() not in _CERT_REQS:
        raise ValueError("must be required, optional or none")
    return value.lower()


def _name(value: str) -> str:
    if not value:
        raise ValueError("must not be empty")
    return value


#: Option name -> parser, per scheme group. A parser raises ``ValueError`` with the problem.
COMMON_OPTIONS: Final[Mapping[str, Callable[[str], Any]]] = {
    "db": _number,
    "health_check_interval": _number,
    "socket_keepalive": _boolean,
}
TLS_OPTIONS: Final[Mapping[str, Callable[[str], Any]]] = {
    "ssl_ca_certs": _file,
    "ssl_ca_path": _directory,
    "ssl_certfile": _file,
    "ssl_keyfile": _file,
    "ssl_cert_reqs": _cert_reqs,
    "ssl_check_hostname": _boolean,
}
SENTINEL_OPTIONS: Final[Mapping[str, Callable[[str], Any]]] = {
    "master": _name,
    "sentinel_username": _name,
    "sentinel_password": _name,
}
#: Options whose values are secrets (never shown).
SECRET_OPTIONS: Final = frozenset({"sentinel_password"})


def _options_for(scheme: str) -> Mapping[str, Callable[[str], Any]]:
    if scheme == "rediss":
        return {**COMMON_OPTIONS, **TLS_OPTIONS}
    if scheme == SENTINEL_SCHEME:
        return {**COMMON_OPTIONS, **SENTINEL_OPTIONS}
    return COMMON_OPTIONS


# -- parsing --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """What a URL names: connection keyword arguments for redis-py's connection class (host,
    port or path, db, credentials, TLS options, ``connection_class``), plus, for Sentinel, the
    sentinels' addresses, the monitored name and the sentinels' own credentials."""

    scheme: str
    connection: Mapping[str, Any] = field(repr=False)
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str | None = None
    sentinel_auth: Mapping[str, str] = field(default_factory=dict, repr=False)


class _Problem(Exception):
    """What is wrong with a URL (internal: surfaces as :func:`url_problem`'s text)."""


def url_problem(url: Any) -> str | None:
    """Why ``url`` is not a usable kumiko Redis URL (one line, naming the option and value,
    never a password), or ``None``. Checks TLS files exist; opens no connection."""
    try:
        parse(url)
    except JobConfigError as exc:
        return exc.problem
    return None


def parse(url: Any) -> Target:
    """The :class:`Target` of ``url``; ``JobConfigError`` matching ``redis_url`` if bad."""
    try:
        return _parse(url)
    except _Problem as exc:
        raise JobConfigError(None, "redis_url", str(exc), redact_url(url)) from None


def _parse(url: Any) -> Target:
    if not isinstance(url, str):
        raise _Problem(_EXPECTED)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise _Problem(_EXPECTED)
    netloc, path, query = _split(rest)
    options = _options(scheme, query)
    db_path = path.strip("/") if scheme != "unix" else ""
    if db_path:
        if not (db_path.isascii() and db_path.isdigit()):
            raise _Problem("must name its database by number: redis://host:6379/0")
        if "db" in options:
            raise _Problem("names its database twice (path and ?db=): give one")
        options["db"] = int(db_path)
    if scheme == SENTINEL_SCHEME:
        return _sentinel_target(netloc, options)
    return _single_target(url, scheme, netloc, path, options)


def _split(rest: str) -> tuple[str, str, str]:
    """``netloc``, ``path``, ``query`` of what follows ``scheme://`` (no fragment allowed)."""
    rest, _, query = rest.partition("?")
    if "#" in query or "#" in rest:
        raise _Problem("must not have a #fragment")
    slash = rest.find("/")
    if slash < 0:
        return rest, "", query
    return rest[:slash], rest[slash:], query


def _options(scheme: str, query: str) -> dict[str, Any]:
    known = _options_for(scheme)
    values: dict[str, Any] = {}
    try:
        parsed = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise _Problem("has a malformed query string") from None
    for name, given in parsed.items():
        if name not in known:
            hint = ""
            if name in TLS_OPTIONS:
                hint = " (TLS options need rediss://)"
            elif name in SENTINEL_OPTIONS:
                hint = " (it needs redis+sentinel://)"
            raise _Problem(
                f"option {name!r} is not one kumiko knows for {scheme}://{hint}; "
                f"known: {', '.join(sorted(known))}"
            )
        if len(given) != 1:
            raise _Problem(f"option {name} is given {len(given)} times")
        try:
            values[name] = known[name](given[0])
        except ValueError as exc:
            shown = "***" if name in SECRET_OPTIONS else repr(given[0])
            raise _Problem(f"option {name} {exc}: {shown}") from None
    return values


def _single_target(
    url: str, scheme: str, netloc: str, path: str, options: dict[str, Any]
) -> Target:
    host = netloc.rpartition("@")[2]
    if scheme == "unix":
        if not path:
            raise _Problem("must name a socket path: unix:///path/to/redis.sock")
    elif not host or host.startswith(":"):
        raise _Problem(f"{_EXPECTED} with a host: redis://host:6379/0")
    else:
        _port(host, DEFAULT_PORT)
    try:
        # redis-py's own parsing for host, port, path, db and credentials; our options
        # (already checked and typed) replace whatever it made of the query string
        base = parse_url(url.partition("?")[0])  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise _Problem(f"{_EXPECTED}: {exc}") from None
    connection: dict[str, Any] = {**base, **options}
    if scheme == "rediss":
        _tls_defaults(connection)
    return Target(scheme=scheme, connection=connection)


def _tls_defaults(connection: dict[str, Any]) -> None:
    reqs = connection.setdefault("ssl_cert_reqs", "required")
    check = connection.get("ssl_check_hostname")
    if reqs == "none":
        if check:
            raise _Problem("option ssl_check_hostname=true needs ssl_cert_reqs=required")
        connection["ssl_check_hostname"] = False
    elif check is None:
        connection["ssl_check_hostname"] = reqs == "required"
    if "ssl_keyfile" in connection and "ssl_certfile" not in connection:
        raise _Problem("option ssl_keyfile needs ssl_certfile (the client certificate)")


def _port(host: str, default: int) -> tuple[str, int]:
    """``(host, port)`` of ``host[:port]`` or ``[v6]:port``."""
    if host.startswith("["):
        name, bracket, tail = host[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise _Problem(f"{_EXPECTED} with a valid host: {host!r}")
        text = tail[1:]
    else:
        name, _, text = host.partition(":")
    if not name:
        raise _Problem(f"{_EXPECTED} with a host: redis://host:6379/0")
    if not text:
        return unquote(name), default
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) < 65536:
        raise _Problem(f"{_EXPECTED} with a valid port")
    return unquote(name), int(text)


def _sentinel_target(netloc: str, options: dict[str, Any]) -> Target:
    credentials, at, hosts = netloc.rpartition("@")
    if not hosts:
        raise _Problem(
            "must list its sentinels: redis+sentinel://host:26379,host:26379/0?master=NAME"
        )
    sentinels = tuple(_port(host, DEFAULT_SENTINEL_PORT) for host in hosts.split(","))
    master = options.pop("master", None)
    if master is None:
        raise _Problem("must name the monitored primary: ?master=NAME")
    connection: dict[str, Any] = {"db": options.pop("db", 0), **options}
    auth = {
        name.removeprefix("sentinel_"): connection.pop(name)
        for name in ("sentinel_username", "sentinel_password")
        if name in connection
    }
    if at:
        user, colon, password = credentials.partition(":")
        if user:
            connection["username"] = unquote(user)
        if colon:
            connection["password"] = unquote(password)
    return Target(
        scheme=SENTINEL_SCHEME,
        connection=connection,
        sentinels=sentinels,
        master=master,
        sentinel_auth=auth,
    )


# -- connections ----------------------------------------------------------------------------
def unavailable_reply(exc: BaseException) -> bool:
    """Whether ``exc`` is a reply by which Redis refuses writes for now, not for good: a
    replica (``READONLY``: a primary demoted by a fail-over), a primary without enough good
    replicas (``NOREPLICAS``: ``min-replicas-to-write``), or a replica cut off from its
    primary (``MASTERDOWN``)."""
    if isinstance(exc, redis.exceptions.ReadOnlyError | redis.exceptions.MasterDownError):
        return True
    return isinstance(exc, redis.ResponseError) and str(exc).startswith(
        ("NOREPLICAS", "MASTERDOWN", "READONLY")
    )


class _WritesRefusedAreUnavailable:
    """Turns an :func:`unavailable_reply` into a ``ConnectionError`` (after dropping the
    connection, so that the next one finds the current primary): kumiko treats a Redis that
    refuses writes for now like one it cannot reach. A producer's ``dispatch`` raises
    ``RedisUnavailableError``, a worker retries its ack until Redis takes it, the scheduler
    retries the tick, and the pool's one retry re-sends the command (a refused command did
    not run). Without this, the reply is a ``ResponseError``, which Dramatiq's worker does
    not retry: a refused ack would leave its message unacked until the worker restarts."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        except redis.ResponseError as exc:
            if not unavailable_reply(exc):
                raise
            self.disconnect()  # type: ignore[attr-defined]
            raise redis.ConnectionError(f"Redis refuses writes for now: {exc}") from exc


class RespPacker:
    """Packs a command into the Redis protocol in one buffer, for kumiko's connections when
    ``hiredis`` (whose packer is C) is not installed. redis-py's pure-Python packer encodes
    argument by argument through a chain of type checks and rebuilds its buffer for each one:
    on kumiko's Lua calls (10 to 13 arguments) that was a tenth of a worker's CPU per
    message. Same output and errors: ``bytes``, ``str`` (in the connection's encoding) and
    ``int`` are packed here; anything else (a command name of several words such as
    ``"CLIENT SETNAME"``, a float, a memoryview, a bool or another type, which redis-py
    refuses) goes to redis-py's packer."""

    def __init__(self, encoding: str, errors: str, buffer_cutoff: int) -> None:
        self._encoding = encoding
        self._errors = errors
        self._redis_py = PythonRespSerializer(
            buffer_cutoff,
            Encoder(encoding, errors, False).encode,  # type: ignore[no-untyped-call]
        )

    def pack(self, *args: Any) -> list[bytes]:
        name = args[0]
        if (b" " if type(name) is bytes else " ") in name:
            return self._redis_py.pack(*args)  # type: ignore[no-any-return,no-untyped-call]
        parts = [b"*%d\r\n" % len(args)]
        for arg in args:
            kind = type(arg)
            if kind is str:
                arg = arg.encode(self._encoding, self._errors)
            elif kind is int:
                arg = b"%d" % arg
            elif kind is not bytes:
                return self._redis_py.pack(*args)  # type: ignore[no-any-return,no-untyped-call]
            parts.append(b"$%d\r\n%b\r\n" % (len(arg), arg))
        return [b"".join(parts)]


class KumikoConnection(_WritesRefusedAreUnavailable, Connection):
    """A TCP connection (see :class:`_WritesRefusedAreUnavailable`)."""


class KumikoSSLConnection(_WritesRefusedAreUnavailable, SSLConnection):
    """A TLS connection (see :class:`_WritesRefusedAreUnavailable`)."""


class KumikoUnixConnection(_WritesRefusedAreUnavailable, UnixDomainSocketConnection):
    """A Unix socket connection (see :class:`_WritesRefusedAreUnavailable`)."""


class KumikoSentinelConnection(_WritesRefusedAreUnavailable, SentinelManagedConnection):
    """A connection to the primary Sentinel names (see
    :class:`_WritesRefusedAreUnavailable`; redis-py's own class already drops a connection
    that answers ``READONLY``). One that lost its socket asks the sentinels again before it
    sends: redis-py does that only when the pool hands a connection out, and a connection a
    thread keeps (``KumikoBroker.thread_client``) would otherwise reconnect to the address
    it had, the old primary's."""

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self._sock is None:
            self.connect()  # type: ignore[no-untyped-call]
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]


_CONNECTION_CLASSES: Final[dict[type[Connection] | type[UnixDomainSocketConnection], type]] = {
    Connection: KumikoConnection,
    SSLConnection: KumikoSSLConnection,
    UnixDomainSocketConnection: KumikoUnixConnection,
}


# -- pools ----------------------------------------------------------------------------------
class SentinelPool(SentinelConnectionPool):
    """redis-py's Sentinel pool that also closes its connections to the sentinels when it
    is disconnected (``JobRunner.stop()`` closes every connection the runner opened). Only
    the idle ones when only the pool's idle ones go: redis-py does that when it sees the
    primary move, while other threads may be asking a sentinel for the primary on theirs."""

    sentinel_manager: Sentinel

    def disconnect(self, inuse_connections: bool = True) -> None:
        super().disconnect(inuse_connections)
        for sentinel in self.sentinel_manager.sentinels:
            sentinel.connection_pool.disconnect(inuse_connections)


def connection_pool(
    redis_url: str, *, timeout_s: float, retry: Retry | None = None
) -> redis.ConnectionPool:
    """A pool for ``redis_url`` (any form above) with connect and read timeouts of
    ``timeout_s`` and ``retry`` as its commands' retry policy (``None``: no retry).
    ``JobConfigError`` for a bad URL; opens no connection."""
    target = parse(redis_url)
    policy = Retry(NoBackoff(), 0) if retry is None else retry
    settings: dict[str, Any] = {
        "socket_connect_timeout": timeout_s,
        "socket_timeout": timeout_s,
        "retry": policy,
    }
    packing: dict[str, Any] = {}
    if not HIREDIS_AVAILABLE:
        packing["command_packer"] = RespPacker(
            target.connection.get("encoding", "utf-8"),
            target.connection.get("encoding_errors", "strict"),
            6000,  # redis-py's buffer cutoff
        )
    if target.master is None:
        kind = target.connection.get("connection_class", Connection)
        return redis.ConnectionPool(
            **{
                **target.connection,
                **settings,
                **packing,
                "connection_class": _CONNECTION_CLASSES[kind],
            }
        )
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        list(target.sentinels),
        # one try per sentinel per discovery: a dead sentinel costs one refused connection
        sentinel_kwargs={**target.sentinel_auth, **settings, "retry": Retry(NoBackoff(), 0)},
    )
    return SentinelPool(  # type: ignore[no-untyped-call]
        target.master,
        sentinel,
        **{
            **target.connection,
            **settings,
            **packing,
            "connection_class": KumikoSentinelConnection,
        },
    )


def client(redis_url: str, *, timeout_s: float, retry: Retry | None = None) -> redis.Redis:
    """A client on a pool of its own (:func:`connection_pool`); ``close()`` closes both."""
    pool = connection_pool(redis_url, timeout_s=timeout_s, retry=retry)
    made = redis.Redis(connection_pool=pool)
    made.auto_close_connection_pool = True
    return made


def describe(client: redis.Redis) -> str:
    """``redis://host:port/db`` (or ``unix://``, ``redis+sentinel://``) of ``client``'s pool,
    without credentials, for messages."""
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    if isinstance(pool, SentinelConnectionPool):
        hosts = ",".join(
            f"{s.connection_pool.connection_kwargs.get('host', '?')}:"
            f"{s.connection_pool.connection_kwargs.get('port', '?')}"
            for s in pool.sentinel_manager.sentinels
        )
        return f"redis+sentinel://{hosts}/{kwargs.get('db', 0)}?master={pool.service_name}"
    if "path" in kwargs:
        return f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
    scheme = "rediss" if issubclass(pool.connection_class, SSLConnection) else "redis"
    return f"{scheme}://{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}"


# -- errors ---------------------------------------------------------------------------------
#: OpenSSL reasons of a handshake that retrying will not cure, and what they mean here.
_TLS_REASONS: Final = {
    "WRONG_VERSION_NUMBER": "does not speak TLS on this port (is it a plain redis:// port?)",
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": (
        "requires a client certificate: give ssl_certfile and ssl_keyfile"
    ),
    "SSLV3_ALERT_BAD_CERTIFICATE": "refuses the client certificate (ssl_certfile)",
    "TLSV1_ALERT_UNKNOWN_CA": "does not trust the CA of the client certificate (ssl_certfile)",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "refuses the client certificate (ssl_certfile)",
    "TLSV1_ALERT_DECRYPT_ERROR": "refuses the client certificate (ssl_certfile)",
}


def tls_problem(exc: BaseException) -> str | None:
    """If ``exc`` (or what caused it) is a TLS failure that retrying cannot cure, what it
    means, in one line; else ``None``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLCertVerificationError):
            detail = current.verify_message or current.reason or str(current)
            return (
                f"presents a TLS certificate that does not verify ({detail}): check "
                "ssl_ca_certs (the CA that signed the server's certificate) and the host name"
            )
        if isinstance(current, ssl.SSLError):
            meaning = _TLS_REASONS.get(str(current.reason))
            if meaning is not None:
                return f"{meaning} (TLS: {current.reason})"
        current = current.__cause__ or current.__context__
    return _tls_problem_in_text(str(exc))


def tls_hint(exc: BaseException) -> str | None:
    """What a TLS connection closed by the server in or right after the handshake most
    likely means (a client certificate the server wants; retrying may cure a server that
    was merely restarting, so the start-up probe alone uses this), or ``None``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLEOFError) or "EOF occurred in violation of protocol" in str(
            current
        ):
            return (
                "closed the TLS connection after the handshake: does it require a client "
                "certificate (ssl_certfile, ssl_keyfile) or refuse the one given?"
            )
        current = current.__cause__ or current.__context__
    return None


def _tls_problem_in_text(text: str) -> str | None:
    """The same, from a message only (redis-py formats some errors without chaining them)."""
    if "CERTIFICATE_VERIFY_FAILED" in text:
        detail = text.partition("certificate verify failed:")[2].partition("(")[0].strip()
        return (
            f"presents a TLS certificate that does not verify ({detail or 'verify failed'}): "
            "check ssl_ca_certs (the CA that signed the server's certificate) and the host name"
        )
    for reason, meaning in _TLS_REASONS.items():
        if reason in text:
            return f"{meaning} (TLS: {reason})"
    return None
