"""Cron ticks around DST changes, checked against an independent reference.

The rule (module docstring of kumiko_dramatiq.cron): the fire instants of a cron are
``{instant(w) : w a matching wall time}`` with ``instant(w) = w.replace(tzinfo=zone,
fold=0)`` in UTC, deduplicated; ``next_fire_time(after)`` is the smallest one after ``after``.

The reference below implements exactly that and nothing more: its own field parser, every
wall time of a window enumerated minute by minute (and, for 6-field expressions, every
second of a matching minute), each matching one mapped with ``fold=0``, deduplicated and
sorted. It shares no code with :mod:`kumiko_dramatiq.cron`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta, timezone
from functools import cache
from itertools import pairwise
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kumiko_dramatiq.cron import Cron

BERLIN = ZoneInfo("Europe/Berlin")
LORD_HOWE = ZoneInfo("Australia/Lord_Howe")

ZONES = (
    "Europe/Berlin",
    "America/New_York",
    "Australia/Lord_Howe",  # 30-minute DST
    "Australia/Sydney",  # southern hemisphere
    "America/Santiago",  # changes at midnight
    "UTC",
)

# The zones above shift their offset by at most one hour; the reference's windows rely on it
# (see test_the_zones_shift_by_at_most_one_hour).
MAX_SHIFT = timedelta(hours=1)


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


# -- the reference ----------------------------------------------------------------------------

BOUNDS = {
    "second": (0, 59),
    "minute": (0, 59),
    "hour": (0, 23),
    "day-of-month": (1, 31),
    "month": (1, 12),
    "day-of-week": (0, 7),
}
MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
WEEKDAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
NAMES = {
    "month": {name: number for number, name in enumerate(MONTHS, start=1)},
    "day-of-week": {name: number for number, name in enumerate(WEEKDAYS)},
}


def reference_number(text: str, field: str) -> int:
    names = NAMES.get(field, {})
    return names[text.lower()] if text.lower() in names else int(text)


def reference_field(text: str, field: str) -> frozenset[int]:
    """The values of one field: ``*``, ``a``, ``a-b``, ``*/n``, ``a-b/n``, ``a/n``, lists."""
    low, high = BOUNDS[field]
    values: set[int] = set()
    for part in text.split(","):
        base, _, step_text = part.partition("/")
        step = int(step_text) if step_text else 1
        if base == "*":
            first, last = low, high
        elif "-" in base:
            first_text, last_text = base.split("-")
            first = reference_number(first_text, field)
            last = reference_number(last_text, field)
            if field == "day-of-week" and last_text.lower() == "sun" and first > 0:
                last = 7  # "fri-sun": Friday through Sunday
        else:
            first = reference_number(base, field)
            last = high if step_text else first
        values.update(range(first, last + 1, step))
    if field == "day-of-week" and 7 in values:
        values = (values - {7}) | {0}  # 7 is Sunday too
    return frozenset(values)


@dataclass(frozen=True)
class Reference:
    seconds: frozenset[int]
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    either_day: bool  # both day fields restricted: a day matching either one fires

    @classmethod
    def parse(cls, expr: str) -> Reference:
        texts = expr.split()
        if len(texts) == 5:
            texts = ["0", *texts]
        second, minute, hour, day, month, weekday = texts
        return cls(
            seconds=reference_field(second, "second"),
            minutes=reference_field(minute, "minute"),
            hours=reference_field(hour, "hour"),
            days=reference_field(day, "day-of-month"),
            months=reference_field(month, "month"),
            weekdays=reference_field(weekday, "day-of-week"),
            either_day=not day.startswith("*") and not weekday.startswith("*"),
        )

    def day_matches(self, day: date) -> bool:
        if day.month not in self.months:
            return False
        day_ok = day.day in self.days
        weekday_ok = day.isoweekday() % 7 in self.weekdays
        return (day_ok or weekday_ok) if self.either_day else (day_ok and weekday_ok)

    def walls(self, first: datetime, last: datetime) -> Iterator[datetime]:
        """Every matching naive wall time in ``[first, last]``, scanning minute by minute."""
        minute = first.replace(second=0, microsecond=0)
        while minute <= last:
            if (
                minute.minute in self.minutes
                and minute.hour in self.hours
                and self.day_matches(minute.date())
            ):
                for second in sorted(self.seconds):
                    wall = minute.replace(second=second)
                    if first <= wall <= last:
                        yield wall
            minute += timedelta(minutes=1)

    def instants(self, zone: ZoneInfo, low: datetime, high: datetime) -> list[datetime]:
        """The fire instants ``t`` with ``low < t <= high`` (UTC), sorted, each once.

        Wall times more than MAX_SHIFT outside wall(low)..wall(high) cannot map into the range.
        """
        first = low.astimezone(zone).replace(tzinfo=None) - MAX_SHIFT
        last = high.astimezone(zone).replace(tzinfo=None) + MAX_SHIFT
        mapped = {
            wall.replace(tzinfo=zone, fold=0).astimezone(UTC) for wall in self.walls(first, last)
        }
        return sorted(instant for instant in mapped if low < instant <= high)

    def next_within(self, zone: ZoneInfo, after: datetime, horizon: timedelta) -> datetime | None:
        """The first fire instant after ``after`` if it comes within ``horizon``, else None."""
        instants = self.instants(zone, after.astimezone(UTC), after.astimezone(UTC) + horizon)
        return instants[0] if instants else None


@cache
def dst_changes_2026(zone_name: str) -> tuple[datetime, ...]:
    """The first whole UTC hour after each 2026 offset change, found hour by hour."""
    zone = ZoneInfo(zone_name)
    changes = []
    hour = datetime(2026, 1, 1, tzinfo=UTC)
    offset = hour.astimezone(zone).utcoffset()
    while hour.year == 2026:
        hour += timedelta(hours=1)
        following = hour.astimezone(zone).utcoffset()
        if following != offset:
            changes.append(hour)
        offset = following
    return tuple(changes)


def walk(cron: Cron, start: datetime, end: datetime) -> list[datetime]:
    """Feed each tick back as ``after`` from ``start`` until past ``end``; ticks in UTC."""
    ticks: list[datetime] = []
    current = start
    while True:
        tick = cron.next_fire_time(current).astimezone(UTC)
        assert tick > current, f"{cron!r}: {tick} after {current} does not move forward"
        if tick > end:
            return ticks
        ticks.append(tick)
        current = tick


def test_the_zones_shift_by_at_most_one_hour() -> None:
    for name in ZONES:
        zone = ZoneInfo(name)
        for change in dst_changes_2026(name):
            before = (change - timedelta(hours=1)).astimezone(zone).utcoffset()
            after = change.astimezone(zone).utcoffset()
            assert before is not None
            assert after is not None
            assert abs(after - before) <= MAX_SHIFT, name
    assert len(dst_changes_2026("UTC")) == 0
    assert all(len(dst_changes_2026(name)) == 2 for name in ZONES[:-1])


def test_the_reference_knows_the_documented_examples() -> None:
    # A gap wall time maps forward by the size of the gap; a repeated one to its first time.
    reference = Reference.parse("30 2 * * *")
    assert reference.instants(BERLIN, utc(2026, 3, 28, 12), utc(2026, 3, 29, 12)) == [
        utc(2026, 3, 29, 1, 30)  # 03:30 CEST
    ]
    assert reference.instants(BERLIN, utc(2026, 10, 24, 12), utc(2026, 10, 25, 12)) == [
        utc(2026, 10, 25, 0, 30)  # 02:30 CEST, the first occurrence
    ]
    either = Reference.parse("0 0 13 * fri")
    assert either.day_matches(date(2026, 2, 6))  # a Friday
    assert either.day_matches(date(2026, 4, 13))  # a Monday, but the 13th
    assert Reference.parse("0 0 * * fri-sun").weekdays == {5, 6, 0}
    assert Reference.parse("0 0 * * sun-sun").weekdays == {0}
    assert Reference.parse("0 0 * * 5/2").weekdays == {5, 0}
    assert Reference.parse("0 0 * FEB-apr/2 *").months == {2, 4}


# -- reproducers --------------------------------------------------------------------------------


def test_lord_howe_half_hour_gap_fires_the_existing_wall_time_then_the_shifted_one() -> None:
    # Given Lord Howe's 30-minute spring forward: 02:00 +10:30 -> 02:30 +11:00 on 2026-10-04
    cron = Cron("15,40 2 * * *", "Australia/Lord_Howe")
    start = datetime(2026, 10, 4, 1, 0, tzinfo=LORD_HOWE)
    end = datetime(2026, 10, 4, 4, 0, tzinfo=LORD_HOWE)

    # When listing its ticks from 01:00 to 04:00 local
    ticks = list(cron.fire_times(start, end))

    # Then 02:40 (which exists) fires, and 02:15 (which does not) fires shifted to 02:45
    assert [tick.isoformat() for tick in ticks] == [
        "2026-10-04T02:40:00+11:00",
        "2026-10-04T02:45:00+11:00",
    ]
    after_the_gap = datetime(2026, 10, 4, 2, 31, tzinfo=LORD_HOWE)
    assert cron.next_fire_time(after_the_gap) == ticks[0]
    assert cron.next_fire_time(ticks[0]) == ticks[1]


@pytest.mark.parametrize(
    ("zone_name", "day", "offset"),
    [
        ("Europe/Berlin", date(2026, 3, 29), "+02:00"),
        ("America/New_York", date(2026, 3, 8), "-04:00"),
    ],
)
@pytest.mark.parametrize("restart", [(3, 0, 0), (3, 10, 0), (3, 29, 59)])
def test_a_scheduler_restarted_inside_the_shifted_hour_does_not_skip_the_gap_run(
    zone_name: str, day: date, offset: str, restart: tuple[int, int, int]
) -> None:
    # Given a daily 02:30 run on the spring-forward day, when 02:30 does not exist
    cron = Cron("30 2 * * *", zone_name)
    # And a scheduler (re)started between 03:00 and 03:30 (summer time)
    after = datetime(day.year, day.month, day.day, *restart, tzinfo=ZoneInfo(zone_name))

    # When it asks for the next tick
    tick = cron.next_fire_time(after)

    # Then the day's run still fires, at 02:30 shifted by the gap: 03:30 summer time
    assert tick.isoformat() == f"{day.isoformat()}T03:30:00{offset}"
    # And the run after it is the next day's 02:30
    assert cron.next_fire_time(tick).isoformat() == f"{day + timedelta(days=1)}T02:30:00{offset}"


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("*/15 2 * * *", ["03:00 CEST", "03:15 CEST", "03:30 CEST", "03:45 CEST"]),
        ("0,30 2 * * *", ["03:00 CEST", "03:30 CEST"]),
    ],
)
def test_every_gap_wall_time_fires_once_at_its_shifted_instant(
    expr: str, expected: list[str]
) -> None:
    # Given expressions that only match wall times of Berlin's spring-forward gap
    cron = Cron(expr, "Europe/Berlin")
    # When listing the ticks of that night
    ticks = cron.fire_times(
        datetime(2026, 3, 29, 0, 0, tzinfo=BERLIN), datetime(2026, 3, 29, 6, 0, tzinfo=BERLIN)
    )
    # Then each gap wall time fires once, an hour later
    assert [tick.strftime("%H:%M %Z") for tick in ticks] == expected


# -- property: next_fire_time equals the reference -----------------------------------------------


def field_part(draw: st.DrawFn, field: str, near: list[int]) -> str:
    """One list element; its values are often taken from ``near``."""
    low, high = BOUNDS[field]
    names = NAMES.get(field)

    def value() -> int:
        if not near or draw(st.booleans()):
            return draw(st.integers(low, high))
        return draw(st.sampled_from(near))

    def show(number: int) -> str:
        if names is None or not draw(st.booleans()):
            return str(number)
        name = WEEKDAYS[number % 7] if field == "day-of-week" else MONTHS[number - 1]
        return draw(st.sampled_from([name, name.upper(), name.title()]))

    kind = draw(st.sampled_from(["*", "*/n", "a", "a-b", "a-b/n", "a/n"]))
    step = draw(st.integers(1, high - low + 2))
    first, last = sorted((value(), value()))
    if kind == "*":
        return "*"
    if kind == "*/n":
        return f"*/{step}"
    if kind == "a":
        return show(first)
    if kind == "a-b":
        return f"{show(first)}-{show(last)}"
    if kind == "a-b/n":
        return f"{show(first)}-{show(last)}/{step}"
    return f"{show(first)}/{step}"


def field_text(draw: st.DrawFn, field: str, near: list[int], *, star: bool) -> str:
    """A field of 1-3 parts, or, often when ``star``, just ``*``."""
    if star and draw(st.booleans()):
        return "*"
    count = draw(st.integers(1, 3))
    return ",".join(field_part(draw, field, near) for _ in range(count))


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, str, datetime]:
    """An expression, a zone and an ``after`` within 3 h of one of the zone's 2026 DST changes
    (UTC: of Berlin's), shown in UTC, in the zone or in a third zone.

    The expression's hours, days and months are often those of the wall times around the
    change, so that gap and repeated wall times match."""
    zone_name = draw(st.sampled_from(ZONES))
    zone = ZoneInfo(zone_name)
    anchor = draw(st.sampled_from(dst_changes_2026(zone_name) or dst_changes_2026(BERLIN.key)))
    # Often just after the change, where gap wall times map past wall(after).
    seconds = draw(st.integers(-3 * 3600, 3 * 3600) | st.integers(0, 3600))
    microseconds = draw(st.sampled_from([0, 0, 1, 500_000, 999_999]))
    after = anchor + timedelta(seconds=seconds, microseconds=microseconds)
    shown_in = draw(st.sampled_from([UTC, zone, timezone(timedelta(hours=9, minutes=30))]))

    # Wall clock hours around the change, those of a gap included.
    earliest = (anchor - timedelta(hours=3)).astimezone(zone).replace(tzinfo=None)
    walls = [earliest + timedelta(hours=hours) for hours in range(7)]
    fields = [
        field_text(draw, "minute", [0, 15, 29, 30, 45, 59], star=False),
        field_text(draw, "hour", sorted({wall.hour for wall in walls}), star=True),
        field_text(draw, "day-of-month", sorted({wall.day for wall in walls}), star=True),
        field_text(draw, "month", sorted({wall.month for wall in walls}), star=True),
        field_text(draw, "day-of-week", sorted({wall.isoweekday() for wall in walls}), star=True),
    ]
    if draw(st.integers(0, 3)) == 0:
        fields.insert(0, field_text(draw, "second", [0, 30, 59], star=False))
    return " ".join(fields), zone_name, after.astimezone(shown_in)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(case=cases())
def test_next_fire_time_is_the_first_reference_instant_after(
    case: tuple[str, str, datetime],
) -> None:
    expr, zone_name, after = case
    zone = ZoneInfo(zone_name)
    # 6-field expressions may match every second: a shorter horizon keeps the reference cheap.
    horizon = timedelta(hours=1) if len(expr.split()) == 6 else timedelta(hours=6)

    expected = Reference.parse(expr).next_within(zone, after, horizon)
    tick = Cron(expr, zone_name).next_fire_time(after)

    if expected is None:
        # No tick within the horizon: Cron must agree (its tick comes later).
        assert tick.astimezone(UTC) > after.astimezone(UTC) + horizon
    else:
        assert tick.astimezone(UTC) == expected
        assert (tick.isoformat(), tick.fold) == (
            expected.astimezone(zone).isoformat(),
            expected.astimezone(zone).fold,
        )
    assert tick.astimezone(UTC) > after.astimezone(UTC)
    assert tick.tzinfo is zone
    assert tick.microsecond == 0


# -- walking two hours either side of each DST change -------------------------------------------

WALK_EXPRESSIONS = (
    "* * * * *",
    "*/15 2 * * *",
    "30 2 * * *",
    "0,30 1-3 * * *",
    "15,40 2 * * *",
    "*/10 * * * *",
    "0 0 * * *",  # America/Santiago springs forward at midnight
    "30 0 * * sun",
    "0 1 6 9 *",
    "59 1 * * *",
    "*/20 * * * * *",
)

WALK_CASES = [
    pytest.param(zone_name, change, id=f"{zone_name}-{change:%m-%d}")
    for zone_name in ZONES
    for change in dst_changes_2026(zone_name)
]


@pytest.mark.parametrize(("zone_name", "change"), WALK_CASES)
@pytest.mark.parametrize("expr", WALK_EXPRESSIONS)
def test_walking_across_a_dst_change_fires_each_reference_instant_once(
    expr: str, zone_name: str, change: datetime
) -> None:
    # Given a window from two hours before to two hours after a DST change
    cron = Cron(expr, zone_name)
    start, end = change - timedelta(hours=2), change + timedelta(hours=2)

    # When walking next_fire_time from the window start
    ticks = walk(cron, start, end)

    # Then it yields exactly the reference's instants: every existing matching wall time once,
    # every gap wall time once at its shifted instant, nothing twice, strictly increasing
    assert ticks == Reference.parse(expr).instants(ZoneInfo(zone_name), start, end)
    assert all(a < b for a, b in pairwise(ticks))
    # And fire_times yields the same ticks
    assert [tick.astimezone(UTC) for tick in cron.fire_times(start, end)] == ticks
