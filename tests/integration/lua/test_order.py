"""State tables of a lane queue's order (``lua/include/route.lua``): where ``fetch_lane``
claims from while messages with a priority or a fair key wait, and what it leaves behind.
Rows and helpers: :mod:`tests.integration.lua.tables`."""

from __future__ import annotations

from typing import Any

import pytest

from kumiko_dramatiq.codec import fair_digest
from tests.integration.lua.tables import (
    ACKS,
    BELL,
    INFLIGHT,
    LIST,
    MSGS,
    WITHDRAWN,
    Env,
    State,
    Z,
    entry,
    kumiko_message,
)

A, B = fair_digest("acme"), fair_digest("globex")
ORDER = "dramatiq:{q}:order"
LEVELS = "dramatiq:{q}:levels"
MAIN = "dramatiq:{q}:ring:0:main"


def ring(level: int) -> str:
    return f"dramatiq:{{q}}:ring:{level}"


def at(level: int, digest: str) -> str:
    return f"dramatiq:{{q}}:at:{level}:{digest}"


def routed(message_id: str, route: str) -> str:
    return kumiko_message(message_id, kumiko_route=route)


def claimed(*rids: str) -> State:
    return {ACKS: set(rids), INFLIGHT: {rid: entry(1) for rid in rids}}


BODIES = {
    "r1": routed("m1", f"0.{A}"),
    "r2": routed("m2", f"0.{A}"),
    "r3": routed("m3", f"0.{B}"),
    "r4": kumiko_message("m4"),
    "r5": routed("m5", "5"),
}


@pytest.mark.parametrize(
    ("given", "count", "claims", "after"),
    [
        pytest.param(
            {
                MSGS: BODIES,
                LIST: ["r4"],
                ORDER: Z({"0": 0, "5": 5}),
                LEVELS: {"0": "3", "5": "1"},
                ring(0): [A, B],
                at(0, A): ["r1", "r2"],
                at(0, B): ["r3"],
                ring(5): [""],
                at(5, ""): ["r5"],
            },
            3,
            ["r1", "r3", "r4"],
            {
                MSGS: BODIES,
                ORDER: Z({"0": 0, "5": 5}),
                LEVELS: {"0": "1", "5": "1"},
                ring(0): [A],
                at(0, A): ["r2"],
                ring(5): [""],
                at(5, ""): ["r5"],
                BELL: ["1"],  # a full claim that leaves messages waiting rings for the next
                **claimed("r1", "r3", "r4"),
            },
            id="level-0-keys-take-turns-the-list-takes-one-the-later-level-waits",
        ),
        pytest.param(
            {
                MSGS: BODIES,
                ORDER: Z({"5": 5}),
                LEVELS: {"5": "1"},
                ring(5): [""],
                at(5, ""): ["r5"],
                LIST: ["r4"],
            },
            2,
            ["r4", "r5"],
            {MSGS: BODIES, **claimed("r4", "r5")},
            id="level-0-without-a-key-before-a-later-level-and-the-order-ends-empty",
        ),
        pytest.param(
            {MSGS: BODIES, LIST: ["r1", "r4"]},
            1,
            ["r1"],
            {MSGS: BODIES, LIST: ["r4"], BELL: ["1"], **claimed("r1")},
            id="an-id-with-a-route-on-the-list-goes-to-its-place-and-is-claimed-there",
        ),
        pytest.param(
            {
                MSGS: {"r2": BODIES["r2"]},
                ORDER: Z({"0": 0}),
                LEVELS: {"0": "2", "w0": "1"},
                ring(0): [A],
                at(0, A): ["r1", "r2"],
                WITHDRAWN: {"r1"},
            },
            1,
            ["r2"],
            {MSGS: {"r2": BODIES["r2"]}, **claimed("r2")},
            id="a-withdrawn-id-is-dropped-and-leaves-its-levels-count",
        ),
    ],
)
def test_fetch_in_order(
    env: Env, given: State, count: int, claims: list[str], after: State
) -> None:
    env.seed(given)

    reply: Any = env.fetch_lane(count, 0)

    assert reply[0][::2] == claims
    env.assert_state(after)
