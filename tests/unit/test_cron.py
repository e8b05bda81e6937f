"""Unit tests for kumiko_dramatiq.cron: parsing, tick computation and DST rules."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from itertools import pairwise
from zoneinfo import ZoneInfo

import pytest
from freezegun import freeze_time

from kumiko_dramatiq.cron import Cron
from kumiko_dramatiq.errors import JobConfigError

BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")
TOKYO = ZoneInfo("Asia/Tokyo")


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


def chain(cron: Cron, after: datetime, count: int) -> list[datetime]:
    """Feed each result back as ``after`` and check the instants strictly increase."""
    ticks: list[datetime] = []
    for _ in range(count):
        after = cron.next_fire_time(after)
        ticks.append(after)
    instants = [tick.astimezone(UTC) for tick in ticks]
    assert all(a < b for a, b in pairwise(instants))
    assert len(set(instants)) == len(instants)
    return ticks


def as_utc(ticks: list[datetime]) -> list[datetime]:
    return [tick.astimezone(UTC) for tick in ticks]


def brute_force(
    predicate: Callable[[datetime], bool], start: datetime, end: datetime, step: timedelta
) -> list[datetime]:
    found = []
    current = start + step
    while current <= end:
        if predicate(current):
            found.append(current)
        current += step
    return found


# -- basic syntax ---------------------------------------------------------------------------


def test_every_15_minutes() -> None:
    cron = Cron("*/15 * * * *")
    assert chain(cron, utc(2026, 5, 5, 10, 7), 4) == [
        utc(2026, 5, 5, 10, 15),
        utc(2026, 5, 5, 10, 30),
        utc(2026, 5, 5, 10, 45),
        utc(2026, 5, 5, 11, 0),
    ]


def test_every_minute_rolls_over_year() -> None:
    cron = Cron("* * * * *")
    assert cron.next_fire_time(utc(2026, 12, 31, 23, 59, 30)) == utc(2027, 1, 1, 0, 0)


def test_six_fields_second_first() -> None:
    cron = Cron("30 15 10 * * *")
    assert cron.next_fire_time(utc(2026, 5, 5, 9, 0)) == utc(2026, 5, 5, 10, 15, 30)
    assert cron.next_fire_time(utc(2026, 5, 5, 10, 15, 30)) == utc(2026, 5, 6, 10, 15, 30)


def test_six_fields_every_20_seconds() -> None:
    cron = Cron("*/20 * * * * *")
    assert chain(cron, utc(2026, 5, 5, 10, 0, 5), 4) == [
        utc(2026, 5, 5, 10, 0, 20),
        utc(2026, 5, 5, 10, 0, 40),
        utc(2026, 5, 5, 10, 1, 0),
        utc(2026, 5, 5, 10, 1, 20),
    ]


def test_five_fields_fire_at_second_zero() -> None:
    tick = Cron("* * * * *").next_fire_time(utc(2026, 5, 5, 10, 0, 0))
    assert tick == utc(2026, 5, 5, 10, 1, 0)
    assert tick.second == 0


def test_lists_ranges_and_steps() -> None:
    cron = Cron("0 9-17/4,20 * * *")
    hours = [tick.hour for tick in chain(cron, utc(2026, 5, 5, 0, 0), 5)]
    assert hours == [9, 13, 17, 20, 9]


def test_start_slash_step_runs_to_field_max() -> None:
    cron = Cron("5/20 * * * *")
    minutes = [tick.minute for tick in chain(cron, utc(2026, 5, 5, 0, 0), 4)]
    assert minutes == [5, 25, 45, 5]


def test_step_larger_than_range_yields_start_only() -> None:
    cron = Cron("*/90 * * * *")
    assert chain(cron, utc(2026, 5, 5, 0, 0), 2) == [utc(2026, 5, 5, 1, 0), utc(2026, 5, 5, 2, 0)]


def test_overlapping_list_parts_fire_once() -> None:
    cron = Cron("0,0,*/30,30 * * * *")
    assert chain(cron, utc(2026, 5, 5, 0, 0), 2) == [
        utc(2026, 5, 5, 0, 30),
        utc(2026, 5, 5, 1, 0),
    ]


def test_month_names_case_insensitive() -> None:
    for expr in ("0 0 1 jan,JUL *", "0 0 1 Jan,jul *", "0 0 1 1,7 *"):
        ticks = chain(Cron(expr), utc(2026, 2, 1), 3)
        assert ticks == [utc(2026, 7, 1), utc(2027, 1, 1), utc(2027, 7, 1)], expr


def test_month_name_range() -> None:
    months = [tick.month for tick in chain(Cron("0 0 1 mar-MAY *"), utc(2026, 1, 1), 4)]
    assert months == [3, 4, 5, 3]


def test_weekday_name_range_case_insensitive() -> None:
    # 2026-11-27 is a Friday.
    for expr in ("0 12 * * mon-fri", "0 12 * * MON-Fri", "0 12 * * 1-5"):
        ticks = chain(Cron(expr), utc(2026, 11, 27, 12, 0), 2)
        assert ticks == [utc(2026, 11, 30, 12), utc(2026, 12, 1, 12)], expr


def test_weekday_range_ending_on_sun_means_through_sunday() -> None:
    # 2026-11-25 is a Wednesday.
    ticks = chain(Cron("0 0 * * fri-sun"), utc(2026, 11, 25), 4)
    assert [tick.strftime("%a") for tick in ticks] == ["Fri", "Sat", "Sun", "Fri"]
    assert ticks[2] == utc(2026, 11, 29)


@pytest.mark.parametrize("dow", ["0", "7", "sun", "SUN", "0,7", "6-7/1"])
def test_sunday_is_0_and_7(dow: str) -> None:
    # 2026-11-25 is a Wednesday; 2026-11-29 is a Sunday.
    tick = Cron(f"0 0 * * {dow}").next_fire_time(utc(2026, 11, 25))
    if dow == "6-7/1":
        assert tick == utc(2026, 11, 28)  # Saturday comes first
        tick = Cron(f"0 0 * * {dow}").next_fire_time(tick)
    assert tick == utc(2026, 11, 29)
    assert tick.date().isoweekday() == 7


def test_monday_is_1_and_saturday_is_6() -> None:
    monday = Cron("0 0 * * 1").next_fire_time(utc(2026, 11, 25))
    saturday = Cron("0 0 * * 6").next_fire_time(utc(2026, 11, 25))
    assert monday == utc(2026, 11, 30)
    assert monday.strftime("%A") == "Monday"
    assert saturday == utc(2026, 11, 28)
    assert saturday.strftime("%A") == "Saturday"


# -- day-of-month / day-of-week rule ---------------------------------------------------------


def test_dom_and_dow_both_restricted_means_either() -> None:
    start, end = utc(2026, 1, 31), utc(2026, 4, 30)
    ticks = list(Cron("0 0 13 * 5").fire_times(start, end))
    expected = brute_force(
        lambda t: t.hour == 0 and t.minute == 0 and (t.day == 13 or t.isoweekday() == 5),
        start,
        end,
        timedelta(hours=1),
    )
    assert ticks == expected
    days = {tick.date() for tick in ticks}
    assert date(2026, 2, 6) in days  # a Friday
    assert date(2026, 2, 13) in days  # Friday the 13th, once
    assert date(2026, 4, 13) in days  # a Monday, but the 13th
    assert len(ticks) == len(days)


def test_dom_restricted_dow_star_means_dom_only() -> None:
    ticks = list(Cron("0 0 13 * *").fire_times(utc(2026, 1, 1), utc(2026, 6, 30)))
    assert ticks == [utc(2026, month, 13) for month in range(1, 7)]


def test_dow_restricted_dom_star_means_dow_only() -> None:
    ticks = list(Cron("0 0 * * 5").fire_times(utc(2026, 2, 1), utc(2026, 2, 28)))
    assert ticks == [utc(2026, 2, day) for day in (6, 13, 20, 27)]


def test_star_step_counts_as_unrestricted_vixie_rule() -> None:
    # "*/10" starts with "*", so both sets must match: days 1, 11, 21, 31 that are Mondays.
    start, end = utc(2026, 1, 1), utc(2026, 12, 31)
    ticks = list(Cron("0 0 */10 * 1").fire_times(start, end))
    assert ticks
    assert all(t.day in (1, 11, 21, 31) and t.isoweekday() == 1 for t in ticks)
    expected = brute_force(
        lambda t: t.hour == 0 and t.day in (1, 11, 21, 31) and t.isoweekday() == 1,
        start,
        end,
        timedelta(hours=1),
    )
    assert ticks == expected


# -- month ends, leap years, far searches ------------------------------------------------------


def test_feb_29_fires_in_leap_years_only() -> None:
    cron = Cron("0 0 29 2 *")
    assert cron.next_fire_time(utc(2026, 1, 1)) == utc(2028, 2, 29)
    assert cron.next_fire_time(utc(2028, 2, 29)) == utc(2032, 2, 29)
    # 2100 is not a leap year.
    assert cron.next_fire_time(utc(2096, 3, 1)) == utc(2104, 2, 29)


def test_day_31_skips_short_months() -> None:
    ticks = chain(Cron("0 0 31 * *"), utc(2026, 1, 31), 3)
    assert ticks == [utc(2026, 3, 31), utc(2026, 5, 31), utc(2026, 7, 31)]


def test_last_second_of_year() -> None:
    cron = Cron("59 59 23 31 12 *")
    assert cron.next_fire_time(utc(2026, 6, 1)) == utc(2026, 12, 31, 23, 59, 59)


# -- brute-force cross-check -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "predicate"),
    [
        ("*/7 */5 * * *", lambda t: t.minute % 7 == 0 and t.hour % 5 == 0),
        (
            "15,45 8-18/2 * * mon-fri",
            lambda t: (
                t.minute in (15, 45) and t.hour in (8, 10, 12, 14, 16, 18) and t.isoweekday() <= 5
            ),
        ),
        (
            "0 12 1,15 * sat",
            lambda t: t.minute == 0 and t.hour == 12 and (t.day in (1, 15) or t.isoweekday() == 6),
        ),
        (
            "30 23 * feb-apr 0",
            lambda t: (
                t.minute == 30 and t.hour == 23 and t.month in (2, 3, 4) and t.isoweekday() == 7
            ),
        ),
    ],
)
def test_matches_brute_force_minute_scan(expr: str, predicate: Callable[[datetime], bool]) -> None:
    start, end = utc(2026, 1, 20, 13, 7), utc(2026, 4, 20)
    expected = brute_force(predicate, start, end, timedelta(minutes=1))
    assert expected
    assert list(Cron(expr).fire_times(start, end)) == expected


# -- strictly after, result shape --------------------------------------------------------------


def test_tick_equal_to_after_is_not_returned() -> None:
    cron = Cron("0 * * * *")
    assert cron.next_fire_time(utc(2026, 5, 5, 10, 0)) == utc(2026, 5, 5, 11, 0)


def test_microseconds_in_after() -> None:
    cron = Cron("*/15 * * * *")
    almost = datetime(2026, 5, 5, 10, 14, 59, 999_999, tzinfo=UTC)
    just_past = datetime(2026, 5, 5, 10, 15, 0, 1, tzinfo=UTC)
    assert cron.next_fire_time(almost) == utc(2026, 5, 5, 10, 15)
    assert cron.next_fire_time(just_past) == utc(2026, 5, 5, 10, 30)
    assert cron.next_fire_time(almost).microsecond == 0


def test_result_is_aware_in_the_cron_zone() -> None:
    cron = Cron("0 9 * * *", "Asia/Tokyo")
    tick = cron.next_fire_time(utc(2026, 5, 5, 1, 0))  # 10:00 in Tokyo
    assert tick.tzinfo == TOKYO
    assert tick.utcoffset() == timedelta(hours=9)
    assert (tick.year, tick.month, tick.day, tick.hour, tick.minute) == (2026, 5, 6, 9, 0)
    assert tick == utc(2026, 5, 6, 0, 0)


def test_after_may_be_in_any_zone() -> None:
    cron = Cron("0 9 * * *", "Europe/Berlin")
    in_tokyo = datetime(2026, 5, 5, 15, 30, tzinfo=TOKYO)  # 08:30 in Berlin (CEST)
    assert cron.next_fire_time(in_tokyo) == datetime(2026, 5, 5, 9, 0, tzinfo=BERLIN)


def test_naive_after_is_a_value_error() -> None:
    cron = Cron("* * * * *")
    with pytest.raises(ValueError, match="timezone-aware") as info:
        cron.next_fire_time(datetime(2026, 5, 5, 10, 0))
    assert not isinstance(info.value, JobConfigError)


def test_fire_times_rejects_naive_bounds_eagerly() -> None:
    cron = Cron("* * * * *")
    with pytest.raises(ValueError, match="timezone-aware"):
        cron.fire_times(datetime(2026, 5, 5), utc(2026, 5, 6))
    with pytest.raises(ValueError, match="timezone-aware"):
        cron.fire_times(utc(2026, 5, 5), datetime(2026, 5, 6))


def test_non_datetime_after_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        Cron("* * * * *").next_fire_time(date(2026, 5, 5))  # type: ignore[arg-type]


@freeze_time("2026-05-05 10:07:30")
def test_next_tick_from_frozen_now() -> None:
    cron = Cron("*/15 * * * *", "Europe/Berlin")
    tick = cron.next_fire_time(datetime.now(UTC))  # 12:07:30 CEST
    assert tick == datetime(2026, 5, 5, 12, 15, tzinfo=BERLIN)
    assert tick - datetime.now(UTC) == timedelta(minutes=7, seconds=30)


# -- fire_times --------------------------------------------------------------------------------


def test_fire_times_excludes_after_and_includes_until() -> None:
    ticks = list(Cron("0 * * * *").fire_times(utc(2026, 5, 5, 10), utc(2026, 5, 5, 13)))
    assert ticks == [utc(2026, 5, 5, 11), utc(2026, 5, 5, 12), utc(2026, 5, 5, 13)]


def test_fire_times_empty_ranges() -> None:
    cron = Cron("0 * * * *")
    assert list(cron.fire_times(utc(2026, 5, 5, 10), utc(2026, 5, 5, 10))) == []
    assert list(cron.fire_times(utc(2026, 5, 5, 10), utc(2026, 5, 5, 9))) == []
    assert list(cron.fire_times(utc(2026, 5, 5, 10, 1), utc(2026, 5, 5, 10, 59))) == []


def test_fire_times_matches_chained_next_fire_time() -> None:
    cron = Cron("*/10 * * * *", "America/New_York")
    after = utc(2026, 11, 1, 4, 0)
    ticks = list(cron.fire_times(after, utc(2026, 11, 1, 8, 0)))
    assert ticks == chain(cron, after, len(ticks))
    assert all(tick.tzinfo == NEW_YORK for tick in ticks)


def test_fire_times_is_lazy() -> None:
    ticks = Cron("* * * * * *").fire_times(utc(2026, 1, 1), utc(2126, 1, 1))
    assert next(ticks) == utc(2026, 1, 1, 0, 0, 1)
    assert next(ticks) == utc(2026, 1, 1, 0, 0, 2)


# -- DST: Europe/Berlin (2026-03-29 02:00 -> 03:00, 2026-10-25 03:00 -> 02:00) ------------------


def test_berlin_gap_daily_fires_once_shifted_forward() -> None:
    cron = Cron("30 2 * * *", "Europe/Berlin")
    ticks = chain(cron, datetime(2026, 3, 28, 0, 0, tzinfo=BERLIN), 3)
    assert as_utc(ticks) == [
        utc(2026, 3, 28, 1, 30),  # 02:30 CET
        utc(2026, 3, 29, 1, 30),  # 02:30 does not exist: 03:30 CEST
        utc(2026, 3, 30, 0, 30),  # 02:30 CEST
    ]
    assert (ticks[1].hour, ticks[1].minute, ticks[1].utcoffset()) == (3, 30, timedelta(hours=2))


def test_berlin_gap_every_minute() -> None:
    cron = Cron("* * * * *", "Europe/Berlin")
    ticks = chain(cron, datetime(2026, 3, 29, 1, 57, tzinfo=BERLIN), 4)
    assert as_utc(ticks) == [
        utc(2026, 3, 29, 0, 58),  # 01:58 CET
        utc(2026, 3, 29, 0, 59),  # 01:59 CET
        utc(2026, 3, 29, 1, 0),  # 02:00 -> 03:00 CEST
        utc(2026, 3, 29, 1, 1),  # 03:01 CEST; 02:01..02:59 skipped
    ]
    assert [t.strftime("%H:%M %Z") for t in ticks] == [
        "01:58 CET",
        "01:59 CET",
        "03:00 CEST",
        "03:01 CEST",
    ]


def test_berlin_gap_every_minute_fires_each_real_minute_once() -> None:
    cron = Cron("* * * * *", "Europe/Berlin")
    after = utc(2026, 3, 28, 23, 0)
    ticks = list(cron.fire_times(after, utc(2026, 3, 29, 3, 0)))
    assert as_utc(ticks) == [after + timedelta(minutes=n) for n in range(1, 241)]


def test_berlin_gap_every_15_minutes() -> None:
    cron = Cron("*/15 * * * *", "Europe/Berlin")
    ticks = chain(cron, datetime(2026, 3, 29, 1, 30, tzinfo=BERLIN), 4)
    assert as_utc(ticks) == [
        utc(2026, 3, 29, 0, 45),  # 01:45 CET
        utc(2026, 3, 29, 1, 0),  # 02:00 -> 03:00 CEST
        utc(2026, 3, 29, 1, 15),  # 03:15 CEST
        utc(2026, 3, 29, 1, 30),  # 03:30 CEST
    ]


def test_berlin_gap_after_already_past_the_shifted_instant() -> None:
    # after = 03:10 CEST: the gap wall times 02:15/02:30 map to 03:15/03:30 CEST, the same
    # instants as the wall times 03:15/03:30, so each of those instants fires once.
    cron = Cron("*/15 * * * *", "Europe/Berlin")
    ticks = chain(cron, datetime(2026, 3, 29, 3, 10, tzinfo=BERLIN), 2)
    assert as_utc(ticks) == [utc(2026, 3, 29, 1, 15), utc(2026, 3, 29, 1, 30)]


def test_berlin_gap_six_fields_every_second() -> None:
    cron = Cron("* * * * * *", "Europe/Berlin")
    after = utc(2026, 3, 29, 0, 59, 58)
    assert as_utc(chain(cron, after, 3)) == [
        utc(2026, 3, 29, 0, 59, 59),  # 01:59:59 CET
        utc(2026, 3, 29, 1, 0, 0),  # 02:00:00 -> 03:00:00 CEST
        utc(2026, 3, 29, 1, 0, 1),  # 03:00:01 CEST
    ]


def test_berlin_repeat_daily_fires_at_first_occurrence() -> None:
    cron = Cron("30 2 * * *", "Europe/Berlin")
    ticks = chain(cron, datetime(2026, 10, 24, 3, 0, tzinfo=BERLIN), 3)
    assert as_utc(ticks) == [
        utc(2026, 10, 25, 0, 30),  # 02:30 CEST, first occurrence
        utc(2026, 10, 26, 1, 30),  # 02:30 CET
        utc(2026, 10, 27, 1, 30),
    ]
    assert ticks[0].fold == 0
    assert ticks[0].utcoffset() == timedelta(hours=2)


def test_berlin_repeat_after_inside_second_occurrence_daily() -> None:
    cron = Cron("30 2 * * *", "Europe/Berlin")
    after = datetime(2026, 10, 25, 2, 10, tzinfo=BERLIN, fold=1)  # 02:10 CET = 01:10 UTC
    assert after.astimezone(UTC) == utc(2026, 10, 25, 1, 10)
    assert cron.next_fire_time(after) == utc(2026, 10, 26, 1, 30)


def test_berlin_repeat_every_15_minutes_skips_second_occurrence() -> None:
    cron = Cron("*/15 * * * *", "Europe/Berlin")
    ticks = chain(cron, datetime(2026, 10, 25, 1, 50, tzinfo=BERLIN), 6)
    assert as_utc(ticks) == [
        utc(2026, 10, 25, 0, 0),  # 02:00 CEST
        utc(2026, 10, 25, 0, 15),
        utc(2026, 10, 25, 0, 30),
        utc(2026, 10, 25, 0, 45),  # 02:45 CEST
        utc(2026, 10, 25, 2, 0),  # 03:00 CET; 02:00-02:45 CET do not fire again
        utc(2026, 10, 25, 2, 15),
    ]
    assert [t.strftime("%H:%M %Z") for t in ticks][3:5] == ["02:45 CEST", "03:00 CET"]


@pytest.mark.parametrize("expr", ["* * * * *", "*/15 * * * *", "* * * * * *"])
def test_berlin_repeat_after_inside_second_occurrence_moves_on(expr: str) -> None:
    cron = Cron(expr, "Europe/Berlin")
    after = datetime(2026, 10, 25, 2, 10, tzinfo=BERLIN, fold=1)
    tick = cron.next_fire_time(after)
    assert tick == utc(2026, 10, 25, 2, 0)  # 03:00 CET
    assert tick.astimezone(UTC) > after.astimezone(UTC)


@pytest.mark.parametrize("second_occurrence", [(2, 0, 0), (2, 30, 0), (2, 59, 59)])
def test_berlin_repeat_every_second_after_inside_second_occurrence(
    second_occurrence: tuple[int, int, int],
) -> None:
    hour, minute, second = second_occurrence
    after = datetime(2026, 10, 25, hour, minute, second, tzinfo=BERLIN, fold=1)
    for expr in ("* * * * * *", "*/7 * * * * *"):
        tick = Cron(expr, "Europe/Berlin").next_fire_time(after)
        assert tick.astimezone(UTC) == utc(2026, 10, 25, 2, 0, 0)  # 03:00:00 CET


def test_berlin_repeat_after_given_in_utc() -> None:
    cron = Cron("* * * * *", "Europe/Berlin")
    assert cron.next_fire_time(utc(2026, 10, 25, 0, 59)) == utc(2026, 10, 25, 2, 0)
    # Compare in UTC: Python never considers an ambiguous wall time equal across zones.
    tick = cron.next_fire_time(utc(2026, 10, 25, 0, 58))
    assert tick.astimezone(UTC) == utc(2026, 10, 25, 0, 59)
    assert tick.strftime("%H:%M %Z") == "02:59 CEST"


def test_berlin_repeat_every_minute_count() -> None:
    cron = Cron("* * * * *", "Europe/Berlin")
    after = utc(2026, 10, 24, 23, 0)  # 01:00 CEST
    ticks = as_utc(list(cron.fire_times(after, utc(2026, 10, 25, 3, 0))))
    # 01:01..02:59 CEST (119 ticks), then 03:00..04:00 CET (61 ticks); 02:xx CET is skipped.
    assert len(ticks) == 180
    assert utc(2026, 10, 25, 1, 30) not in ticks
    assert ticks[118:120] == [utc(2026, 10, 25, 0, 59), utc(2026, 10, 25, 2, 0)]


# -- DST: America/New_York (2026-03-08 02:00 -> 03:00, 2026-11-01 02:00 -> 01:00) ---------------


def test_new_york_gap_daily() -> None:
    cron = Cron("30 2 * * *", "America/New_York")
    ticks = chain(cron, datetime(2026, 3, 7, 12, 0, tzinfo=NEW_YORK), 3)
    assert as_utc(ticks) == [
        utc(2026, 3, 8, 7, 30),  # 02:30 does not exist: 03:30 EDT
        utc(2026, 3, 9, 6, 30),  # 02:30 EDT
        utc(2026, 3, 10, 6, 30),
    ]
    assert ticks[0].strftime("%H:%M %Z") == "03:30 EDT"


def test_new_york_gap_every_15_minutes() -> None:
    cron = Cron("*/15 * * * *", "America/New_York")
    ticks = chain(cron, datetime(2026, 3, 8, 1, 40, tzinfo=NEW_YORK), 4)
    assert [t.strftime("%H:%M %Z") for t in ticks] == [
        "01:45 EST",
        "03:00 EDT",
        "03:15 EDT",
        "03:30 EDT",
    ]
    assert as_utc(ticks) == [
        utc(2026, 3, 8, 6, 45),
        utc(2026, 3, 8, 7, 0),
        utc(2026, 3, 8, 7, 15),
        utc(2026, 3, 8, 7, 30),
    ]


def test_new_york_repeat_daily() -> None:
    cron = Cron("30 1 * * *", "America/New_York")
    ticks = chain(cron, datetime(2026, 10, 31, 12, 0, tzinfo=NEW_YORK), 2)
    assert as_utc(ticks) == [
        utc(2026, 11, 1, 5, 30),  # 01:30 EDT, first occurrence only
        utc(2026, 11, 2, 6, 30),  # 01:30 EST
    ]


def test_new_york_repeat_every_minute() -> None:
    cron = Cron("* * * * *", "America/New_York")
    ticks = chain(cron, datetime(2026, 11, 1, 1, 58, tzinfo=NEW_YORK), 3)
    assert [t.strftime("%H:%M %Z") for t in ticks] == ["01:59 EDT", "02:00 EST", "02:01 EST"]
    assert as_utc(ticks) == [
        utc(2026, 11, 1, 5, 59),
        utc(2026, 11, 1, 7, 0),
        utc(2026, 11, 1, 7, 1),
    ]
    inside_second = datetime(2026, 11, 1, 1, 20, tzinfo=NEW_YORK, fold=1)  # 06:20 UTC
    assert cron.next_fire_time(inside_second) == utc(2026, 11, 1, 7, 0)


# -- value semantics ---------------------------------------------------------------------------


def test_attributes_and_defaults() -> None:
    cron = Cron("*/5 * * * *")
    assert (cron.expr, cron.timezone, cron.misfire, cron.grace_s) == (
        "*/5 * * * *",
        "UTC",
        "coalesce",
        60,
    )
    other = Cron("0 3 * * *", "Europe/Berlin", misfire="skip", grace_s=300)
    assert (other.expr, other.timezone, other.misfire, other.grace_s) == (
        "0 3 * * *",
        "Europe/Berlin",
        "skip",
        300,
    )


def test_equality_hash_and_repr() -> None:
    a = Cron("0 3 * * *", "Europe/Berlin", misfire="skip", grace_s=30)
    b = Cron("0 3 * * *", "Europe/Berlin", misfire="skip", grace_s=30)
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != Cron("0 3 * * *", "Europe/Berlin", misfire="coalesce", grace_s=30)
    assert a != Cron("0 3 * * *", "Europe/Berlin", misfire="skip", grace_s=31)
    assert a != Cron("0 3 * * *", "UTC", misfire="skip", grace_s=30)
    assert a != Cron("0 3 * * 0-6", "Europe/Berlin", misfire="skip", grace_s=30)
    assert a != "0 3 * * *"
    assert repr(a) == "Cron('0 3 * * *', 'Europe/Berlin', misfire='skip', grace_s=30)"


def test_is_immutable() -> None:
    cron = Cron("* * * * *")
    with pytest.raises(AttributeError):
        cron.expr = "0 * * * *"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cron._expr = "0 * * * *"
    with pytest.raises(AttributeError):
        cron.anything = 1
    with pytest.raises(AttributeError):
        del cron.expr
    assert cron.expr == "* * * * *"


def test_pickle_and_copy_round_trip() -> None:
    cron = Cron("0 3 * * *", "Europe/Berlin", misfire="skip", grace_s=30)
    for clone in (pickle.loads(pickle.dumps(cron)), copy.copy(cron), copy.deepcopy(cron)):
        assert clone == cron
        assert clone.next_fire_time(utc(2026, 5, 5)) == cron.next_fire_time(utc(2026, 5, 5))


# -- invalid input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "fragment"),
    [
        ("", "has 0 field(s)"),
        ("* * * *", "has 4 field(s)"),
        ("* * * * * * *", "has 7 field(s)"),
        ("61 * * * *", "minute field: 61 is out of range 0-59"),
        ("60 * * * * *", "second field: 60 is out of range 0-59"),
        ("* 24 * * *", "hour field: 24 is out of range 0-23"),
        ("* * 0 * *", "day-of-month field: 0 is out of range 1-31"),
        ("* * 32 * *", "day-of-month field: 32 is out of range 1-31"),
        ("* * * 0 *", "month field: 0 is out of range 1-12"),
        ("* * * 13 *", "month field: 13 is out of range 1-12"),
        ("* * * * 8", "day-of-week field: 8 is out of range 0-7"),
        ("5-1 * * * *", "minute field: range '5-1' is reversed"),
        ("* * * * fri-mon", "day-of-week field: range 'fri-mon' is reversed"),
        ("* * * dec-jan *", "month field: range 'dec-jan' is reversed"),
        ("*/0 * * * *", "minute field: step in '*/0' must be at least 1"),
        ("*/-1 * * * *", "minute field: step '-1'"),
        ("1-10/0 * * * *", "minute field: step"),
        ("*/ * * * *", "minute field: step ''"),
        ("*/x * * * *", "minute field: step 'x'"),
        ("1/2/3 * * * *", "minute field: step '2/3'"),
        ("1,,2 * * * *", "minute field: empty list element"),
        (",1 * * * *", "minute field: empty list element"),
        ("1, * * * *", "minute field: empty list element"),
        ("-1 * * * *", "minute field: '' is not a number"),
        ("1- * * * *", "minute field: '' is not a number"),
        ("1-2-3 * * * *", "minute field: '2-3' is not a number"),
        ("/5 * * * *", "minute field: '/5' has no start value"),
        ("abc * * * *", "minute field: 'abc' is not a number"),
        ("* * ? * *", "day-of-month field: '?' is not a number"),
        ("* * * * ?", "day-of-week field: '?' is not a number or a name"),
        ("* * L * *", "day-of-month field: 'L'"),
        ("* * * * 5#3", "day-of-week field: '5#3'"),
        ("* * * * mon,", "day-of-week field: empty list element"),
        ("* * * janu *", "month field: 'janu' is not a number or a name"),
        ("* * * * monday", "day-of-week field: 'monday'"),
        ("jan * * * *", "minute field: 'jan' is not a number"),
        ("* * * mon *", "month field: 'mon'"),
        ("* * * * jan", "day-of-week field: 'jan'"),
        ("1.5 * * * *", "minute field: '1.5'"),
        ("+1 * * * *", "minute field: '+1'"),
        ("** * * * *", "minute field: '**'"),
        ("\u0661 * * * *", "minute field: '\u0661'"),  # Arabic-Indic digit one
        ("99999999999999999999 * * * *", "minute field: '99999999999999999999'"),
        ("@daily", "has 1 field(s)"),
    ],
)
def test_invalid_expressions(expr: str, fragment: str) -> None:
    with pytest.raises(JobConfigError) as info:
        Cron(expr)
    message = str(info.value)
    assert info.value.subject is None
    assert f"cron {expr!r}" in message
    assert fragment in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "expr",
    ["0 0 31 2 *", "0 0 30 2 *", "0 0 30,31 feb *", "0 0 31 4,6,9,11 *", "0 0 31 2 */2"],
)
def test_never_fires(expr: str) -> None:
    with pytest.raises(JobConfigError, match="never fires") as info:
        Cron(expr)
    assert f"cron {expr!r}" in str(info.value)


@pytest.mark.parametrize("expr", ["0 0 29 2 *", "0 0 31 2 mon", "0 0 30,31 2,3 *", "0 0 29 2 */7"])
def test_rare_but_possible_expressions_are_accepted(expr: str) -> None:
    cron = Cron(expr)
    assert cron.next_fire_time(utc(2026, 1, 1)) > utc(2026, 1, 1)


def test_feb_31_or_monday_fires_on_february_mondays() -> None:
    ticks = list(Cron("0 0 31 2 mon").fire_times(utc(2026, 1, 1), utc(2026, 12, 31)))
    assert ticks == [utc(2026, 2, day) for day in (2, 9, 16, 23)]


@pytest.mark.parametrize("expr", [None, 5, b"* * * * *", ["*", "*", "*", "*", "*"]])
def test_non_string_expression(expr: object) -> None:
    with pytest.raises(JobConfigError, match="must be a string") as info:
        Cron(expr)  # type: ignore[arg-type]
    assert repr(expr) in str(info.value)


@pytest.mark.parametrize("timezone", ["Mars/Olympus_Mons", "", "Europe/", "../etc/passwd", 5, None])
def test_invalid_timezone(timezone: object) -> None:
    with pytest.raises(JobConfigError, match="timezone") as info:
        Cron("0 3 * * *", timezone)  # type: ignore[arg-type]
    assert "cron '0 3 * * *'" in str(info.value)
    assert repr(timezone) in str(info.value)


@pytest.mark.parametrize("misfire", ["later", "", "COALESCE", None, 1])
def test_invalid_misfire(misfire: object) -> None:
    with pytest.raises(JobConfigError, match="misfire") as info:
        Cron("0 3 * * *", misfire=misfire)  # type: ignore[arg-type]
    assert "cron '0 3 * * *'" in str(info.value)


@pytest.mark.parametrize("grace_s", [0, -1, True, False, 1.5, "60", None])
def test_invalid_grace_s(grace_s: object) -> None:
    with pytest.raises(JobConfigError, match="grace_s") as info:
        Cron("0 3 * * *", grace_s=grace_s)  # type: ignore[arg-type]
    assert "cron '0 3 * * *'" in str(info.value)


def test_surrounding_whitespace_and_tabs_are_field_separators() -> None:
    cron = Cron("  0\t3  * * *  ")
    assert cron.expr == "  0\t3  * * *  "
    assert cron.next_fire_time(utc(2026, 5, 5)) == utc(2026, 5, 5, 3, 0)
