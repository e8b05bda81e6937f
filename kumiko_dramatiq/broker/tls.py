"""TLS diagnosis: :func:`tls_problem` recognises, in a connection error, a TLS failure that
retrying cannot cure (a certificate that does not verify, a server that does not speak TLS, a
client certificate refused): the start-up check reports it at once, in one line, instead of
waiting out ``boot_redis_timeout_ms``.
"""

from __future__ import annotations

import ssl
from typing import Final

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
