"""State tables of the sequential lock's scripts: ``lock_acquire``, ``lock_renew`` and
``lock_release`` (compare-and-delete). Rows and helpers: :mod:`tests.integration.lua.tables`."""

from __future__ import annotations

import pytest

from tests.integration.lua.tables import (
    HELD,
    LOCK,
    LOCK_2,
    LOCK_3,
    LOCKS,
    LOCKS_SINCE,
    SHORT_TTL,
    TTL,
    DueIn,
    Env,
    JustNow,
    State,
    Z,
)


@pytest.mark.parametrize(
    ("given", "reply", "after", "ttls"),
    [
        pytest.param(
            {},
            1,
            {LOCK: "token-a", **HELD},
            {LOCK: TTL, LOCKS: 2 * TTL, LOCKS_SINCE: 2 * TTL},
            id="free-acquired-and-indexed",
        ),
        pytest.param(
            {LOCK: "token-a", LOCKS: Z({"app.job": 5}), LOCKS_SINCE: {"app.job": "77"}},
            1,
            {LOCK: "token-a", LOCKS: Z({"app.job": DueIn(TTL)}), LOCKS_SINCE: {"app.job": "77"}},
            {LOCK: TTL, LOCKS: 2 * TTL, LOCKS_SINCE: 2 * TTL},
            id="own-token-ttl-refreshed-held-since-kept",
        ),
        pytest.param(
            {LOCK: "token-b"},
            0,
            {LOCK: "token-b"},
            {LOCK: SHORT_TTL},
            id="held-by-another",
        ),
        pytest.param(
            {
                LOCK_2: "token-x",
                LOCKS: Z({"app.job3": 5, "app.job2": 6, "app.job9": 7}),
                LOCKS_SINCE: {"app.job3": "1", "app.job2": "2", "app.job9": "3"},
            },
            1,
            {
                LOCK: "token-a",
                LOCK_2: "token-x",
                LOCKS: Z({"app.job": DueIn(TTL), "app.job2": DueIn(SHORT_TTL), "app.job9": 7}),
                LOCKS_SINCE: {"app.job": JustNow(), "app.job2": "2", "app.job9": "3"},
            },
            {LOCK: TTL, LOCK_2: SHORT_TTL, LOCKS: 2 * TTL, LOCKS_SINCE: 2 * TTL},
            id="run-out-entries-swept-two-at-a-time",
        ),
    ],
)
def test_lock_acquire(
    env: Env, given: State, reply: int, after: State, ttls: dict[str, int]
) -> None:
    env.seed(given)
    for key in (LOCK, LOCK_2):
        if key in given:
            env.expire(key, SHORT_TTL)

    result = env.lua.lock_acquire(keys=[env.key(LOCK)], args=["token-a", TTL])

    assert result == reply
    env.assert_state(after)
    env.assert_ttls(ttls)


def test_lock_renew_extends_owned_leases_only(env: Env) -> None:
    # Given: LOCK is ours, LOCK_2 was taken over, LOCK_3 expired
    env.seed({LOCK: "token-a", LOCK_2: "token-b", LOCKS: Z({"app.job": 5, "app.job2": 6})})
    env.seed({LOCKS_SINCE: {"app.job": "77", "app.job2": "78"}})
    env.expire(LOCK, SHORT_TTL)
    env.expire(LOCK_2, SHORT_TTL)

    result = env.lua.lock_renew(
        keys=[env.key(LOCK), env.key(LOCK_2), env.key(LOCK_3)],
        args=["token-a", "token-a", "token-a", TTL],
    )

    # Then: only ours is extended, its index entry with it
    assert result == [1, 0, 0]
    env.assert_state(
        {
            LOCK: "token-a",
            LOCK_2: "token-b",
            LOCKS: Z({"app.job": DueIn(TTL), "app.job2": 6}),
            LOCKS_SINCE: {"app.job": "77", "app.job2": "78"},
        }
    )
    env.assert_ttls({LOCK: TTL, LOCK_2: SHORT_TTL, LOCKS: 2 * TTL, LOCKS_SINCE: 2 * TTL})


def test_lock_renew_of_no_leases_is_empty(env: Env) -> None:
    assert env.lua.lock_renew(keys=[], args=[TTL]) == []


@pytest.mark.parametrize(
    ("given", "reply", "after"),
    [
        pytest.param(
            {
                LOCK: "token-a",
                LOCKS: Z({"app.job": 5, "app.job2": 6}),
                LOCKS_SINCE: {"app.job": "1", "app.job2": "2"},
            },
            1,
            {LOCKS: Z({"app.job2": 6}), LOCKS_SINCE: {"app.job2": "2"}},
            id="owner-deletes-and-unindexes",
        ),
        pytest.param(
            {LOCK: "token-b", LOCKS: Z({"app.job": 5})},
            0,
            {LOCK: "token-b", LOCKS: Z({"app.job": 5})},
            id="other-token-kept",
        ),
        pytest.param({}, 0, {}, id="no-lock"),
    ],
)
def test_lock_release(env: Env, given: State, reply: int, after: State) -> None:
    env.seed(given)

    assert env.lua.lock_release(keys=[env.key(LOCK)], args=["token-a"]) == reply

    env.assert_state(after)
