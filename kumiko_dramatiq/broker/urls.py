"""The URL forms of a kumiko Redis connection, parsed and checked in one place.

Every Redis connection kumiko opens (a runner's pool, the start-up probe, ``reset_boot`` by
URL) is built (:mod:`kumiko_dramatiq.broker.connection`) from one of these URL forms:

=========================================================== ====================================
``redis://[[user]:password@]host[:port][/db][?options]``     plain TCP (port 6379, db 0 default)
``rediss://[[user]:password@]host[:port][/db][?options]``    TLS
``unix://[[user]:password@]/path/to/redis.sock[?db=N]``      a Unix socket
``redis+sentinel://[[user]:password@]host[:port][,host[:port]...][/db]?master=NAME[&options]``
                                                             the primary of ``NAME``, as Sentinel
                                                             reports it (sentinel port 26379
                                                             default)
``redis+cluster://[[user]:password@]host[:port][,host[:port]...][/0][?options]``
                                                             a Redis Cluster, found from any of
                                                             these nodes (``rediss+cluster://``:
                                                             TLS); database 0 only
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
  must verify; ``optional``: the same for a client, since Python's ``ssl`` verifies the
  server's certificate whenever it asks for one and a TLS server always sends one; ``none``:
  not checked — encryption without authentication of the server), ``ssl_check_hostname``
  (``true``, the default with ``required``: the certificate must name the host of the URL;
  ``false``). Files are checked when the URL is validated (``JobRunner`` construction): a
  missing or unreadable one is an error naming the option and the path, and the client
  certificate and its key are loaded once, so a key that does not match, or an encrypted
  key, is refused there, in one line, without prompting for a pass phrase (an encrypted key
  is not supported: no password in URLs beyond the user's);
- ``rediss+cluster://`` also takes the TLS options; on a cluster, each dataset's connections
  go to the primary that serves its slot (:mod:`kumiko_dramatiq.broker.cluster`);
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
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import parse_qs, unquote

from redis.connection import (
    SSLConnection,
    parse_url,
)

from kumiko_dramatiq.errors import JobConfigError, redact_url

#: The schemes a kumiko Redis URL may have.
SCHEMES: Final = ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster", "rediss+cluster")
SENTINEL_SCHEME: Final = "redis+sentinel"
#: The schemes of a Redis Cluster (plain TCP and TLS).
CLUSTER_SCHEMES: Final = ("redis+cluster", "rediss+cluster")
DEFAULT_PORT: Final = 6379
DEFAULT_SENTINEL_PORT: Final = 26379
_EXPECTED: Final = (
    "must be a redis://, rediss://, unix://, redis+sentinel:// or redis+cluster:// URL"
)
_BOOLEANS: Final = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
_CERT_REQS: Final = ("required", "optional", "none")


#: The highest database number a Redis server can have (``databases`` is a 32-bit int).
MAX_DATABASE: Final = 2**31 - 1


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
    if scheme in ("rediss", "rediss+cluster"):
        return {**COMMON_OPTIONS, **TLS_OPTIONS}
    if scheme == SENTINEL_SCHEME:
        return {**COMMON_OPTIONS, **SENTINEL_OPTIONS}
    return COMMON_OPTIONS


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
    #: a cluster's seed nodes (``redis+cluster://``), empty otherwise
    nodes: tuple[tuple[str, int], ...] = ()

    @property
    def is_cluster(self) -> bool:
        return self.scheme in CLUSTER_SCHEMES


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
    if options.get("db", 0) > MAX_DATABASE:
        raise _Problem(
            f"names database {options['db']}, beyond any Redis server's "
            f"(0 to {MAX_DATABASE}, and below the server's `databases` setting)"
        )
    if scheme == SENTINEL_SCHEME:
        return _sentinel_target(netloc, options)
    if scheme in CLUSTER_SCHEMES:
        return _cluster_target(scheme, netloc, options)
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
    if "ssl_certfile" in connection:
        _check_client_certificate(connection["ssl_certfile"], connection.get("ssl_keyfile"))


class _Encrypted(Exception):
    """Raised by the pass-phrase callback: the key is encrypted (never prompted for)."""


def _refuse_pass_phrase() -> str:
    raise _Encrypted


def _check_client_certificate(certfile: str, keyfile: str | None) -> None:
    """The client certificate and its key load, and the key is not encrypted: OpenSSL would
    ask for its pass phrase on the terminal at every connection (or fail over and over
    without one). Loading with a pass-phrase callback that refuses never prompts."""
    option = "ssl_keyfile" if keyfile is not None else "ssl_certfile"
    path = keyfile if keyfile is not None else certfile
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(certfile, keyfile, password=_refuse_pass_phrase)
    except _Encrypted:
        raise _Problem(
            f"option {option} names an encrypted private key ({path}), which kumiko cannot "
            "unlock: give it a key without a pass phrase (openssl pkey -in KEY -out PLAIN)"
        ) from None
    except ssl.SSLError as exc:
        raise _Problem(
            f"options ssl_certfile and {option} do not load as a certificate and its private "
            f"key ({exc.reason or exc}): {certfile}, {path}"
        ) from None


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


def _credentials(credentials: str, connection: dict[str, Any]) -> None:
    user, colon, password = credentials.partition(":")
    if user:
        connection["username"] = unquote(user)
    if colon:
        connection["password"] = unquote(password)


def _cluster_target(scheme: str, netloc: str, options: dict[str, Any]) -> Target:
    credentials, at, hosts = netloc.rpartition("@")
    if not hosts:
        raise _Problem("must list its nodes: redis+cluster://host:6379,host:6380/0")
    nodes = tuple(_port(host, DEFAULT_PORT) for host in hosts.split(","))
    if options.get("db", 0) != 0:
        raise _Problem(f"names database {options['db']}: a Redis Cluster has database 0 only")
    connection: dict[str, Any] = {**options, "db": 0}
    if at:
        _credentials(credentials, connection)
    if scheme == "rediss+cluster":
        _tls_defaults(connection)
        connection["connection_class"] = SSLConnection
    return Target(scheme=scheme, connection=connection, nodes=nodes)


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
        _credentials(credentials, connection)
    return Target(
        scheme=SENTINEL_SCHEME,
        connection=connection,
        sentinels=sentinels,
        master=master,
        sentinel_auth=auth,
    )
