"""Limits on input: what kumiko accepts from callers and declarations, checked up front.

Bad input is refused before anything is written, with one line naming the job, the field
and the bad value (:class:`~kumiko_dramatiq.errors.PayloadError` for a call,
:class:`~kumiko_dramatiq.errors.JobConfigError` for a declaration or a setting):

- **durations**: every duration an option, a setting or a call can produce is at most
  :data:`MAX_DURATION_MS` (366 days): ``delay_ms``, ``backoff.delay_ms``, ``timeout_ms``, the
  worst-case retry window, the runner's millisecond settings; ``retries`` is at most
  :data:`MAX_RETRIES`. So every TTL derived from them (a dedup record's bound is the largest)
  stays far inside what Redis accepts, and no write can fail half-way for a TTL Redis refuses;
- **payloads** (:func:`check_payload`): a JSON object whose values are JSON values (``None``,
  ``bool``, ``int`` within +-(2**63-1), finite ``float``, ``str``, ``list``, ``dict`` with
  ``str`` keys), nested at most :data:`MAX_NESTING` levels, strings valid Unicode (no lone
  surrogates), at most ``max_payload_bytes`` once JSON-encoded (default 1 MiB);
- **dedup keys** (:func:`check_dedup_key`): a non-empty string of valid Unicode, at most
  :data:`MAX_DEDUP_KEY_BYTES` bytes in UTF-8;
- **tenant ids** (:func:`tenant_id_problem`): a non-empty string of valid Unicode without
  control characters, at most :data:`MAX_TENANT_ID_BYTES` bytes in UTF-8.
"""

from __future__ import annotations

import json
import math
import unicodedata
from typing import Any, Final, TypeGuard

from kumiko_dramatiq.errors import PayloadError

#: The longest duration anything may ask for: 366 days, in ms.
MAX_DURATION_MS: Final = 366 * 86_400_000
#: The most retries a job may declare.
MAX_RETRIES: Final = 10_000
#: Payloads nest at most this deep (the payload object itself is level 1).
MAX_NESTING: Final = 100
#: Default of ``max_payload_bytes`` (``KUMIKO_MAX_PAYLOAD_BYTES``): 1 MiB.
DEFAULT_MAX_PAYLOAD_BYTES: Final = 1_048_576
MAX_DEDUP_KEY_BYTES: Final = 512
MAX_TENANT_ID_BYTES: Final = 256
_INT_LIMIT: Final = 2**63 - 1

TOO_LARGE: Final = f"is too large (at most {MAX_DURATION_MS} ms, 366 days)"


def unicode_problem(text: str) -> str | None:
    """Why ``text`` is not valid Unicode (a lone surrogate), or ``None``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"must be valid Unicode (lone surrogate at position {exc.start})"
    return None


#: Where a value sits in a payload: ``None`` (the payload itself) or (its parent's where,
#: its key or index).
_Where = tuple[Any, str | int] | None
#: The most characters ``json.dumps`` writes for an ``int`` within +-(2**63-1) and for a
#: finite ``float`` (``repr``: ``-2.2250738585072014e-308``), with room to spare.
_INT_CHARS: Final = 20
_FLOAT_CHARS: Final = 32


def check_payload(
    job_name: str,
    payload: Any,
    *,
    max_bytes: int,
    path: str = "payload",
    encoded_bound: int | None = None,
) -> dict[str, Any]:
    """Return ``payload`` (``None`` -> ``{}``) if it is within the limits, else raise
    :class:`PayloadError` naming the job, the path of the bad value (rooted at ``path``,
    say ``payloads[3]`` in a bulk dispatch) and the value. ``encoded_bound``: an upper bound
    of its encoded size when one is known (the size of the message it came in). The walk
    that checks the values adds up a bound of its own (:func:`_encoded_bound`); the payload
    is encoded to measure it only when the smaller bound is over ``max_bytes``."""
    if payload is None:
        return {}
    if not isinstance(payload, dict):
        raise PayloadError(job_name, path, "must be a JSON object (dict)", payload)
    # Iterative walk: a payload nested 10,000 levels deep must not hit Python's recursion
    # limit before it hits ours. Each entry carries where it is as (parent's where, key), the
    # path is spelled out only for an error.
    stack: list[tuple[Any, int, _Where]] = [(payload, 1, None)]
    bound = 0
    while stack:
        value, depth, where = stack.pop()
        if value is None or isinstance(value, bool):
            bound += 5
            continue
        if isinstance(value, int):
            if not -_INT_LIMIT <= value <= _INT_LIMIT:
                raise PayloadError(
                    job_name, _path(path, where), "must be an integer within +-(2**63-1)", value
                )
            bound += _INT_CHARS
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                raise PayloadError(job_name, _path(path, where), "must be a finite number", value)
            bound += _FLOAT_CHARS
            continue
        if isinstance(value, str):
            problem = unicode_problem(value)
            if problem is not None:
                raise PayloadError(job_name, _path(path, where), problem, value)
            bound += _encoded_bound(value)
            continue
        if isinstance(value, dict | list):
            if depth > MAX_NESTING:
                raise PayloadError(
                    job_name, path, f"nests deeper than {MAX_NESTING} levels", "[...]"
                )
            bound += 2
            if isinstance(value, dict):
                for key, item in value.items():
                    if not isinstance(key, str):
                        raise PayloadError(
                            job_name, _path(path, where), "must have string keys", key
                        )
                    problem = unicode_problem(key)
                    if problem is not None:
                        raise PayloadError(job_name, f"{_path(path, where)} key", problem, key)
                    bound += _encoded_bound(key) + 2  # its ":" and ","
                    stack.append((item, depth + 1, (where, key)))
            else:
                bound += len(value)  # the ","s
                stack.extend((item, depth + 1, (where, i)) for i, item in enumerate(value))
            continue
        raise PayloadError(job_name, _path(path, where), "must be a JSON value", value)
    if encoded_bound is not None:
        bound = min(bound, encoded_bound)
    if bound <= max_bytes:
        return payload
    size = len(json.dumps(payload, allow_nan=False, separators=(",", ":")).encode())
    if size > max_bytes:
        raise PayloadError(
            job_name, path, f"is too large once encoded (at most {max_bytes} bytes)", size
        )
    return payload


def _path(path: str, where: _Where) -> str:
    """The path of the value at ``where``, as ``payload['a'][3]``."""
    keys: list[str | int] = []
    while where is not None:
        where, key = where
        keys.append(key)
    return path + "".join(f"[{key!r}]" for key in reversed(keys))


def _encoded_bound(text: str) -> int:
    """At most how many bytes ``json.dumps`` (``ensure_ascii``) writes for string ``text``:
    its quotes, and per character at most 6 (``\\uXXXX``), or 12 for one beyond the Basic
    Multilingual Plane (a surrogate pair)."""
    return len(text) * (6 if text.isascii() else 12) + 2


def check_delay_ms(job_name: str, delay_ms: Any) -> int | None:
    """``delay_ms`` of a call: ``None`` or an integer from 0 to :data:`MAX_DURATION_MS`."""
    if delay_ms is None:
        return None
    if not isinstance(delay_ms, int) or isinstance(delay_ms, bool) or delay_ms < 0:
        raise PayloadError(job_name, "delay_ms", "must be an integer >= 0", delay_ms)
    if delay_ms > MAX_DURATION_MS:
        raise PayloadError(job_name, "delay_ms", TOO_LARGE, delay_ms)
    return delay_ms


def check_debounce(
    job_name: str, debounce_ms: Any, max_wait_ms: Any, *, dedup_key: Any, delay_ms: Any
) -> tuple[int | None, int | None]:
    """``debounce_ms`` and ``max_wait_ms`` of a call: ``None``, or integers from 1 to
    :data:`MAX_DURATION_MS`; debounce needs a dedup key and no ``delay_ms``, a max wait a
    debounce."""
    for field, value in (("debounce_ms", debounce_ms), ("max_wait_ms", max_wait_ms)):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PayloadError(job_name, field, "must be an integer >= 1", value)
        if value > MAX_DURATION_MS:
            raise PayloadError(job_name, field, TOO_LARGE, value)
    if max_wait_ms is not None and debounce_ms is None:
        raise PayloadError(job_name, "max_wait_ms", "needs a debounce_ms", max_wait_ms)
    if debounce_ms is not None and dedup_key is None:
        raise PayloadError(job_name, "debounce_ms", "needs a dedup_key", debounce_ms)
    if debounce_ms is not None and delay_ms is not None:
        raise PayloadError(job_name, "debounce_ms", "cannot go with a delay_ms", debounce_ms)
    return debounce_ms, max_wait_ms


def check_priority(job_name: str, priority: Any) -> int | None:
    """``priority`` of a call: ``None`` (the job's own) or an integer from 0 to 9."""
    if priority is None:
        return None
    if not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority <= 9:
        raise PayloadError(
            job_name, "priority", "must be an integer from 0 (runs first) to 9", priority
        )
    return priority


def check_fair_key(job_name: str, fair_key: Any) -> str | None:
    """``fair_key`` of a call: ``None`` or a string by the rules of tenant ids."""
    if fair_key is None:
        return None
    problem = tenant_id_problem(fair_key)
    if problem is not None:
        raise PayloadError(job_name, "fair_key", problem, fair_key)
    return str(fair_key)


def dedup_key_problem(key: Any) -> str | None:
    """Why ``key`` is not a valid dedup key, or ``None``."""
    if not isinstance(key, str) or not key:
        return "must be a non-empty string"
    problem = unicode_problem(key)
    if problem is not None:
        return problem
    if len(key.encode()) > MAX_DEDUP_KEY_BYTES:
        return f"is too long (at most {MAX_DEDUP_KEY_BYTES} bytes in UTF-8)"
    return None


def check_dedup_key(job_name: str, field: str, key: Any) -> str:
    """Return ``key`` if it is a valid dedup key, else raise :class:`PayloadError`."""
    problem = dedup_key_problem(key)
    if problem is not None:
        raise PayloadError(job_name, field, problem, key)
    return str(key)


def tenant_id_problem(tenant_id: Any) -> str | None:
    """Why ``tenant_id`` is not a valid tenant id, or ``None``."""
    if not isinstance(tenant_id, str) or not tenant_id:
        return "must be a non-empty string"
    problem = unicode_problem(tenant_id)
    if problem is not None:
        return problem
    if len(tenant_id.encode()) > MAX_TENANT_ID_BYTES:
        return f"is too long (at most {MAX_TENANT_ID_BYTES} bytes in UTF-8)"
    if any(unicodedata.category(char) == "Cc" for char in tenant_id):
        return "must not contain control characters"
    return None


def backoff_window_ms(retries: int, backoff: str | None, delay_ms: int | None) -> int:
    """The worst-case time spent waiting out backoffs across ``retries`` retries: fixed
    ``retries * delay_ms``, exponential ``delay_ms * (2**retries - 1)``; 0 without a
    backoff. At most :data:`MAX_DURATION_MS` for anything a declaration can produce."""
    if backoff is None or delay_ms is None or retries == 0:
        return 0
    if backoff == "fixed":
        return retries * delay_ms
    return int(delay_ms * (2**retries - 1))


def is_strict_int(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is an ``int`` and not a ``bool`` (kumiko's integers are strict)."""
    return isinstance(value, int) and not isinstance(value, bool)
