"""kumiko's message options: every ``kumiko_*`` key, defined, written and decoded here.

A kumiko message carries Dramatiq's own options (``redis_message_id``, ``eta``, ...) plus
these, all JSON-native so they survive the JSON round trip of delays and retries unchanged:

=========================== ===================================================================
``kumiko_retries``          int >= 0: retries after the first attempt (``build_message_options``)
``kumiko_backoff``          ``None`` | ``"fixed"`` | ``"exponential"`` (``build_message_options``)
``kumiko_backoff_delay_ms`` int > 0 with a backoff, else ``None`` (``build_message_options``)
``kumiko_trigger``          how the message came to be (:data:`~kumiko_dramatiq.context.Trigger`)
``kumiko_failures``         failed attempts already spent, ``0 <= failures <= retries``
                            (absent = 0)
``kumiko_tenant_id``        tenant of a per-tenant child (absent = none)
``kumiko_dedup_key``        the dedup key the message holds (absent = none)
``kumiko_scheduled_at``     ISO-8601 tick of a cron message, with its UTC offset (absent = none)
``kumiko_origin_id``        the id the caller got back for the work this message carries on (a
                            hand-off's, a per-tenant child's); absent = the message's own id
``kumiko_batch``            the batch (or chain step) the message is a child of: its end is
                            counted there (``lua/include/batch.lua``); absent = none
``kumiko_batch_callback``   the batch the message is a callback of (absent = none)
``kumiko_caps``             the job's caps (``build_message_options``; absent = none): an object
                            with ``max_running`` (int, 1 to :data:`MAX_CAP_RUNNING`) and/or
                            ``rate_limit`` ([count, per_ms, per_tenant]: count 1 to
                            :data:`MAX_RATE_COUNT`, per_ms 1 to 366 days, a bool); the fetch
                            (``lua/include/caps.lua``) reads it out of the encoded message
``kumiko_route``            where the message waits in its lane (absent: level 0, no fair key):
                            ``"<priority>"`` or ``"<priority>.<fair key digest>"``, the
                            priority 0-9 and :func:`fair_digest` of its fair key (its
                            ``kumiko_fair_key``, else its tenant); the lane's Lua
                            (``lua/include/route.lua``) reads it out of the encoded message
``kumiko_fair_key``         the fair key ``dispatch(..., fair_key=)`` gave (absent = none: a
                            per-tenant child's key is its tenant)
``kumiko_trace``            OpenTelemetry context (:mod:`~.middleware.tracing`): an object
                            with ``parent`` (the dispatching span) and/or ``link`` (the wrapper
                            or predecessor span), each a propagator carrier: at most
                            :data:`MAX_CARRIER_ENTRIES` strings by name (absent = none)
=========================== ===================================================================

:meth:`KumikoOptions.decode` is strict: a missing required key, a value of the wrong type or
range, or one no declaration can produce (more than :data:`~kumiko_dramatiq.limits.MAX_RETRIES`
retries, a backoff delay or worst-case retry window over 366 days) raises
:class:`OptionsError`, never a default. Nothing else in the package spells a ``kumiko_*``
key.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal, cast, get_args

from kumiko_dramatiq.context import JobMeta, Trigger
from kumiko_dramatiq.limits import (
    MAX_DURATION_MS,
    MAX_RETRIES,
    backoff_window_ms,
    dedup_key_problem,
    is_strict_int,
    tenant_id_problem,
)

BackoffType = Literal["fixed", "exponential"]

RETRIES: Final = "kumiko_retries"
BACKOFF: Final = "kumiko_backoff"
BACKOFF_DELAY_MS: Final = "kumiko_backoff_delay_ms"
TRIGGER: Final = "kumiko_trigger"
FAILURES: Final = "kumiko_failures"
TENANT_ID: Final = "kumiko_tenant_id"
DEDUP_KEY: Final = "kumiko_dedup_key"
SCHEDULED_AT: Final = "kumiko_scheduled_at"
ORIGIN_ID: Final = "kumiko_origin_id"
BATCH: Final = "kumiko_batch"
BATCH_CALLBACK: Final = "kumiko_batch_callback"
TRACE: Final = "kumiko_trace"
CAPS: Final = "kumiko_caps"
ROUTE: Final = "kumiko_route"
FAIR_KEY: Final = "kumiko_fair_key"

#: The largest ``max_running`` and ``RateLimit.count`` a declaration can give (a rate limit's
#: window keeps one entry per start in it).
MAX_CAP_RUNNING: Final = 100_000
MAX_RATE_COUNT: Final = 100_000

#: A trace carrier holds at most this many entries, of names up to :data:`MAX_CARRIER_NAME`
#: characters and values up to :data:`MAX_CARRIER_VALUE` (W3C baggage allows 8,192 bytes).
MAX_CARRIER_ENTRIES: Final = 16
MAX_CARRIER_NAME: Final = 64
MAX_CARRIER_VALUE: Final = 8192
_TRACE_PARTS: Final = ("parent", "link")

_TRIGGERS: Final = frozenset(get_args(Trigger))
_BACKOFFS: Final = frozenset(get_args(BackoffType))


class OptionsError(ValueError):
    """A message's kumiko options do not decode into what kumiko writes."""

    def __init__(self, key: str, problem: str, value: Any = ...) -> None:
        self.key = key
        self.problem = problem
        self.value = value
        shown = "" if value is ... else f", got {value!r:.80}"
        super().__init__(f"option {key} {problem}{shown}")


def encode_policy(
    retries: int, backoff: BackoffType | None, backoff_delay_ms: int | None
) -> dict[str, Any]:
    """The three retry-policy keys (the body of ``build_message_options``)."""
    return {RETRIES: retries, BACKOFF: backoff, BACKOFF_DELAY_MS: backoff_delay_ms}


def encode_caps(
    max_running: int | None,
    rate_limit: tuple[int, int, bool] | None,
    max_running_per_key: int | None = None,
) -> dict[str, Any]:
    """The caps key of a capped job's messages (empty for a job without caps)."""
    caps: dict[str, Any] = {}
    if max_running is not None:
        caps["max_running"] = max_running
    if max_running_per_key is not None:
        caps["per_key"] = max_running_per_key
    if rate_limit is not None:
        caps["rate_limit"] = list(rate_limit)
    return {CAPS: caps} if caps else {}


@dataclass(frozen=True, slots=True)
class Caps:
    """The decoded ``kumiko_caps`` of a message."""

    max_running: int | None = None
    #: (count, per_ms, per_tenant)
    rate_limit: tuple[int, int, bool] | None = None
    max_running_per_key: int | None = None


def encode_run(
    trigger: Trigger,
    *,
    failures: int = 0,
    tenant_id: str | None = None,
    dedup_key: str | None = None,
    scheduled_at: datetime | None = None,
    origin_id: str | None = None,
    batch: str | None = None,
    batch_callback: str | None = None,
    priority: int = 0,
    fair_key: str | None = None,
) -> dict[str, Any]:
    """The per-message keys; those at their default (0 failures, no tenant...) are left out."""
    options: dict[str, Any] = {TRIGGER: trigger}
    route_key = fair_key if fair_key is not None else tenant_id
    if priority or route_key is not None:
        options[ROUTE] = (
            str(priority) if route_key is None else f"{priority}.{fair_digest(route_key)}"
        )
    if fair_key is not None:
        options[FAIR_KEY] = fair_key
    if failures:
        options[FAILURES] = failures
    if tenant_id is not None:
        options[TENANT_ID] = tenant_id
    if dedup_key is not None:
        options[DEDUP_KEY] = dedup_key
    if scheduled_at is not None:
        options[SCHEDULED_AT] = scheduled_at.isoformat()
    if origin_id is not None:
        options[ORIGIN_ID] = origin_id
    if batch is not None:
        options[BATCH] = batch
    if batch_callback is not None:
        options[BATCH_CALLBACK] = batch_callback
    return options


def fair_digest(fair_key: str) -> str:
    """The name a fair key goes by in the lane's keys (16 hex digits): of a fixed length and
    alphabet whatever the key holds, so Lua reads it off a body with one plain search."""
    return hashlib.blake2b(fair_key.encode(), digest_size=8).hexdigest()


_ROUTE = re.compile(r"[0-9](\.[0-9a-f]{16})?")


def encode_trace(
    parent: Mapping[str, str] | None, link: Mapping[str, str] | None
) -> dict[str, Any]:
    """The trace key of a message (empty when there is neither a parent nor a link)."""
    trace = {
        name: dict(carrier)
        for name, carrier in zip(_TRACE_PARTS, (parent, link), strict=True)
        if carrier
    }
    return {TRACE: trace} if trace else {}


@dataclass(frozen=True, slots=True)
class TraceContext:
    """The decoded ``kumiko_trace`` of a message: propagator carriers of the span that
    dispatched the work (``parent``) and of the span it carries on from (``link``)."""

    parent: Mapping[str, str] | None = None
    link: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class KumikoOptions:
    """The decoded kumiko options of one message."""

    retries: int
    backoff: BackoffType | None
    backoff_delay_ms: int | None
    trigger: Trigger
    failures: int = 0
    tenant_id: str | None = None
    dedup_key: str | None = None
    scheduled_at: datetime | None = None
    origin_id: str | None = None
    trace: TraceContext | None = None
    caps: Caps | None = None
    batch: str | None = None
    batch_callback: str | None = None
    #: its priority (0 runs first) and the fair key it was dispatched with (a per-tenant
    #: child's key is its tenant: :attr:`route_key`)
    priority: int = 0
    fair_key: str | None = None

    @property
    def route_key(self) -> str | None:
        """The key it takes its turn under (:attr:`fair_key`, else its tenant)."""
        return self.fair_key if self.fair_key is not None else self.tenant_id

    def encode(self) -> dict[str, Any]:
        """JSON-native options; keys at their default (0 failures, no tenant...) are left out."""
        caps = self.caps
        return {
            **encode_policy(self.retries, self.backoff, self.backoff_delay_ms),
            **(
                encode_caps(caps.max_running, caps.rate_limit, caps.max_running_per_key)
                if caps
                else {}
            ),
            **encode_run(
                self.trigger,
                failures=self.failures,
                tenant_id=self.tenant_id,
                dedup_key=self.dedup_key,
                scheduled_at=self.scheduled_at,
                origin_id=self.origin_id,
                batch=self.batch,
                batch_callback=self.batch_callback,
                priority=self.priority,
                fair_key=self.fair_key,
            ),
            **(encode_trace(self.trace.parent, self.trace.link) if self.trace else {}),
        }

    @classmethod
    def decode(cls, options: Any) -> KumikoOptions:
        """Decode a delivered message's options; :class:`OptionsError` on anything kumiko
        would not have written."""
        if not isinstance(options, Mapping):
            raise OptionsError("options", "must be a JSON object", options)
        retries = _count(options, RETRIES, required=True)
        if retries > MAX_RETRIES:
            raise OptionsError(RETRIES, f"must be at most {MAX_RETRIES}", retries)
        backoff = options.get(BACKOFF)
        if backoff is not None and backoff not in _BACKOFFS:
            raise OptionsError(BACKOFF, 'must be null, "fixed" or "exponential"', backoff)
        delay = options.get(BACKOFF_DELAY_MS)
        if backoff is None:
            if delay is not None:
                raise OptionsError(BACKOFF_DELAY_MS, "must be null without a backoff", delay)
        elif not is_strict_int(delay) or delay <= 0:
            raise OptionsError(BACKOFF_DELAY_MS, "must be a positive integer", delay)
        elif backoff_window_ms(retries, backoff, delay) > MAX_DURATION_MS:
            raise OptionsError(
                BACKOFF_DELAY_MS,
                f"gives a retry window over {MAX_DURATION_MS} ms with {retries} retries",
                delay,
            )
        trigger = options.get(TRIGGER, ...)
        if trigger not in _TRIGGERS:
            raise OptionsError(TRIGGER, f"must be one of {sorted(_TRIGGERS)}", trigger)
        failures = _count(options, FAILURES, required=False)
        if failures > retries:
            raise OptionsError(FAILURES, f"must not exceed {RETRIES} ({retries})", failures)
        return cls(
            retries=retries,
            backoff=cast("BackoffType | None", backoff),
            backoff_delay_ms=delay,
            trigger=cast(Trigger, trigger),
            failures=failures,
            tenant_id=_checked(options, TENANT_ID, tenant_id_problem),
            dedup_key=_checked(options, DEDUP_KEY, dedup_key_problem),
            scheduled_at=_instant(options, SCHEDULED_AT),
            origin_id=_text(options, ORIGIN_ID),
            trace=_trace(options),
            caps=_caps(options),
            batch=_text(options, BATCH),
            batch_callback=_text(options, BATCH_CALLBACK),
            priority=_priority(options),
            fair_key=_checked(options, FAIR_KEY, tenant_id_problem),
        )

    @property
    def max_attempts(self) -> int:
        return self.retries + 1

    @property
    def attempt(self) -> int:
        """The 1-based attempt this message runs as."""
        return self.failures + 1

    def meta(self) -> JobMeta:
        return JobMeta(
            attempt=self.attempt,
            max_attempts=self.max_attempts,
            tenant_id=self.tenant_id,
            trigger=self.trigger,
            scheduled_at=self.scheduled_at,
            dedup_key=self.dedup_key,
        )


def _count(options: Mapping[str, Any], key: str, *, required: bool) -> int:
    if key not in options:
        if required:
            raise OptionsError(key, "is missing")
        return 0
    value = options[key]
    if not is_strict_int(value) or value < 0:
        raise OptionsError(key, "must be an integer >= 0", value)
    return int(value)


def _text(options: Mapping[str, Any], key: str) -> str | None:
    value = options.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise OptionsError(key, "must be a non-empty string", value)
    return value


def _checked(
    options: Mapping[str, Any], key: str, problem_of: Callable[[str], str | None]
) -> str | None:
    text = _text(options, key)
    problem = None if text is None else problem_of(text)
    if problem is not None:
        raise OptionsError(key, problem, text)
    return text


def _instant(options: Mapping[str, Any], key: str) -> datetime | None:
    text = _text(options, key)
    if text is None:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise OptionsError(key, "must be an ISO-8601 datetime", text) from None
    if value.tzinfo is None:
        raise OptionsError(key, "must carry a UTC offset", text)
    return value


def _trace(options: Mapping[str, Any]) -> TraceContext | None:
    if TRACE not in options:
        return None
    value = options[TRACE]
    if not isinstance(value, Mapping) or not value or set(value) - set(_TRACE_PARTS):
        raise OptionsError(TRACE, 'must be an object with "parent" and/or "link"', value)
    parent, link = (_carrier(value, part) for part in _TRACE_PARTS)
    return TraceContext(parent=parent, link=link)


def _priority(options: Mapping[str, Any]) -> int:
    route = options.get(ROUTE)
    if route is None:
        return 0
    if not isinstance(route, str) or not _ROUTE.fullmatch(route):
        raise OptionsError(ROUTE, 'must be "<priority 0-9>" or "<priority>.<16 hex digits>"', route)
    return int(route[0])


def _caps(options: Mapping[str, Any]) -> Caps | None:
    if CAPS not in options:
        return None
    value = options[CAPS]
    if (
        not isinstance(value, Mapping)
        or not value
        or set(value) - {"max_running", "rate_limit", "per_key"}
    ):
        raise OptionsError(
            CAPS, 'must be an object with "max_running", "per_key" and/or "rate_limit"', value
        )
    running = value.get("max_running")
    per_key = value.get("per_key")
    for name, count in (("max_running", running), ("per_key", per_key)):
        if name in value and (not is_strict_int(count) or not 1 <= count <= MAX_CAP_RUNNING):
            raise OptionsError(
                f"{CAPS}.{name}", f"must be an integer from 1 to {MAX_CAP_RUNNING}", count
            )
    rate = value.get("rate_limit")
    limit: tuple[int, int, bool] | None = None
    if "rate_limit" in value:
        if (
            not isinstance(rate, list)
            or len(rate) != 3
            or not is_strict_int(rate[0])
            or not 1 <= rate[0] <= MAX_RATE_COUNT
            or not is_strict_int(rate[1])
            or not 1 <= rate[1] <= MAX_DURATION_MS
            or not isinstance(rate[2], bool)
        ):
            raise OptionsError(
                f"{CAPS}.rate_limit",
                f"must be [count 1 to {MAX_RATE_COUNT}, per_ms 1 to {MAX_DURATION_MS}, "
                "per_tenant bool]",
                rate,
            )
        limit = (int(rate[0]), int(rate[1]), bool(rate[2]))
    if running is None and limit is None and per_key is None:
        raise OptionsError(CAPS, "must hold a cap", value)
    return Caps(max_running=running, rate_limit=limit, max_running_per_key=per_key)


def _carrier(trace: Mapping[str, Any], part: str) -> dict[str, str] | None:
    if part not in trace:
        return None
    carrier = trace[part]
    if (
        not isinstance(carrier, Mapping)
        or not 0 < len(carrier) <= MAX_CARRIER_ENTRIES
        or not all(
            isinstance(name, str)
            and 0 < len(name) <= MAX_CARRIER_NAME
            and isinstance(text, str)
            and len(text) <= MAX_CARRIER_VALUE
            for name, text in carrier.items()
        )
    ):
        raise OptionsError(
            f"{TRACE}.{part}",
            f"must be an object of 1 to {MAX_CARRIER_ENTRIES} strings "
            f"(names up to {MAX_CARRIER_NAME} characters, values up to {MAX_CARRIER_VALUE})",
            carrier,
        )
    return dict(carrier)
