"""Crontab schedules: :class:`Cron` parses an expression once and computes its ticks.

The contract
============

``Cron(expr, timezone="UTC", *, misfire="coalesce", grace_s=60, overlap="allow")``

Fields
------
An expression has 5 or 6 whitespace-separated fields:

* 5 fields: ``minute hour day-of-month month day-of-week`` (fires at second 0);
* 6 fields: ``second minute hour day-of-month month day-of-week``.

Allowed values: second and minute 0-59, hour 0-23, day-of-month 1-31, month 1-12
(or ``JAN``..``DEC``), day-of-week 0-7 (or ``SUN``..``SAT``). Day-of-week numbering:
0 and 7 are both Sunday, 1 is Monday ... 6 is Saturday. Names are case-insensitive and
may appear wherever a number may (``mon-fri``, ``jan/3``); ``SUN`` as the upper end of a
day-of-week range that starts after Sunday means 7 (``fri-sun`` is Friday, Saturday, Sunday;
``sun-sun`` is Sunday only).

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

The fire instants of a cron are ``{instant(w) : w a wall time matching the expression}``,
where ``instant(w)`` reads the naive wall time ``w`` in the zone with ``fold=0``
(``w.replace(tzinfo=zone, fold=0)``). ``next_fire_time(after)`` is the smallest of these
instants strictly after ``after``, whatever the order of the wall times. Hence:

* A wall time that does not exist (spring-forward gap) fires once, shifted forward by the
  size of the gap: ``30 2 * * *`` in Europe/Berlin fires at 03:30 CEST on 2026-03-29, also
  for an ``after`` of 03:10 CEST that day (a scheduler restarted inside the shifted hour
  does not skip the day's run); ``*/15 2 * * *`` fires at 03:00, 03:15, 03:30 and 03:45
  CEST. In Australia/Lord_Howe (02:00 -> 02:30 on 2026-10-04) ``15,40 2 * * *`` fires at
  02:40 (an existing wall time) and then 02:45 (02:15 shifted by 30 minutes).
* A wall time that occurs twice (fall-back) fires once, at its first occurrence. When
  ``after`` lies in the second occurrence, the repeated wall times have had their (only)
  instant already; the next tick is the first matching wall time after the repeated range.
* Two wall times that map to the same instant fire once: ``* * * * *`` yields 01:59 CET,
  03:00 CEST, 03:01 CEST, ... (02:01 maps onto 03:01 CEST).

Consequently, feeding each result back as ``after`` yields strictly increasing instants
and never the same instant twice. Compare results in UTC (``t.astimezone(UTC)``): Python
never treats an ambiguous wall time as equal to a datetime in another zone. The search
assumes that a zone's UTC offset changes by at most 3 hours at a time and not twice within
30 minutes, true of every DST rule in tzdata.

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

# The largest change of a zone's UTC offset the tick search allows for: the largest DST shift
# in tzdata is 2 h (Antarctica/Troll), so 3 h leaves a margin.
_MAX_SHIFT: Final = timedelta(hours=3)

# The zone's offset is probed this often to find its changes; no zone changes it twice within
# this span.
_PROBE_STEP: Final = timedelta(minutes=30)


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


#: What a tick does while the schedule's last run is queued or running (``Cron.overlap``).
OVERLAPS: Final[tuple[str, ...]] = ("allow", "skip", "buffer_one")


def _make_cron(
    expr: str, timezone: str, misfire: Misfire, grace_s: int, overlap: str = "allow"
) -> Cron:
    """Unpickling helper."""
    return Cron(expr, timezone, misfire=misfire, grace_s=grace_s, overlap=overlap)


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
        "_overlap",
        "_seconds",
        "_timezone",
        "_zone",
    )

    _expr: str
    _timezone: str
    _misfire: Misfire
    _grace_s: int
    _overlap: str
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
        overlap: str = "allow",
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

        if not isinstance(overlap, str) or overlap not in OVERLAPS:
            raise JobConfigError(None, subject, f"overlap must be one of {list(OVERLAPS)}", overlap)

        init = object.__setattr__
        init(self, "_overlap", overlap)
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

    @property
    def overlap(self) -> str:
        """What a tick does while the last run of the schedule is queued or running:
        ``"allow"`` (it runs), ``"skip"`` (it is skipped) or ``"buffer_one"`` (it waits behind
        a running one, at most one)."""
        return self._overlap

    # -- value semantics ------------------------------------------------------------------

    def _key(self) -> tuple[str, str, str, int, str]:
        return (self._expr, self._timezone, self._misfire, self._grace_s, self._overlap)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Cron):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"Cron({self._expr!r}, {self._timezone!r}, "
            f"misfire={self._misfire!r}, grace_s={self._grace_s!r}"
            + ("" if self._overlap == "allow" else f", overlap={self._overlap!r}")
            + ")"
        )

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise AttributeError(f"Cron is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"Cron is immutable; cannot delete {name!r}")

    def __reduce__(self) -> tuple[Any, tuple[str, str, Misfire, int, str]]:
        return (
            _make_cron,
            (self._expr, self._timezone, self._misfire, self._grace_s, self._overlap),
        )

    # -- tick computation -----------------------------------------------------------------
    #
    # The fire instants are { instant(w) : w a matching wall time }, instant(w) being w read
    # with fold=0 (see the module docstring). Within a stretch of wall time whose fold=0
    # offset is constant, instant() grows with the wall time, so "the first matching wall
    # time after wall(after)" is the answer there: that is the fast path. Around an offset
    # change it is not: the wall times of a spring-forward gap map to instants AFTER those of
    # the wall times that follow the gap (02:30 -> 03:30 CEST, later than 03:10 CEST), and in
    # a repeated range the wall time after wall(after) may map before `after`. There the
    # search splits wall time into its constant-offset segments and takes, per segment, the
    # first matching wall time whose instant is after `after`; the answer is the smallest.

    def next_fire_time(self, after: datetime) -> datetime:
        """Return the first tick strictly after ``after``.

        ``after`` must be timezone-aware (any zone); a naive datetime raises ``ValueError``.
        The result is an aware datetime in this cron's zone, microsecond 0: the smallest
        fire instant strictly after ``after`` (see the DST rules of the module docstring).
        """
        after_utc = _as_utc(after, "after")
        try:
            return self._next_instant(after_utc).astimezone(self._zone)
        except OverflowError:
            raise ValueError(
                f"{self!r} has no fire time after {after.isoformat()} before year {MAXYEAR}"
            ) from None

    def fire_times(self, after: datetime, until: datetime) -> Iterator[datetime]:
        """Yield every tick ``t`` with ``after < t <= until``, in increasing order.

        Both bounds must be timezone-aware (``ValueError`` otherwise, raised at the call).
        Each tick is the :meth:`next_fire_time` of the previous one, so the instants strictly
        increase and none is yielded twice.
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

    def _next_instant(self, after_utc: datetime) -> datetime:
        """Return the smallest fire instant strictly after ``after_utc``, in UTC.

        With ``w1`` the first matching wall time after wall(``after``) and ``c`` its instant:
        a matching wall time up to wall(``after``) maps at most ``_MAX_SHIFT`` past ``after``,
        and one from ``w1`` on maps at least ``_MAX_SHIFT`` before ``c``; nothing matches in
        between. So when no offset changes within ``_MAX_SHIFT`` of ``after`` and of ``c``,
        ``c`` is the answer; otherwise the answer lies within ``2 * _MAX_SHIFT`` after
        ``after`` or before ``c``, where :meth:`_first_instant_in` searches exactly.
        """
        window = 2 * _MAX_SHIFT
        while True:
            local = after_utc.astimezone(self._zone)
            wall = self._next_wall(local.replace(tzinfo=None, microsecond=0, fold=0) + _ONE_SECOND)
            candidate = self._instant(wall)
            if candidate > after_utc:
                if self._steady_around(after_utc, candidate):
                    return candidate
                if candidate - after_utc <= 2 * window:
                    found = self._first_instant_in(after_utc, candidate)
                else:
                    found = self._first_instant_in(after_utc, after_utc + window)
                    if found is None:
                        found = self._first_instant_in(candidate - window, candidate)
                # `candidate` lies in the searched range, so `found` is never None.
                return candidate if found is None else min(found, candidate)
            # `after` lies in the second occurrence of a repeated range (the first matching
            # wall time maps to its first occurrence, before `after`).
            found = self._first_instant_in(after_utc, after_utc + window)
            if found is not None:
                return found
            after_utc += window  # no fire instant in (after, after + window]

    def _instant(self, wall: datetime) -> datetime:
        """The instant of a naive wall time: ``fold=0``, so a gap wall time maps forward by
        the size of the gap and a repeated one to its first occurrence."""
        return wall.replace(tzinfo=self._zone, fold=0).astimezone(UTC)

    def _offset(self, instant: datetime) -> timedelta:
        offset = instant.astimezone(self._zone).utcoffset()
        if offset is None:  # pragma: no cover - a ZoneInfo always has an offset
            raise ValueError(f"time zone {self._timezone!r} has no UTC offset")
        return offset

    def _steady_around(self, first: datetime, last: datetime) -> bool:
        """Whether the zone's offset is constant within ``_MAX_SHIFT`` of both instants."""
        if last - first <= 2 * _MAX_SHIFT:
            return not self._offset_changes(first - _MAX_SHIFT, last + _MAX_SHIFT, locate=False)
        return not (
            self._offset_changes(first - _MAX_SHIFT, first + _MAX_SHIFT, locate=False)
            or self._offset_changes(last - _MAX_SHIFT, last + _MAX_SHIFT, locate=False)
        )

    def _offset_changes(
        self, low: datetime, high: datetime, *, locate: bool = True
    ) -> list[tuple[datetime, timedelta, timedelta]]:
        """Return the zone's offset changes in ``[low, high]`` (UTC) as (first instant with
        the new offset, offset before, offset after), oldest first.

        The offset is probed every ``_PROBE_STEP`` (no zone changes it twice that fast) and
        each change is located to the second by bisection unless ``locate`` is false.
        """
        changes: list[tuple[datetime, timedelta, timedelta]] = []
        probe = low.replace(microsecond=0)
        offset = self._offset(probe)
        while probe < high:
            following = probe + _PROBE_STEP
            following_offset = self._offset(following)
            if following_offset != offset:
                if not locate:
                    return [(following, offset, following_offset)]
                below, above = probe, following
                while (span := int((above - below).total_seconds())) > 1:
                    middle = below + timedelta(seconds=span // 2)
                    if self._offset(middle) == offset:
                        below = middle
                    else:
                        above = middle
                changes.append((above, offset, following_offset))
            probe, offset = following, following_offset
        return changes

    def _first_instant_in(self, low: datetime, high: datetime) -> datetime | None:
        """Return the smallest fire instant ``t`` with ``low < t <= high`` (UTC), if any.

        Wall time is cut into segments of constant ``fold=0`` offset: an offset change at
        instant ``T`` from ``before`` to ``after`` ends the old offset's wall times at
        ``T + max(before, after)`` (a gap's wall times and a repeated range's first
        occurrence keep the old offset). Offset changes up to ``_MAX_SHIFT`` outside
        ``[low, high]`` are taken into account; further ones cannot move a wall time into it.
        Within a segment the instant grows with the wall time, so the first matching wall
        time whose instant is past ``low`` is the segment's smallest.
        """
        changes = self._offset_changes(low - _MAX_SHIFT, high + _MAX_SHIFT)
        first_offset = self._offset(low - _MAX_SHIFT)
        starts: list[datetime | None] = [None]
        offsets = [first_offset]
        for change, before, after in changes:
            starts.append((change + max(before, after)).replace(tzinfo=None))
            offsets.append(after)
        ends = [*starts[1:], None]

        best: datetime | None = None
        for start, end, offset in zip(starts, ends, offsets, strict=True):
            # Whole-second wall times w with low < w - offset <= high, inside the segment.
            first = (low + offset).replace(tzinfo=None, microsecond=0) + _ONE_SECOND
            last = (high + offset).replace(tzinfo=None, microsecond=0)
            if start is not None:
                first = max(first, start)
            if end is not None:
                last = min(last, end - _ONE_SECOND)
            if first > last:
                continue
            wall = self._first_wall(first, last)
            if wall is not None:
                instant = self._instant(wall)
                if best is None or instant < best:
                    best = instant
        return best

    def _next_wall(self, start: datetime) -> datetime:
        """Return the earliest matching naive wall time ``>= start`` (microsecond 0)."""
        last_year = min(start.year + _SEARCH_YEARS, MAXYEAR)
        wall = self._first_wall(start, datetime(last_year, 12, 31, 23, 59, 59))
        if wall is None:
            raise OverflowError("no matching wall time in the supported date range")
        return wall

    def _first_wall(self, start: datetime, last: datetime) -> datetime | None:
        """Return the earliest matching naive wall time in ``[start, last]``, if any."""
        year, month, day = start.year, start.month, start.day
        time_from = (start.hour, start.minute, start.second)
        last_day = last.date()
        while (year, month) <= (last_day.year, last_day.month):
            if month in self._months:
                days_in_month = calendar.monthrange(year, month)[1]
                cron_weekday = (calendar.weekday(year, month, day) + 1) % 7
                for current_day in range(day, days_in_month + 1):
                    if self._day_matches(current_day, cron_weekday):
                        time = self._next_time(*time_from)
                        if time is not None:
                            wall = datetime(year, month, current_day, *time)
                            return wall if wall <= last else None
                    time_from = (0, 0, 0)
                    cron_weekday = (cron_weekday + 1) % 7
            month += 1
            day = 1
            time_from = (0, 0, 0)
            if month > 12:
                month = 1
                year += 1
        return None

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
