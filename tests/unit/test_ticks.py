"""Cron ticks as the scheduler sees them: tick ids, the APScheduler trigger adapter and
the misfire decision (pure functions; no Redis, no running clock)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from freezegun import freeze_time

from kumiko_dramatiq import Cron
from kumiko_dramatiq.ids import cron_tick_id
from kumiko_dramatiq.scheduler import TickTrigger
from kumiko_dramatiq.scheduler.ticks import TickPlan, effective_grace_s, plan_ticks

BERLIN = ZoneInfo("Europe/Berlin")
JOB = "billing:job:report"
EVERY_SECOND = Cron("* * * * * *")
HOURLY = Cron("0 * * * *")


def utc(hour: int, minute: int = 0, second: float = 0, *, day: int = 10) -> datetime:
    return datetime(2026, 6, day, hour, minute, tzinfo=UTC) + timedelta(seconds=second)


# -- tick ids ---------------------------------------------------------------------------------


def test_tick_ids_are_deterministic() -> None:
    assert cron_tick_id(JOB, utc(12)) == cron_tick_id(JOB, utc(12))


def test_tick_ids_differ_per_tick() -> None:
    assert cron_tick_id(JOB, utc(12)) != cron_tick_id(JOB, utc(12, second=1))


def test_tick_ids_differ_per_job() -> None:
    assert cron_tick_id(JOB, utc(12)) != cron_tick_id("billing:job:other", utc(12))


def test_tick_ids_of_the_same_instant_in_another_zone_are_equal() -> None:
    tick = EVERY_SECOND.next_fire_time(utc(12))
    assert cron_tick_id(JOB, tick.astimezone(BERLIN)) == cron_tick_id(JOB, tick)


def test_tick_ids_need_an_aware_tick() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        cron_tick_id(JOB, datetime(2026, 6, 10, 12))


# -- the trigger adapter ----------------------------------------------------------------------


def test_trigger_first_fire_time_is_the_crons_next_fire_time() -> None:
    cron = Cron("*/15 * * * *")
    now = utc(12, 7, 30)
    assert TickTrigger(cron).get_next_fire_time(None, now) == cron.next_fire_time(now)


def test_trigger_fires_after_the_previous_tick() -> None:
    previous = utc(12, 15)
    fire = TickTrigger(Cron("*/15 * * * *")).get_next_fire_time(previous, utc(12, 14, 59.9))
    assert fire == utc(12, 30)


def test_trigger_restarts_from_now_when_behind() -> None:
    # Given a scheduler that last fired a year ago: no backlog to enumerate.
    fire = TickTrigger(EVERY_SECOND).get_next_fire_time(utc(12, day=1), utc(12, second=0.5))
    assert fire == utc(12, second=1)


def test_trigger_returns_utc_instants() -> None:
    fire = TickTrigger(Cron("30 2 * * *", "Europe/Berlin")).get_next_fire_time(None, utc(0))
    assert fire.tzinfo is UTC
    assert fire == datetime(2026, 6, 10, 0, 30, tzinfo=UTC)  # 02:30 CEST


def test_trigger_compares_previous_and_now_as_instants_across_a_fall_back() -> None:
    # 02:30 CEST (fold=0) is BEFORE 02:10 CET (fold=1) on 2026-10-25, although its wall
    # time is later; a naive same-zone comparison would pick the wrong one.
    cron = Cron("*/20 * * * *", "Europe/Berlin")
    previous = datetime(2026, 10, 25, 2, 30, tzinfo=BERLIN)
    now = datetime(2026, 10, 25, 2, 10, fold=1, tzinfo=BERLIN)
    fire = TickTrigger(cron).get_next_fire_time(previous, now)
    assert fire == cron.next_fire_time(now)
    assert fire > now


def test_trigger_with_the_frozen_clock_skips_the_dst_gap() -> None:
    cron = Cron("30 2 * * *", "Europe/Berlin")
    with freeze_time("2026-03-29 00:59:30"):
        fire = TickTrigger(cron).get_next_fire_time(None, datetime.now(UTC))
    assert fire == datetime(2026, 3, 29, 1, 30, tzinfo=UTC)  # 03:30 CEST


# -- the misfire decision ---------------------------------------------------------------------


def test_an_on_time_tick_is_enqueued() -> None:
    plan = plan_ticks(HOURLY, utc(12, 59, 59.2), utc(13, second=0.004), catching_up=False)
    assert plan == TickPlan(enqueue=utc(13))


def test_a_wake_up_with_no_tick_due_enqueues_nothing() -> None:
    assert plan_ticks(HOURLY, utc(13), utc(13, 30), catching_up=False) == TickPlan()


def test_a_dataset_without_a_recorded_tick_missed_nothing() -> None:
    assert plan_ticks(HOURLY, None, utc(13, 0, 5), catching_up=True) == TickPlan()


def test_a_start_after_the_last_tick_misses_nothing() -> None:
    assert plan_ticks(HOURLY, utc(13), utc(13, 0, 30), catching_up=True) == TickPlan()


def test_coalesce_enqueues_a_single_tick_missed_within_grace_at_start() -> None:
    plan = plan_ticks(HOURLY, utc(12), utc(13, 0, 10), catching_up=True)
    assert plan == TickPlan(enqueue=utc(13))


def test_coalesce_merges_the_missed_ticks_of_the_grace_window_into_the_latest() -> None:
    plan = plan_ticks(EVERY_SECOND, utc(12), utc(12, 0, 4.5), catching_up=True)
    assert plan.enqueue == utc(12, 0, 4)
    assert plan.coalesced == (utc(12, 0, 1), utc(12, 0, 2), utc(12, 0, 3))
    assert plan.skipped_first is None


def test_coalesce_skips_missed_ticks_older_than_grace() -> None:
    plan = plan_ticks(EVERY_SECOND, utc(12), utc(12, 5, 0.5), catching_up=True)
    assert plan.enqueue == utc(12, 5)
    assert len(plan.coalesced) == 59  # 12:04:01 .. 12:04:59
    assert plan.coalesced[0] == utc(12, 4, 1)
    assert plan.skipped_first == utc(12, 0, 1)
    assert plan.skipped_through == utc(12, 4, 0.5)


def test_coalesce_skips_everything_when_no_missed_tick_is_within_grace() -> None:
    plan = plan_ticks(HOURLY, utc(11), utc(13, 5), catching_up=True)
    assert plan == TickPlan(skipped_first=utc(12), skipped_through=utc(13, 4))


def test_coalesce_merges_the_ticks_due_together_when_the_scheduler_fell_behind() -> None:
    plan = plan_ticks(EVERY_SECOND, utc(12, 0, 0.01), utc(12, 0, 2.3), catching_up=False)
    assert plan == TickPlan(enqueue=utc(12, 0, 2), coalesced=(utc(12, 0, 1),))


def test_a_single_tick_handled_later_than_grace_is_skipped() -> None:
    plan = plan_ticks(HOURLY, utc(12, 59, 59), utc(13, 1, 30), catching_up=False)
    assert plan.enqueue is None
    assert plan.skipped_first == utc(13)


def test_skip_skips_every_tick_missed_at_start() -> None:
    cron = Cron("* * * * * *", misfire="skip")
    plan = plan_ticks(cron, utc(12), utc(12, 0, 4.5), catching_up=True)
    assert plan == TickPlan(skipped_first=utc(12, 0, 1), skipped_through=utc(12, 0, 4))


def test_skip_skips_a_single_tick_missed_at_start() -> None:
    cron = Cron("0 * * * *", misfire="skip")
    plan = plan_ticks(cron, utc(12), utc(13, 0, 10), catching_up=True)
    assert plan == TickPlan(skipped_first=utc(13), skipped_through=utc(13))


def test_skip_skips_the_ticks_due_together_when_the_scheduler_fell_behind() -> None:
    cron = Cron("* * * * * *", misfire="skip")
    plan = plan_ticks(cron, utc(12, 0, 0.01), utc(12, 0, 2.3), catching_up=False)
    assert plan == TickPlan(skipped_first=utc(12, 0, 1), skipped_through=utc(12, 0, 2))


def test_skip_still_enqueues_an_on_time_tick() -> None:
    cron = Cron("0 * * * *", misfire="skip")
    plan = plan_ticks(cron, utc(12, 59, 59), utc(13, second=0.2), catching_up=False)
    assert plan == TickPlan(enqueue=utc(13))


def test_the_grace_window_follows_the_crons_grace_s() -> None:
    cron = Cron("* * * * * *", grace_s=3)
    plan = plan_ticks(cron, utc(12), utc(12, 0, 10.5), catching_up=True)
    assert plan.enqueue == utc(12, 0, 10)
    assert plan.coalesced == (utc(12, 0, 8), utc(12, 0, 9))
    assert plan.skipped_first == utc(12, 0, 1)


def test_an_explicit_grace_s_overrides_the_crons() -> None:
    plan = plan_ticks(EVERY_SECOND, utc(12), utc(12, 0, 10.5), catching_up=True, grace_s=2)
    assert plan.coalesced == (utc(12, 0, 9),)


def test_grace_is_capped_at_the_guard_lifetime() -> None:
    assert effective_grace_s(Cron("* * * * *", grace_s=7200), completed_age_s=3600) == 3600
    assert effective_grace_s(Cron("* * * * *", grace_s=60), completed_age_s=3600) == 60


def test_a_year_long_outage_is_decided_without_replaying_it() -> None:
    started = time.perf_counter()
    plan = plan_ticks(EVERY_SECOND, utc(12, day=1) - timedelta(days=365), utc(12), catching_up=True)
    assert time.perf_counter() - started < 5  # enumerating the year would take minutes
    assert plan.enqueue == utc(12)
    assert len(plan.coalesced) == 59


def test_plans_compare_instants_across_a_fall_back() -> None:
    # now = 02:10 CET (the repeated hour, fold=1) is 01:10 UTC: the ticks 02:20 and
    # 02:40 CEST lie before it although their wall times are later.
    cron = Cron("*/20 * * * *", "Europe/Berlin")
    last = datetime(2026, 10, 25, 1, 40, tzinfo=BERLIN)
    now = datetime(2026, 10, 25, 2, 10, fold=1, tzinfo=BERLIN)
    plan = plan_ticks(cron, last, now, catching_up=True, grace_s=3600)
    assert plan.enqueue is not None
    assert plan.skipped_first is not None
    # Compared in UTC: Python never equates an ambiguous wall time with another zone's.
    assert plan.enqueue.astimezone(UTC) == datetime(2026, 10, 25, 0, 40, tzinfo=UTC)
    assert [t.astimezone(UTC) for t in plan.coalesced] == [
        datetime(2026, 10, 25, 0, 20, tzinfo=UTC)
    ]
    assert plan.skipped_first.astimezone(UTC) == datetime(2026, 10, 25, 0, 0, tzinfo=UTC)
