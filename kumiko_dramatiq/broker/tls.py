"""TLS diagnosis: :func:`tls_problem` recognises, in a connection error, a TLS failure that
retrying cannot cure (a certificate that does not verify, a server that does not speak TLS, a
client certificate refused): the start-up check reports it at once, in one line, instead of
waiting out ``boot_redis_timeout_ms``. :func:`scheme_problem` tells a ``redis://`` URL
pointed at a TLS port, or a ``rediss://`` URL at a plain one, by asking the port.
"""

from __future__ import annotations

import socket
import ssl
from typing import Final

from kumiko_dramatiq.broker.urls import parse
from kumiko_dramatiq.errors import JobConfigError

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


#: How long the port diagnosis (:func:`scheme_problem`) waits for an answer.
_DIAGNOSIS_TIMEOUT_S = 1.0


def scheme_problem(redis_url: str, exc: BaseException) -> str | None:
    """If ``exc`` (a connection that failed without a clear TLS reason) comes from a
    ``redis://`` URL pointed at a TLS port, or a ``rediss://`` URL pointed at a plain one, that
    in one line; else ``None``. Asks the port itself with one short connection (at most
    :data:`_DIAGNOSIS_TIMEOUT_S`): a TLS handshake for ``redis://``, a plain ``PING`` for
    ``rediss://``. A refused connection (nothing listens) is no such problem."""
    if "refused" in str(exc).lower():
        return None
    try:
        target = parse(redis_url)
    except JobConfigError:
        return None
    host, port = target.connection.get("host"), target.connection.get("port")
    if not isinstance(host, str) or not isinstance(port, int):
        return None
    if target.scheme == "redis" and _speaks_tls(host, port):
        return (
            "speaks TLS on this port: use a rediss:// URL (with ssl_ca_certs=... for the CA "
            "that signed its certificate)"
        )
    if target.scheme == "rediss" and _speaks_plain_resp(host, port):
        return (
            "answers without TLS on this port (plain RESP): use a redis:// URL, or the port "
            "of its tls-port"
        )
    return None


def _speaks_tls(host: str, port: int) -> bool:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=_DIAGNOSIS_TIMEOUT_S) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except ssl.SSLError as exc:
        return "ALERT" in str(exc.reason or exc)  # the server answered in TLS
    except OSError:
        return False


def _speaks_plain_resp(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=_DIAGNOSIS_TIMEOUT_S) as raw:
            raw.sendall(b"PING\r\n")
            reply = raw.recv(16)
    except OSError:
        return False
    return reply[:1] in (b"+", b"-")
