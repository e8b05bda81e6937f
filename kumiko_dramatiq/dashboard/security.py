"""The dashboard's sign-in and CSRF tokens: pure functions of the dashboard token.

- **Token**: ``KUMIKO_DASHBOARD_TOKEN`` or ``create_app(..., token=...)``, at least 16
  characters (:func:`check_token`). Without one the dashboard is read-only.
- **Session**: signing in with the token sets a cookie ``"{issued s}.{nonce}.{mac}"`` where
  ``mac`` is an HMAC-SHA256 of ``issued.nonce`` keyed by the token, and stores the session
  in Redis under the SHA-256 of the cookie (:func:`session_digest`,
  ``keys.dashboard_session``, TTL :data:`SESSION_S`). A request is signed in when its cookie
  is well signed, younger than :data:`SESSION_S` and its session is still stored: signing
  out deletes it, so a copied cookie stops working at once; changing the token signs
  everyone out.
- **Sign-in rate limit**: at most :data:`SIGN_IN_LIMIT` sign-in attempts per client address
  in a window of :data:`SIGN_IN_WINDOW_S` (a counter in Redis that expires with its window);
  beyond it the form is refused (429) without looking at the token.
- **CSRF**: every form that acts carries :func:`csrf_token` of the session (an HMAC keyed by
  the token over the session value); an action whose form does not carry it is refused.
  The cookie is also ``SameSite=Strict`` and ``HttpOnly``.

Comparisons are constant-time (:func:`hmac.compare_digest`). No function reads the clock:
they take ``now_s``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Final

from kumiko_dramatiq.environment import check_dashboard_token

#: How long a sign-in lasts.
SESSION_S: Final = 12 * 3600
#: Sign-in attempts allowed per client address and window, and the window.
SIGN_IN_LIMIT: Final = 10
SIGN_IN_WINDOW_S: Final = 300
#: ``check_token(token, source)``: the token if usable, ``None`` for none, else a
#: ``JobConfigError`` (at least ``MIN_DASHBOARD_TOKEN_CHARS`` characters).
check_token = check_dashboard_token


def _mac(token: str, purpose: str, text: str) -> str:
    message = f"{purpose}|{text}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def token_matches(token: str, given: str) -> bool:
    """Whether ``given`` is the dashboard token (constant-time)."""
    return hmac.compare_digest(token.encode(), given.encode())


def new_session(token: str, now_s: int, nonce: str | None = None) -> str:
    """A session cookie value issued at ``now_s``."""
    nonce = secrets.token_urlsafe(16) if nonce is None else nonce
    head = f"{now_s}.{nonce}"
    return f"{head}.{_mac(token, 'session', head)}"


def session_valid(token: str, value: str | None, now_s: int) -> bool:
    """Whether ``value`` is a session cookie signed with ``token``, issued within
    :data:`SESSION_S` before ``now_s`` (and not in the future)."""
    if not value or value.count(".") != 2:
        return False
    head, _, mac = value.rpartition(".")
    issued = head.split(".", 1)[0]
    if not issued.isdigit() or not hmac.compare_digest(mac, _mac(token, "session", head)):
        return False
    return 0 <= now_s - int(issued) <= SESSION_S


def session_digest(value: str) -> str:
    """What a session is stored under: the SHA-256 of its cookie (the store never holds a
    cookie that would sign someone in)."""
    return hashlib.sha256(value.encode()).hexdigest()


def csrf_token(token: str, session: str) -> str:
    """The CSRF token of forms shown in ``session``."""
    return _mac(token, "csrf", session)


def csrf_valid(token: str, session: str, given: str | None) -> bool:
    """Whether ``given`` is the CSRF token of ``session`` (constant-time)."""
    return given is not None and hmac.compare_digest(given, csrf_token(token, session))
