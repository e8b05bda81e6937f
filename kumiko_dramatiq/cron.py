"""Crontab schedules: :class:`Cron` parses an expression once and computes its ticks.

The contract
============

``Cron(expr, timezone="UTC", *, misfire="coalesce", grace_s=60)``

Fields
------
An expression has 5 or 6 whitespace-separated fields:

* 5 fields: ``minute hour day-of-month month day-of-week`` (fires at second 0);
* 6 fields: ``second minute hour day-of-month month day-of-week``.

Allowed values: second and minute 0-59, hour 0-23, day-of-month 1-31, month 1-12
(or ``JAN``..``DEC``), day-of-week 0-7 (or ``SUN``..``SAT``). Day-of-week numbering:
0 and 7 are both Sunday, 1 is Monday ... 6 is Saturday. Names are case-insensitive and
may appear wherever a number may (``mon-fri``, ``jan/3``); ``SUN`` as the upper end of a
day-of-week range means 7 (``fri-sun`` is Friday, Saturday, Sunday).

Each field is a comma-separated list of parts; a part is one of

* ``*`` -- every value of the field;
* ``a`` -- one value;
* ``a-b`` -- an inclusive range (``a <= b``);
* ``*/n``, ``a-b/n``, ``a/n`` -- every n-th value of ``*``, of ``a-b``, or of ``a`` up to
  the field maximum (n >= 1; a step larger than the range just yields its start).

``?``, ``L``, ``W``, ``#``, ``@daily`` and other extensions are not supported. Anything
that does not parse, an out-of-range value, a reversed range, a zero step, an empty list
element or a field count other than 5 or 6 raises :class:`~kumiko_dramatiq.errors.JobConfigError`
at construction, as does an expression that can never fire (``0 0 30 2 *``).

Day rule (vixie cron)
---------------------
A field is *unrestricted* exactly when its text starts with ``*`` (so ``*/2`` counts as
unrestricted). If day-of-month and day-of-week are both restricted, a day matches when
EITHER matches (``0 0 13 * 5`` fires on every 13th and on every Friday). Otherwise a day
must match both sets; with a plain ``*`` that means only the other field applies.

Time zones and DST
------------------
Ticks are wall-clock times in ``timezone`` (an IANA name resolved with
:class:`zoneinfo.ZoneInfo`). Results are aware datetimes in that zone with microsecond 0;
instants are always compared in UTC.

* A wall time that does not exist (spring-forward gap) fires once, at the instant it maps
  to with ``fold=0``, i.e. shifted forward by the size of the gap: ``30 2 * * *`` in
  Europe/Berlin fires at 03:30 CEST on 2026-03-29. Further gap wall times that would map
  onto an instant already returned, or not strictly after ``after``, are skipped, so
  ``* * * * *`` yields 01:59 CET, 03:00 CEST, 03:01 CEST, ...
* A wall time that occurs twice (fall-back) fires once, at its first occurrence
  (``fold=0``). When ``after`` lies in the second occurrence, the next tick is the first
  wall time whose ``fold=0`` instant is strictly after ``after``.

Consequently, feeding each result back as ``after`` yields strictly increasing instants
and never the same instant twice. Compare results in UTC (``t.astimezone(UTC)``): Python
never treats an ambiguous wall time as equal to a datetime in another zone.

``next_fire_time(after)`` and ``fire_times(after, until)`` take aware datetimes in any zone;
a naive one raises ``ValueError`` (a non-datetime ``TypeError``).

``misfire`` (``"coalesce"`` or ``"skip"``) and ``grace_s`` (a positive int, seconds) are
validated and carried for the scheduler; they do not influence tick computation.
"""

from __future__ import annotations

import calendar
import re
from bisect import bisect_left
from collections.abc import Iterator
from datetime import MAXYEAR, UTC, datetime, timedelta
from typing import Any, Final, Literal, NoReturn
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from kumiko_dramatiq.errors import JobConfigError

__all__ = ["Cron", "Misfire"]

Misfire = Literal["coalesce", "skip"]

_MISFIRE_POLICIES: Final = ("coalesce", "skip")

_FIELDS_5: Final = ("minute", "hour", "day-of-month", "month", "day-of-week")
_FIELDS_6: Final = ("second", *_FIELDS_5)

_BOUNDS: Final[dict[str, tuple[int, int]]] = {
    "second": (0, 59),
    "minute": (0, 59),
    "hour": (0, 23),
    "day-of-month": (1, 31),
    "month": (1, 12),
    "day-of-week": (0, 7),
}

_MONTH_NAMES: Final = {
    name: number
    for number, name in enumerate(
        ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"),
        start=1,
    )
}
_DOW_NAMES: Final = {
    name: number for number, name in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))
}
_NAMES: Final[dict[str, dict[str, int]]] = {"month": _MONTH_NAMES, "day-of-week": _DOW_NAMES}

_DIGITS: Final = re.compile(r"[0-9]{1,9}")

# Longest month length per month, counting February 29 (leap years).
_MAX_DAYS: Final = (0, 31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)

# Every valid expression fires within one 400-year Gregorian cycle.
_SEARCH_YEARS: Final = 401

_ONE_SECOND: Final = timedelta(seconds=1)


class _ParseError(Exception):
    """Internal: one field could not be parsed; turned into a JobConfigError."""


def _parse_value(text: str, field: str) -> int:
    names = _NAMES.get(field)
    if names is not None and text.lower() in names:
        return names[text.lower()]
    if not _DIGITS.fullmatch(text):
        kind = "a number or a name" if names is not None else "a number"
        raise _ParseError(f"{text!r} is not {kind}")
    value = int(text)
    low, high = _BOUNDS[field]
    if not low <= value <= high:
        raise _ParseError(f"{value} is out of range {low}-{high}")
    return value


def _parse_part(part: str, field: str) -> range:
    low, high = _BOUNDS[field]
    if not part:
        raise _ParseError("empty list element")
    base, slash, step_text = part.partition("/")
    step = 1
    if slash:
        if not _DIGITS.fullmatch(step_text):
            raise _ParseError(f"step {step_text!r} in {part!r} is not a positive number")
        step = int(step_text)
        if step < 1:
            raise _ParseError(f"step in {part!r} must be at least 1")
    if base == "*":
        return range(low, high + 1, step)
    if not base:
        raise _ParseError(f"{part!r} has no start value")
    first_text, dash, last_text = base.partition("-")
    first = _parse_value(first_text, field)
    if dash:
        last = _parse_value(last_text, field)
        if field == "day-of-week" and last_text.lower() == "sun" and first > 0:
            last = 7
        if last < first:
            raise _ParseError(f"range {base!r} is reversed ({first} > {last})")
    else:
        last = high if slash else first
    return range(first, last + 1, step)


def _parse_field(text: str, field: str) -> tuple[int, ...]:
    values: set[int] = set()
    for part in text.split(","):
        values.update(_parse_part(part, field))
    if field == "day-of-week" and 7 in values:
        values.discard(7)
        values.add(0)
    return tuple(sorted(values))


def _make_cron(expr: str, timezone: str, misfire: Misfire, grace_s: int) -> Cron:
    """Unpickling helper."""
    return Cron(expr, timezone, misfire=misfire, grace_s=grace_s)


class Cron:
    """A crontab schedule evaluated in an IANA time zone; immutable and hashable.

    See the module docstring for the supported syntax, the day-of-month/day-of-week
    rule and the DST rules. Every invalid argument raises
    :class:`~kumiko_dramatiq.errors.JobConfigError` here, never later.
    """

    __slots__ = (
        "_days_or",
        "_dom",
        "_dow",
        "_expr",
        "_grace_s",
        "_hours",
        "_minutes",
        "_misfire",
        "_months",
        "_seconds",
        "_timezone",
        "_zone",
    )

    _expr: str
    _timezone: str
    _misfire: Misfire
    _grace_s: int
    _zone: ZoneInfo
    _seconds: tuple[int, ...]
    _minutes: tuple[int, ...]
    _hours: tuple[int, ...]
    _dom: frozenset[int]
    _months: frozenset[int]
    _dow: frozenset[int]
    _days_or: bool

    def __init__(
        self,
        expr: str,
        timezone: str = "UTC",
        *,
        misfire: Misfire = "coalesce",
        grace_s: int = 60,
    ) -> None:
        if not isinstance(expr, str):
            raise JobConfigError(None, "cron expression", "must be a string", value=expr)
        subject = f"cron {expr!r}"

        texts = expr.split()
        if len(texts) not in (5, 6):
            raise JobConfigError(
                None,
                subject,
                f"has {len(texts)} field(s), expected 5 "
                "(minute hour day-of-month month day-of-week) or 6 (second first)",
            )
        if len(texts) == 5:
            texts = ["0", *texts]
        parsed: dict[str, tuple[int, ...]] = {}
        for field, text in zip(_FIELDS_6, texts, strict=True):
            try:
                parsed[field] = _parse_field(text, field)
            except _ParseError as exc:
                raise JobConfigError(None, subject, f"{field} field: {exc}") from None

        dom_star = texts[3].startswith("*")
        dow_star = texts[5].startswith("*")
        days_or = not dom_star and not dow_star
        if not days_or and not any(
            day <= _MAX_DAYS[month] for month in parsed["month"] for day in parsed["day-of-month"]
        ):
            # With the AND rule a (month, day) pair must exist; any such pair falls on every
            # weekday in some year (February 29 included), so the weekday set cannot starve it.
            # With the OR rule every month contains every weekday, so it always fires.
            raise JobConfigError(
                None, subject, "never fires: no month has any of the given days of the month"
            )

        if not isinstance(timezone, str):
            raise JobConfigError(
                None, subject, "timezone must be an IANA time zone name", value=timezone
            )
        try:
            zone = ZoneInfo(timezone)
        except (ZoneInfoNotFoundError, ValueError, OSError):
            raise JobConfigError(
                None, subject, "timezone is not a known IANA time zone", value=timezone
            ) from None

        if not isinstance(misfire, str) or misfire not in _MISFIRE_POLICIES:
            raise JobConfigError(None, subject, "misfire must be 'coalesce' or 'skip'", misfire)
        if isinstance(grace_s, bool) or not isinstance(grace_s, int) or grace_s <= 0:
            raise JobConfigError(
                None, subject, "grace_s must be a positive integer (seconds)", grace_s
            )

        init = object.__setattr__
        init(self, "_expr", expr)
        init(self, "_timezone", timezone)
        init(self, "_misfire", misfire)
        init(self, "_grace_s", grace_s)
        init(self, "_zone", zone)
        init(self, "_seconds", parsed["second"])
        init(self, "_minutes", parsed["minute"])
        init(self, "_hours", parsed["hour"])
        init(self, "_dom", frozenset(parsed["day-of-month"]))
        init(self, "_months", frozenset(parsed["month"]))
        init(self, "_dow", frozenset(parsed["day-of-week"]))
        init(self, "_days_or", days_or)

    # -- read-only attributes -------------------------------------------------------------

    @property
    def expr(self) -> str:
        """The expression exactly as given."""
        return self._expr

    @property
    def timezone(self) -> str:
        """The IANA time zone name exactly as given."""
        return self._timezone

    @property
    def misfire(self) -> Misfire:
        """Misfire policy for the scheduler: ``"coalesce"`` or ``"skip"``."""
        return self._misfire

    @property
    def grace_s(self) -> int:
        """Misfire grace period for the scheduler, in seconds."""
        return self._grace_s

    # -- value semantics ------------------------------------------------------------------

    def _key(self) -> tuple[str, str, str, int]:
        return (self._expr, self._timezone, self._misfire, self._grace_s)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Cron):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"Cron({self._expr!r}, {self._timezone!r}, "
            f"misfire={self._misfire!r}, grace_s={self._grace_s!r})"
        )

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise AttributeError(f"Cron is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"Cron is immutable; cannot delete {name!r}")

    def __reduce__(self) -> tuple[Any, tuple[str, str, Misfire, int]]:
        return (_make_cron, (self._expr, self._timezone, self._misfire, self._grace_s))

    # -- tick computation -----------------------------------------------------------------

    def next_fire_time(self, after: datetime) -> datetime:
        """Return the first tick strictly after ``after``.

        ``after`` must be timezone-aware (any zone); a naive datetime raises ``ValueError``.
        The result is an aware datetime in this cron's zone, microsecond 0. Gap and
        repeated wall times follow the DST rules of the module docstring.
        """
        after_utc = _as_utc(after, "after")
        try:
            local = after_utc.astimezone(self._zone)
            start = local.replace(tzinfo=None, microsecond=0, fold=0) + _ONE_SECOND
            while True:
                wall = self._next_wall(start)
                instant = wall.replace(tzinfo=self._zone).astimezone(UTC)
                if instant > after_utc:
                    return instant.astimezone(self._zone)
                # Only reachable when `after` lies in the second occurrence of a repeated
                # wall-clock range: this wall time's first occurrence is already past.
                start = self._first_wall_after(wall, after_utc)
        except OverflowError:
            raise ValueError(
                f"{self!r} has no fire time after {after.isoformat()} before year {MAXYEAR}"
            ) from None

    def fire_times(self, after: datetime, until: datetime) -> Iterator[datetime]:
        """Yield every tick ``t`` with ``after < t <= until``, in increasing order.

        Both bounds must be timezone-aware (``ValueError`` otherwise, raised at the call).
        """
        after_utc = _as_utc(after, "after")
        until_utc = _as_utc(until, "until")
        return self._iter_fire_times(after_utc, until_utc)

    def _iter_fire_times(self, after_utc: datetime, until_utc: datetime) -> Iterator[datetime]:
        current = after_utc
        while current < until_utc:
            tick = self.next_fire_time(current)
            current = tick.astimezone(UTC)
            if current > until_utc:
                return
            yield tick

    def _first_wall_after(self, wall: datetime, after_utc: datetime) -> datetime:
        """Return the smallest whole-second wall time > ``wall`` whose first occurrence
        (``fold=0``) is strictly after ``after_utc``, given that ``wall``'s is not.

        Inside a repeated range the ``fold=0`` instant grows with the wall time, so an
        exponential then binary search over whole seconds finds the boundary in a few steps
        instead of testing every candidate of, say, ``* * * * * *`` in the repeated hour.
        """

        def passes(candidate: datetime) -> bool:
            return candidate.replace(tzinfo=self._zone).astimezone(UTC) > after_utc

        low, span = wall, 1
        high = wall + _ONE_SECOND
        while not passes(high):
            low, span = high, span * 2
            high = wall + timedelta(seconds=span)
        while (gap := (high - low) // _ONE_SECOND) > 1:
            middle = low + timedelta(seconds=gap // 2)
            if passes(middle):
                high = middle
            else:
                low = middle
        return high

    def _next_wall(self, start: datetime) -> datetime:
        """Return the earliest matching naive wall time ``>= start`` (microsecond 0)."""
        year, month, day = start.year, start.month, start.day
        time_from = (start.hour, start.minute, start.second)
        last_year = min(year + _SEARCH_YEARS, MAXYEAR)
        while year <= last_year:
            if month in self._months:
                days_in_month = calendar.monthrange(year, month)[1]
                cron_weekday = (calendar.weekday(year, month, day) + 1) % 7
                for current_day in range(day, days_in_month + 1):
                    if self._day_matches(current_day, cron_weekday):
                        time = self._next_time(*time_from)
                        if time is not None:
                            return datetime(year, month, current_day, *time)
                    time_from = (0, 0, 0)
                    cron_weekday = (cron_weekday + 1) % 7
            month += 1
            day = 1
            time_from = (0, 0, 0)
            if month > 12:
                month = 1
                year += 1
        raise OverflowError("no matching wall time in the supported date range")

    def _day_matches(self, day: int, cron_weekday: int) -> bool:
        dom_ok = day in self._dom
        dow_ok = cron_weekday in self._dow
        return (dom_ok or dow_ok) if self._days_or else (dom_ok and dow_ok)

    def _next_time(self, hour: int, minute: int, second: int) -> tuple[int, int, int] | None:
        """Return the earliest matching (hour, minute, second) ``>=`` the given one, if any."""
        hours, minutes, seconds = self._hours, self._minutes, self._seconds
        for h in hours[bisect_left(hours, hour) :]:
            minute_from = minute if h == hour else 0
            for m in minutes[bisect_left(minutes, minute_from) :]:
                second_from = second if (h == hour and m == minute) else 0
                index = bisect_left(seconds, second_from)
                if index < len(seconds):
                    return (h, m, seconds[index])
        return None


def _as_utc(value: datetime, name: str) -> datetime:
    if not isinstance(value, datetime):
        raise TypeError(f"{name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware, got naive datetime {value.isoformat()}")
    return value.astimezone(UTC)
