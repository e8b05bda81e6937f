"""Following Sentinel fail-overs (kumiko_dramatiq.broker.failover): the sentinels' events, the
decision whether an address may be written to, and the watch's state, without Redis."""

from __future__ import annotations

import pytest
import redis

from kumiko_dramatiq.broker.failover import (
    FAILOVER_START,
    SWITCH_MASTER,
    PrimaryWatch,
    SentinelEvent,
    parse_event,
    primary_problem,
)

OLD, NEW, OTHER = ("10.0.0.1", 6379), ("10.0.0.2", 6379), ("10.0.0.3", 6379)


# -- events ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("channel", "data", "event"),
    [
        pytest.param(
            FAILOVER_START,
            "slave 10.0.0.2:6379 10.0.0.2 6379 @ mymaster 10.0.0.1 6379",
            SentinelEvent("start", "mymaster", OLD),
            id="start",
        ),
        pytest.param(
            SWITCH_MASTER,
            "mymaster 10.0.0.1 6379 10.0.0.2 6379",
            SentinelEvent("switch", "mymaster", OLD, NEW),
            id="switch",
        ),
        pytest.param(
            "-failover-abort-not-elected",
            "master mymaster 10.0.0.1 6379",
            SentinelEvent("abort", "mymaster", OLD),
            id="abort",
        ),
        pytest.param(SWITCH_MASTER, "mymaster 10.0.0.1 6379", None, id="short"),
        pytest.param(SWITCH_MASTER, "mymaster a b c d", None, id="not-ports"),
        pytest.param("+sdown", "master mymaster 10.0.0.1 6379", None, id="other-event"),
    ],
)
def test_sentinel_events_parse(channel: str, data: str, event: SentinelEvent | None) -> None:
    assert parse_event(channel, data) == event


# -- the decision ------------------------------------------------------------------------------
def test_an_address_without_a_fail_over_is_written_to() -> None:
    assert primary_problem(OLD, barrier=None, demoted=frozenset(), reports=None) is None


def test_the_primary_being_demoted_is_not_written_to() -> None:
    problem = primary_problem(OLD, barrier=OLD, demoted=frozenset(), reports=None)
    assert problem is not None
    assert "in progress" in problem


def test_a_demoted_primary_is_not_written_to_while_any_sentinel_names_another() -> None:
    reports = [(OLD, False), (NEW, False)]  # one sentinel has not heard of the switch yet
    problem = primary_problem(OLD, barrier=None, demoted=frozenset({OLD}), reports=reports)
    assert problem is not None
    assert "demoted" in problem


def test_a_fail_over_in_progress_on_any_sentinel_keeps_the_barrier() -> None:
    reports = [(OLD, False), (OLD, True), (OLD, False)]
    assert primary_problem(OLD, barrier=OLD, demoted=frozenset(), reports=reports) is not None


def test_when_every_sentinel_names_it_and_none_fails_over_it_is_the_primary_again() -> None:
    reports = [(OLD, False), (OLD, False)]
    assert primary_problem(OLD, barrier=OLD, demoted=frozenset({OLD}), reports=reports) is None


def test_no_sentinel_answering_admits_nothing_behind_the_barrier() -> None:
    assert primary_problem(OLD, barrier=OLD, demoted=frozenset(), reports=[]) is not None


# -- the watch ---------------------------------------------------------------------------------
def watch(reports: list[tuple[tuple[str, int] | None, bool]] | None = None) -> PrimaryWatch:
    return PrimaryWatch("mymaster", [], {}, ask=lambda: list(reports or []))


def test_a_starting_fail_over_bars_the_old_primary_and_moves_every_connection() -> None:
    w = watch(reports=[(OLD, True)])
    w.apply(SentinelEvent("start", "mymaster", OLD))
    assert w.generation == 1
    with pytest.raises(redis.ConnectionError, match="in progress"):
        w.check(OLD)
    w.check(NEW)  # the new primary is fine


def test_the_switch_lifts_the_barrier_and_demotes_the_old_primary() -> None:
    w = watch(reports=[(NEW, False)])
    w.apply(SentinelEvent("start", "mymaster", OLD))
    w.apply(SentinelEvent("switch", "mymaster", OLD, NEW))
    w.apply(SentinelEvent("switch", "mymaster", OLD, NEW))  # another sentinel says it too
    assert w.generation == 2
    w.check(NEW)
    with pytest.raises(redis.ConnectionError, match="demoted"):
        w.check(OLD)


def test_an_aborted_fail_over_lifts_the_barrier() -> None:
    w = watch()
    w.apply(SentinelEvent("start", "mymaster", OLD))
    w.apply(SentinelEvent("abort", "mymaster", OLD))
    w.check(OLD)


def test_events_of_another_primary_change_nothing() -> None:
    w = watch()
    w.apply(SentinelEvent("start", "othermaster", OLD))
    assert w.generation == 0
    w.check(OLD)


def test_a_switch_back_admits_the_old_primary_again() -> None:
    w = watch()
    w.apply(SentinelEvent("switch", "mymaster", OLD, NEW))
    w.apply(SentinelEvent("switch", "mymaster", NEW, OLD))
    w.check(OLD)
    with pytest.raises(redis.ConnectionError):
        w.check(NEW)


def test_a_barrier_whose_events_were_missed_is_lifted_when_the_sentinels_agree() -> None:
    w = watch(reports=[(OLD, False), (OLD, False)])
    w.apply(SentinelEvent("start", "mymaster", OLD))
    w.check(OLD)  # every sentinel names it and none fails over: the fail-over ended
    w.check(OLD)


def test_a_readonly_reply_demotes_that_node_once_and_moves_every_connection() -> None:
    w = watch(reports=[(NEW, False)])
    w.demoted_reply(OLD)
    w.demoted_reply(OLD)
    assert w.generation == 1
    with pytest.raises(redis.ConnectionError, match="demoted"):
        w.check(OLD)


def test_a_primary_found_elsewhere_by_discovery_moves_every_connection() -> None:
    w = watch()
    w.connected(OLD)
    w.connected(OLD)
    assert w.generation == 0
    w.connected(OTHER)
    assert w.generation == 1
