"""State tables of the dedup scripts: ``dedup_dispatch``, ``dedup_mark_running``,
``dedup_requeue``, ``dedup_finish`` and ``dedup_handover``, each reading and writing the
dedup record of a key. Rows and helpers: :mod:`tests.integration.lua.tables`."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.lua.tables import (
    BELL,
    BELL_TTL,
    DEDUP_INDEX,
    ENDING,
    LIST,
    MSGS,
    RECORD,
    SHORT_TTL,
    TTL,
    DueIn,
    Env,
    State,
    Z,
    text,
)


@pytest.mark.parametrize(
    ("given", "reply", "after", "ttls"),
    [
        pytest.param(
            {},
            [1, "m1"],
            {
                LIST: ["r1"],
                MSGS: {"r1": "body"},
                RECORD: {"id": "m1", "state": "queued"},
                DEDUP_INDEX: Z({"k1": DueIn(TTL)}),
                BELL: ["1"],
            },
            {RECORD: TTL, DEDUP_INDEX: 2 * TTL, BELL: BELL_TTL},
            id="no-record-enqueues",
        ),
        pytest.param(
            {RECORD: {"fid": "m7", "fpayload": "{}"}},
            [1, "m1"],
            {
                LIST: ["r1"],
                MSGS: {"r1": "body"},
                RECORD: {"id": "m1", "state": "queued"},
                DEDUP_INDEX: Z({"k1": DueIn(TTL)}),
                BELL: ["1"],
            },
            {RECORD: TTL, DEDUP_INDEX: 2 * TTL, BELL: BELL_TTL},
            id="record-without-id-is-replaced",
        ),
        pytest.param(
            {RECORD: {"id": "m0", "state": "queued"}},
            [0, "m0"],
            {RECORD: {"id": "m0", "state": "queued"}},
            {RECORD: SHORT_TTL},
            id="queued-returns-live-id",
        ),
        pytest.param(
            {RECORD: {"id": "m0", "state": "running"}},
            [0, "m1"],
            {
                RECORD: {
                    "id": "m0",
                    "state": "running",
                    "fid": "m1",
                    "fpayload": '{"n": 2}',
                    "ftrigger": "t2",
                }
            },
            {RECORD: SHORT_TTL},
            id="running-allocates-the-follow-up",
        ),
        pytest.param(
            {
                RECORD: {
                    "id": "m0",
                    "state": "running",
                    "fid": "m5",
                    "fpayload": '{"n": 1}',
                    "ftrigger": "t1",
                }
            },
            [0, "m5"],
            {
                RECORD: {
                    "id": "m0",
                    "state": "running",
                    "fid": "m5",
                    "fpayload": '{"n": 2}',
                    "ftrigger": "t2",
                }
            },
            {RECORD: SHORT_TTL},
            id="running-with-follow-up-replaces-payload-not-ttl",
        ),
        pytest.param(
            {RECORD: {"id": "m0", "state": "ending", "fid": "m5"}},
            [0, "m5"],
            {RECORD: {"id": "m0", "state": "ending", "fid": "m5"}},
            {RECORD: SHORT_TTL},
            id="ending-with-follow-up-returns-it",
        ),
        pytest.param(
            {RECORD: {"id": "m0", "state": "ending"}},
            [0, "m0"],
            {RECORD: {"id": "m0", "state": "ending"}},
            {RECORD: SHORT_TTL},
            id="ending-without-follow-up-returns-live-id",
        ),
    ],
)
def test_dedup_dispatch(
    env: Env, given: State, reply: list[Any], after: State, ttls: dict[str, int]
) -> None:
    env.seed(given)
    if given:
        env.expire(RECORD, SHORT_TTL)

    result = env.lua.dedup_dispatch(
        keys=[env.key(MSGS), env.key(LIST), env.key(RECORD), env.key(DEDUP_INDEX)],
        args=["r1", "body", TTL, "m1", '{"n": 2}', "t2", "k1"],
    )

    assert text(result) == reply
    env.assert_state(after)
    env.assert_ttls(ttls)


@pytest.mark.parametrize(
    ("given", "reply", "after", "ttls"),
    [
        pytest.param(
            {RECORD: {"id": "m1", "state": "queued", "fid": "m5"}},
            1,
            {
                RECORD: {"id": "m1", "state": "running", "fid": "m5"},
                DEDUP_INDEX: Z({"k1": DueIn(TTL)}),
            },
            {RECORD: TTL, DEDUP_INDEX: 2 * TTL},
            id="own-record-runs-ttl-refreshed",
        ),
        pytest.param(
            {RECORD: {"id": "m0", "state": "queued"}},
            0,
            {RECORD: {"id": "m0", "state": "queued"}},
            {RECORD: SHORT_TTL},
            id="other-id-untouched",
        ),
        pytest.param({}, 0, {}, {}, id="no-record-not-created"),
    ],
)
def test_dedup_mark_running(
    env: Env, given: State, reply: int, after: State, ttls: dict[str, int]
) -> None:
    env.seed(given)
    if given:
        env.expire(RECORD, SHORT_TTL)

    result = env.lua.dedup_mark_running(
        keys=[env.key(RECORD), env.key(DEDUP_INDEX)], args=["m1", TTL, "k1"]
    )

    assert result == reply

    env.assert_state(after)
    env.assert_ttls(ttls)


@pytest.mark.parametrize(
    ("given", "next_id", "reply", "after", "ttls"),
    [
        pytest.param(
            {RECORD: {"id": "m1", "state": "running"}},
            "m1",
            1,
            {RECORD: {"id": "m1", "state": "queued"}, DEDUP_INDEX: Z({"k1": DueIn(TTL)})},
            {RECORD: TTL, DEDUP_INDEX: 2 * TTL},
            id="retry-same-id-queued-again",
        ),
        pytest.param(
            {RECORD: {"id": "m1", "state": "running", "fid": "m5", "fpayload": "{}"}},
            "m2",
            1,
            {
                RECORD: {"id": "m2", "state": "queued", "fid": "m5", "fpayload": "{}"},
                DEDUP_INDEX: Z({"k1": DueIn(TTL)}),
            },
            {RECORD: TTL, DEDUP_INDEX: 2 * TTL},
            id="hand-off-id-follow-up-stays",
        ),
        pytest.param(
            {RECORD: {"id": "m0", "state": "running"}},
            "m2",
            0,
            {RECORD: {"id": "m0", "state": "running"}},
            {RECORD: SHORT_TTL},
            id="other-id-untouched",
        ),
        pytest.param({}, "m2", 0, {}, {}, id="no-record-not-created"),
    ],
)
def test_dedup_requeue(
    env: Env, given: State, next_id: str, reply: int, after: State, ttls: dict[str, int]
) -> None:
    env.seed(given)
    if given:
        env.expire(RECORD, SHORT_TTL)

    result = env.lua.dedup_requeue(
        keys=[env.key(RECORD), env.key(DEDUP_INDEX)], args=["m1", next_id, TTL, "k1"]
    )

    assert result == reply

    env.assert_state(after)
    env.assert_ttls(ttls)


@pytest.mark.parametrize(
    ("given", "reply", "after", "ttls"),
    [
        pytest.param(
            {RECORD: {"id": "m1", "state": "running"}, DEDUP_INDEX: Z({"k1": 1, "k2": 2})},
            ["freed"],
            {DEDUP_INDEX: Z({"k2": 2})},
            {},
            id="freed-and-out-of-the-index",
        ),
        pytest.param(
            {
                RECORD: {
                    "id": "m1",
                    "state": "running",
                    "fid": "m5",
                    "fpayload": '{"n": 2}',
                    "ftrigger": "t2",
                }
            },
            ["follow-up", "m5", '{"n": 2}', "t2"],
            {
                RECORD: {
                    "id": "m1",
                    "state": "ending",
                    "fid": "m5",
                    "fpayload": '{"n": 2}',
                    "ftrigger": "t2",
                },
                DEDUP_INDEX: Z({"k1": DueIn(TTL)}),
            },
            {RECORD: TTL, DEDUP_INDEX: 2 * TTL},
            id="follow-up-freezes-as-ending",
        ),
        pytest.param(
            {RECORD: {"id": "m0", "state": "running", "fid": "m5"}},
            ["gone"],
            {RECORD: {"id": "m0", "state": "running", "fid": "m5"}},
            {RECORD: SHORT_TTL},
            id="gone-other-id",
        ),
        pytest.param({}, ["gone"], {}, {}, id="gone-no-record"),
    ],
)
def test_dedup_finish(
    env: Env, given: State, reply: list[str], after: State, ttls: dict[str, int]
) -> None:
    env.seed(given)
    if given:
        env.expire(RECORD, SHORT_TTL)

    result = env.lua.dedup_finish(
        keys=[env.key(RECORD), env.key(DEDUP_INDEX)], args=["m1", TTL, "k1"]
    )

    assert text(result) == reply
    env.assert_state(after)
    env.assert_ttls(ttls)


@pytest.mark.parametrize(
    ("record", "reply", "after", "ttls"),
    [
        pytest.param(
            ENDING,
            [1],
            {
                LIST: ["r5"],
                MSGS: {"r5": "follow-up"},
                RECORD: {"id": "m5", "state": "queued"},
                DEDUP_INDEX: Z({"k1": DueIn(TTL)}),
                BELL: ["1"],
            },
            {RECORD: TTL, DEDUP_INDEX: 2 * TTL, BELL: BELL_TTL},
            id="matches-enqueues-follow-up-as-live-job",
        ),
        pytest.param(
            {**ENDING, "id": "m0"},
            [0],
            {RECORD: {**ENDING, "id": "m0"}},
            {RECORD: SHORT_TTL},
            id="other-ended-id",
        ),
        pytest.param(
            {**ENDING, "state": "running"},
            [0],
            {RECORD: {**ENDING, "state": "running"}},
            {RECORD: SHORT_TTL},
            id="not-ending",
        ),
        pytest.param(
            {**ENDING, "fid": "m6"},
            [0],
            {RECORD: {**ENDING, "fid": "m6"}},
            {RECORD: SHORT_TTL},
            id="other-follow-up",
        ),
        pytest.param(None, [0], {}, {}, id="no-record"),
    ],
)
def test_dedup_handover(
    env: Env,
    record: dict[str, str] | None,
    reply: list[int],
    after: State,
    ttls: dict[str, int],
) -> None:
    if record is not None:
        env.seed({RECORD: record})
        env.expire(RECORD, SHORT_TTL)

    result = env.lua.dedup_handover(
        keys=[env.key(MSGS), env.key(LIST), env.key(RECORD), env.key(DEDUP_INDEX)],
        args=["r5", "follow-up", "m1", "m5", TTL, "k1"],
    )

    assert result == reply
    env.assert_state(after)
    env.assert_ttls(ttls)
