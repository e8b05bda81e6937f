"""State tables of ``boot_once`` (a boot-once job's message behind its marker) and ``cron_tick``
(a cron tick's message behind its last-tick record). Rows and helpers:
:mod:`tests.integration.lua.tables`."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.lua.tables import (
    BELL,
    BELL_TTL,
    BOOT_MARKER,
    GUARD,
    LAST_TICK,
    LIST,
    MSGS,
    NO_TTL,
    SHORT_TTL,
    TICK,
    TTL,
    Env,
    State,
    text,
)


@pytest.mark.parametrize(
    ("given", "reply", "after", "ttls"),
    [
        pytest.param(
            {BOOT_MARKER: "m1"},
            [0, "marked"],
            {BOOT_MARKER: "m1"},
            {BOOT_MARKER: NO_TTL},
            id="marker-present",
        ),
        pytest.param(
            {},
            [1, "enqueued"],
            {LIST: ["r1"], MSGS: {"r1": "body"}, BOOT_MARKER: "m1", GUARD: "m1", BELL: ["1"]},
            {BOOT_MARKER: NO_TTL, GUARD: TTL, BELL: BELL_TTL},
            id="marker-and-guard-absent",
        ),
        pytest.param(
            {GUARD: "m1"},
            [0, "guarded"],
            {BOOT_MARKER: "m1", GUARD: "m1"},
            {BOOT_MARKER: NO_TTL, GUARD: NO_TTL},
            id="guard-present-restores-marker",
        ),
    ],
)
def test_boot_once(
    env: Env, given: State, reply: list[Any], after: State, ttls: dict[str, int]
) -> None:
    env.seed(given)

    result = env.lua.boot_once(
        keys=[env.key(MSGS), env.key(LIST), env.key(BOOT_MARKER), env.key(GUARD)],
        args=["r1", "body", TTL, "m1"],
    )

    assert text(result) == reply
    env.assert_state(after)
    env.assert_ttls(ttls)


@pytest.mark.parametrize(
    ("given", "tick", "reply", "after", "ttls"),
    [
        pytest.param(
            {},
            TICK,
            [1],
            {
                LIST: ["r1"],
                MSGS: {"r1": "body"},
                GUARD: "sched-1",
                LAST_TICK: str(TICK),
                BELL: ["1"],
            },
            {GUARD: TTL, LAST_TICK: TTL, BELL: BELL_TTL},
            id="fresh-tick-enqueues-and-records",
        ),
        pytest.param(
            {GUARD: "sched-0", LAST_TICK: str(TICK - 60)},
            TICK,
            [0],
            {GUARD: "sched-0", LAST_TICK: str(TICK)},
            {GUARD: SHORT_TTL, LAST_TICK: TTL},
            id="guarded-tick-still-raises-the-record",
        ),
        pytest.param(
            {GUARD: "sched-0", LAST_TICK: str(TICK)},
            TICK,
            [0],
            {GUARD: "sched-0", LAST_TICK: str(TICK)},
            {GUARD: SHORT_TTL, LAST_TICK: TTL},
            id="same-tick-refreshes-the-record-ttl",
        ),
        pytest.param(
            {LAST_TICK: str(TICK + 60)},
            TICK,
            [1],
            {
                LIST: ["r1"],
                MSGS: {"r1": "body"},
                GUARD: "sched-1",
                LAST_TICK: str(TICK + 60),
                BELL: ["1"],
            },
            {GUARD: TTL, LAST_TICK: TTL, BELL: BELL_TTL},
            id="older-tick-never-lowers-the-record",
        ),
    ],
)
def test_cron_tick(
    env: Env, given: State, tick: int, reply: list[int], after: State, ttls: dict[str, int]
) -> None:
    # Given: every seeded key lives SHORT_TTL, so a refreshed TTL shows
    env.seed(given)
    for key in given:
        env.expire(key, SHORT_TTL)

    result = env.lua.cron_tick(
        keys=[
            env.key(MSGS),
            env.key(LIST),
            env.key(GUARD),
            env.key(LAST_TICK),
            env.key("kumiko:{p}:schedules:paused"),
            env.key("kumiko:{p}:dedup:app.job:schedule:app.job"),
            env.key("kumiko:{p}:dedupidx:app.job"),
            env.key("kumiko:{p}:cron-skipped"),
        ],
        args=["r1", "body", TTL, "sched-1", tick, TTL, "app.job", "allow", "m1", "{}"],
    )

    assert result == reply
    env.assert_state(after)
    env.assert_ttls(ttls)
