"""State tables of the sequential lock's scripts: ``lock_acquire``, ``lock_renew`` and
``lock_release`` (compare-and-delete). Rows and helpers: :mod:`tests.integration.lua.tables`."""

from __future__ import annotations

import pytest

from tests.integration.lua.tables import (
    LOCK,
    LOCK_2,
    LOCK_3,
    SHORT_TTL,
    TTL,
    Env,
    State,
)


@pytest.mark.parametrize(
    ("given", "reply", "after", "ttls"),
    [
        pytest.param({}, 1, {LOCK: "token-a"}, {LOCK: TTL}, id="free-acquired"),
        pytest.param(
            {LOCK: "token-a"},
            1,
            {LOCK: "token-a"},
            {LOCK: TTL},
            id="own-token-ttl-refreshed",
        ),
        pytest.param(
            {LOCK: "token-b"},
            0,
            {LOCK: "token-b"},
            {LOCK: SHORT_TTL},
            id="held-by-another",
        ),
    ],
)
def test_lock_acquire(
    env: Env, given: State, reply: int, after: State, ttls: dict[str, int]
) -> None:
    env.seed(given)
    if LOCK in given:
        env.expire(LOCK, SHORT_TTL)

    result = env.lua.lock_acquire(keys=[env.key(LOCK)], args=["token-a", TTL])

    assert result == reply
    env.assert_state(after)
    env.assert_ttls(ttls)


def test_lock_renew_extends_owned_leases_only(env: Env) -> None:
    # Given: LOCK is ours, LOCK_2 was taken over, LOCK_3 expired
    env.seed({LOCK: "token-a", LOCK_2: "token-b"})
    env.expire(LOCK, SHORT_TTL)
    env.expire(LOCK_2, SHORT_TTL)

    result = env.lua.lock_renew(
        keys=[env.key(LOCK), env.key(LOCK_2), env.key(LOCK_3)],
        args=["token-a", "token-a", "token-a", TTL],
    )

    assert result == [1, 0, 0]
    env.assert_state({LOCK: "token-a", LOCK_2: "token-b"})
    env.assert_ttls({LOCK: TTL, LOCK_2: SHORT_TTL})


def test_lock_renew_of_no_leases_is_empty(env: Env) -> None:
    assert env.lua.lock_renew(keys=[], args=[TTL]) == []


@pytest.mark.parametrize(
    ("given", "reply", "after"),
    [
        pytest.param({LOCK: "token-a"}, 1, {}, id="owner-deletes"),
        pytest.param({LOCK: "token-b"}, 0, {LOCK: "token-b"}, id="other-token-kept"),
        pytest.param({}, 0, {}, id="no-lock"),
    ],
)
def test_lock_release(env: Env, given: State, reply: int, after: State) -> None:
    env.seed(given)

    assert env.lua.lock_release(keys=[env.key(LOCK)], args=["token-a"]) == reply

    env.assert_state(after)
