"""State tables for every Lua script in ``kumiko_dramatiq/lua/``.

Each row is (Redis state before, KEYS, ARGV) -> (reply, Redis state after, TTLs). Rows
name their keys with templates (``LIST``, ``ACKS``, ``GUARD``, ...) that :class:`Env` fills
with the test's own prefix and worker ids, so every key is deleted by the ``prefix`` fixture.
:meth:`Env.state` reads back every key of the prefix, so a row's "after" is the WHOLE state:
a key a script should not touch, or should not create, fails the row when it does.

The broker commands all write the worker's heartbeat to the shared
``dramatiq:__heartbeats__``: the tests use worker ids built from the prefix, call the
scripts with a fake ``now`` (:data:`NOW`, far older than any live worker's heartbeat, so
maintenance only ever sees this test's workers as dead) and remove their worker ids from the
heartbeats afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from kumiko_dramatiq.lua import LuaScripts

State = dict[str, Any]

NAMESPACE = "dramatiq"
HEARTBEATS = "dramatiq:__heartbeats__"

#: "now" (ms) of every broker command: far below a live worker's heartbeat (~1.7e12).
NOW = 1_000_000_000
HEARTBEAT_TIMEOUT = 60_000
DEAD_TTL = 600_000

#: The TTL (ms) the scripts are asked to set, and a shorter one the tests seed beforehand:
#: a key left at <= SHORT_TTL was not refreshed, one near TTL was.
TTL = 600_000
SHORT_TTL = 5_000
#: How far below the TTL it was set to a PTTL may have fallen by the time it is read.
TTL_SLACK = 2_000
NO_TTL = -1

# -- key templates (filled by Env.key) -----------------------------------------------------
QUEUE = "{q}"
DQ = "{q}.DQ"
LIST = "dramatiq:{q}"
MSGS = "dramatiq:{q}.msgs"
ACKS = "dramatiq:__acks__.{w1}.{q}"
ACKS_W2 = "dramatiq:__acks__.{w2}.{q}"
DQ_LIST = "dramatiq:{q}.DQ"
DQ_MSGS = "dramatiq:{q}.DQ.msgs"
DQ_ACKS = "dramatiq:__acks__.{w1}.{q}.DQ"
DQ_ACKS_W2 = "dramatiq:__acks__.{w2}.{q}.DQ"
XQ = "dramatiq:{q}.XQ"
XQ_MSGS = "dramatiq:{q}.XQ.msgs"
DEAD_ACKS = "dramatiq:__acks__.{w0}.{q}"
DEAD_ACKS_OTHER = "dramatiq:__acks__.{w0}.{p}-other"
OTHER_LIST = "dramatiq:{p}-other"
SENT = "kumiko:{p}:sent:r1"
DONE_PREFIX = "kumiko:{p}:done:"
DONE_M1 = "kumiko:{p}:done:m1"
DONE_M2 = "kumiko:{p}:done:m2"
GUARD = "kumiko:{p}:enqueued:m1"
GUARD_2 = "kumiko:{p}:enqueued:m2"
GUARD_3 = "kumiko:{p}:enqueued:m3"
BOOT_MARKER = "kumiko:{p}:boot:app.job"
LAST_TICK = "kumiko:{p}:cron:last:app.job"
RECORD = "kumiko:{p}:dedup:app.job:k1"
LOCK = "kumiko:{p}:lock:app.job"
LOCK_2 = "kumiko:{p}:lock:app.job2"
LOCK_3 = "kumiko:{p}:lock:app.job3"
DELIVERIES = "kumiko:{p}:deliveries"
SUSPECTS = "kumiko:{p}:suspects:{q}"


def message(message_id: str) -> str:
    """An encoded message as Dramatiq's JSON encoder writes it (the fields fetch reads)."""
    return json.dumps({"message_id": message_id, "queue_name": "q", "actor_name": "a"})


class Z(dict[str, float]):
    """A sorted set in a state table: member -> score (equal to a plain dict of the same)."""


def text(value: Any) -> Any:
    """A script reply with bytes decoded (lists recursively)."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return [text(item) for item in value]
    return value


@dataclass(frozen=True)
class Env:
    """One test's scripts, client and key names."""

    client: redis.Redis
    lua: LuaScripts
    prefix: str
    names: dict[str, str]

    @property
    def workers(self) -> list[str]:
        return [self.names["w0"], self.names["w1"], self.names["w2"]]

    def key(self, template: str) -> str:
        return template.format(**self.names)

    def fill(self, state: State) -> State:
        return {self.key(key): value for key, value in state.items()}

    def head(
        self, queue: str = QUEUE, worker: str = "w1", *, now: int = NOW, maintenance: bool = False
    ) -> list[Any]:
        """ARGV[1..6] of a broker command: queue, now, worker, timeouts, maintenance flag."""
        return [
            self.key(queue),
            now,
            self.names[worker],
            HEARTBEAT_TIMEOUT,
            DEAD_TTL,
            "1" if maintenance else "0",
        ]

    def seed(self, given: State) -> None:
        for template, value in given.items():
            key = self.key(template)
            if isinstance(value, Z):
                self.client.zadd(key, dict(value))
            elif isinstance(value, dict):
                self.client.hset(key, mapping=value)
            elif isinstance(value, list):
                self.client.rpush(key, *value)
            elif isinstance(value, set):
                self.client.sadd(key, *value)
            else:
                self.client.set(key, value)

    def state(self) -> State:
        """Every key of this test's prefix (as the prefix fixture deletes them), decoded."""
        found: State = {}
        for pattern in (
            f"kumiko:{self.prefix}:*",
            f"dramatiq:{self.prefix}-*",
            f"dramatiq:__acks__.*.{self.prefix}-*",
        ):
            for raw in self.client.scan_iter(match=pattern, count=1000):
                key: str = text(raw)
                kind: str = text(self.client.type(key))
                if kind == "list":
                    found[key] = text(self.client.lrange(key, 0, -1))
                elif kind == "hash":
                    fields: dict[Any, Any] = self.client.hgetall(key)
                    found[key] = {text(field): text(value) for field, value in fields.items()}
                elif kind == "set":
                    found[key] = {text(member) for member in self.client.smembers(key)}
                elif kind == "zset":
                    scored: Any = self.client.zrange(key, 0, -1, withscores=True)
                    found[key] = Z((text(member), score) for member, score in scored)
                else:
                    found[key] = text(self.client.get(key))
        return found

    def assert_state(self, expected: State) -> None:
        assert self.state() == self.fill(expected)

    def pttl(self, template: str) -> int:
        return int(self.client.pttl(self.key(template)))

    def expire(self, template: str, ttl_ms: int) -> None:
        self.client.pexpire(self.key(template), ttl_ms)

    def assert_ttls(self, expected: dict[str, int]) -> None:
        """Each key's PTTL: ``NO_TTL`` for none, else set to that many ms just now."""
        for template, ttl in expected.items():
            actual = self.pttl(template)
            if ttl == NO_TTL:
                assert actual == NO_TTL, f"{template}: PTTL {actual}, expected none"
            else:
                assert ttl - TTL_SLACK < actual <= ttl, f"{template}: PTTL {actual}, set to {ttl}"

    def heartbeat(self, worker: str) -> float | None:
        score = self.client.zscore(HEARTBEATS, self.names[worker])
        return None if score is None else float(score)


@pytest.fixture
def env(redis_client: redis.Redis, prefix: str) -> Iterator[Env]:
    names = {
        "p": prefix,
        "q": f"{prefix}-worker",
        "w0": f"{prefix}-w0",  # the dead worker of the maintenance rows
        "w1": f"{prefix}-w1",  # the worker running the command
        "w2": f"{prefix}-w2",  # another (live) worker
    }
    environment = Env(redis_client, LuaScripts.register(redis_client), prefix, names)
    yield environment
    redis_client.zrem(HEARTBEATS, *environment.workers)


# == enqueue ================================================================================
# Dramatiq's own enqueue command: no marker (kumiko's idempotent enqueue of a new message is
# guarded_enqueue behind its "sent" marker, see test_guarded_enqueue).
@pytest.mark.parametrize(
    ("given", "queue", "after"),
    [
        pytest.param(
            {},
            QUEUE,
            {LIST: ["r1"], MSGS: {"r1": "body"}},
            id="writes-hash-and-list",
        ),
        pytest.param(
            {LIST: ["r0"], MSGS: {"r0": "b0"}},
            QUEUE,
            {LIST: ["r0", "r1"], MSGS: {"r0": "b0", "r1": "body"}},
            id="appends-to-the-tail",
        ),
        pytest.param(
            {},
            DQ,
            {DQ_LIST: ["r1"], DQ_MSGS: {"r1": "body"}},
            id="delay-queue",
        ),
    ],
)
def test_enqueue(env: Env, given: State, queue: str, after: State) -> None:
    env.seed(given)

    assert env.lua.enqueue(keys=[NAMESPACE], args=[*env.head(queue), "r1", "body"]) == 1

    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


# == fetch ==================================================================================
# Dramatiq's own fetch: pops and claims, checks nothing (kumiko's lane queues use
# fetch_lane). Its reply is flat: rid, body, rid, body, ...
@pytest.mark.parametrize(
    ("given", "count", "reply", "after"),
    [
        pytest.param({}, 3, [], {}, id="empty-queue"),
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r1": "b1", "r2": "b2"}},
            3,
            ["r1", "b1", "r2", "b2"],
            {MSGS: {"r1": "b1", "r2": "b2"}, ACKS: {"r1", "r2"}},
            id="fewer-than-n",
        ),
        pytest.param(
            {LIST: ["r1", "r2", "r3"], MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"}},
            2,
            ["r1", "b1", "r2", "b2"],
            {LIST: ["r3"], MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"}, ACKS: {"r1", "r2"}},
            id="exactly-n-leftover-stays",
        ),
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r2": "b2"}},
            2,
            ["r1", None, "r2", "b2"],
            {MSGS: {"r2": "b2"}, ACKS: {"r1", "r2"}},
            id="vanished-body-is-none-and-still-claimed",
        ),
        pytest.param(
            {LIST: ["r1"], MSGS: {"r1": "b1"}},
            0,
            [],
            {LIST: ["r1"], MSGS: {"r1": "b1"}},
            id="zero-fetches-nothing",
        ),
    ],
)
def test_fetch(env: Env, given: State, count: int, reply: list[Any], after: State) -> None:
    env.seed(given)

    result = env.lua.fetch(keys=[NAMESPACE], args=[*env.head(), count])

    assert text(result) == reply
    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


DEAD_AT = NOW - HEARTBEAT_TIMEOUT - 1_000
ALIVE_AT = NOW - HEARTBEAT_TIMEOUT + 1_000


def test_fetch_maintenance_recovers_a_dead_workers_messages(env: Env) -> None:
    # Given: w0's heartbeat is older than the timeout; it claimed r1 (body) and r2 (no body)
    env.client.zadd(HEARTBEATS, {env.names["w0"]: DEAD_AT})
    env.seed({LIST: ["r0"], MSGS: {"r0": "b0", "r1": "b1"}, DEAD_ACKS: {"r1", "r2"}})

    # When: w1 fetches one message with maintenance
    result = env.lua.fetch(keys=[NAMESPACE], args=[*env.head(maintenance=True), 1])

    # Then: r1 went back to the tail (r0 was fetched first), r2 is forgotten, the ack set is
    # gone and w0, with no ack set left anywhere, left the heartbeats
    assert text(result) == ["r0", "b0"]
    env.assert_state({LIST: ["r1"], MSGS: {"r0": "b0", "r1": "b1"}, ACKS: {"r0"}})
    assert env.heartbeat("w0") is None
    assert env.heartbeat("w1") == NOW


def test_fetch_maintenance_keeps_a_dead_worker_with_another_queues_ack_set(env: Env) -> None:
    env.client.zadd(HEARTBEATS, {env.names["w0"]: DEAD_AT})
    env.seed({MSGS: {"r1": "b1"}, DEAD_ACKS: {"r1"}, DEAD_ACKS_OTHER: {"x1"}})

    result = env.lua.fetch(keys=[NAMESPACE], args=[*env.head(maintenance=True), 0])

    # Then: this queue's claims are recovered; the other queue's ack set (and w0) stay
    assert text(result) == []
    env.assert_state({LIST: ["r1"], MSGS: {"r1": "b1"}, DEAD_ACKS_OTHER: {"x1"}})
    assert env.heartbeat("w0") == DEAD_AT


@pytest.mark.parametrize(
    ("heartbeat", "maintenance"),
    [
        pytest.param(ALIVE_AT, True, id="live-worker"),
        pytest.param(DEAD_AT, False, id="dead-worker-without-maintenance"),
    ],
)
def test_fetch_leaves_claims_alone(env: Env, heartbeat: int, maintenance: bool) -> None:
    env.client.zadd(HEARTBEATS, {env.names["w0"]: heartbeat})
    env.seed({MSGS: {"r1": "b1"}, DEAD_ACKS: {"r1"}})

    env.lua.fetch(keys=[NAMESPACE], args=[*env.head(maintenance=maintenance), 0])

    env.assert_state({MSGS: {"r1": "b1"}, DEAD_ACKS: {"r1"}})
    assert env.heartbeat("w0") == heartbeat


@pytest.mark.parametrize(
    ("queue", "maintenance", "after"),
    [
        pytest.param(
            QUEUE,
            True,
            {XQ: Z({"young": NOW - 1_000}), XQ_MSGS: {"young": "by"}},
            id="expired-deleted-young-kept",
        ),
        pytest.param(
            DQ,
            True,
            {XQ: Z({"young": NOW - 1_000}), XQ_MSGS: {"young": "by"}},
            id="delay-queue-expires-the-canonical-dead-letters",
        ),
        pytest.param(
            QUEUE,
            False,
            {
                XQ: Z({"old": NOW - DEAD_TTL - 1_000, "young": NOW - 1_000}),
                XQ_MSGS: {"old": "bo", "young": "by"},
            },
            id="nothing-expires-without-maintenance",
        ),
    ],
)
def test_fetch_maintenance_expires_dead_letters(
    env: Env, queue: str, maintenance: bool, after: State
) -> None:
    env.seed(
        {
            XQ: Z({"old": NOW - DEAD_TTL - 1_000, "young": NOW - 1_000}),
            XQ_MSGS: {"old": "bo", "young": "by"},
        }
    )

    env.lua.fetch(keys=[NAMESPACE], args=[*env.head(queue, maintenance=maintenance), 1])

    env.assert_state(after)


# == fetch_lane =============================================================================
# Reply: [{rid, body, ...} claimed, {message ids acked as already completed},
# {rid, deliveries, ...} dead-lettered, suspects waiting, 1 if a suspect was claimed alone].
# A "suspect" is an id with a deliveries count (its worker died while holding it); "held" is
# ARGV[9], the messages the consumer holds (0 = idle).
MAX_DELIVERIES = 3


@pytest.mark.parametrize(
    ("given", "count", "done_prefix", "held", "reply", "after"),
    [
        pytest.param({}, 3, "", 0, [[], [], [], 0, 0], {}, id="empty-queue"),
        # -- plain claims
        pytest.param(
            {
                LIST: ["r1", "r2", "r3"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                DELIVERIES: {"r9": "1"},
            },
            2,
            "",
            0,
            [["r1", "b1", "r2", "b2"], [], [], 0, 0],
            {
                LIST: ["r3"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                ACKS: {"r1", "r2"},
                DELIVERIES: {"r1": "1", "r2": "1", "r9": "1"},
            },
            id="claims-n-counts-one-delivery-each-leftover-stays",
        ),
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r1": "b1", "r2": "b2"}},
            1,
            "",
            2,
            [["r1", "b1"], [], [], 0, 0],
            {
                LIST: ["r2"],
                MSGS: {"r1": "b1", "r2": "b2"},
                ACKS: {"r1"},
                DELIVERIES: {"r1": "1"},
            },
            id="n-counts-messages-not-reply-entries",
        ),
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r2": "b2"}},
            3,
            "",
            0,
            [["r1", None, "r2", "b2"], [], [], 0, 0],
            {MSGS: {"r2": "b2"}, ACKS: {"r1", "r2"}, DELIVERIES: {"r1": "1", "r2": "1"}},
            id="fewer-than-n-vanished-body-is-none-and-still-claimed",
        ),
        # -- "already completed" markers
        pytest.param(
            {
                LIST: ["r1", "r2", "r3"],
                MSGS: {"r1": message("m1"), "r2": message("m2"), "r3": message("m3")},
                DONE_M1: "1",
            },
            2,
            DONE_PREFIX,
            0,
            [["r2", message("m2"), "r3", message("m3")], ["m1"], [], 0, 0],
            {
                MSGS: {"r2": message("m2"), "r3": message("m3")},
                ACKS: {"r2", "r3"},
                DELIVERIES: {"r2": "1", "r3": "1"},
                DONE_M1: "1",
            },
            id="completed-message-is-acked-and-listed-not-counted-in-n",
        ),
        pytest.param(
            {LIST: ["r1"], MSGS: {"r1": message("m1")}, DONE_M1: "1"},
            1,
            "",
            0,
            [["r1", message("m1")], [], [], 0, 0],
            {
                MSGS: {"r1": message("m1")},
                ACKS: {"r1"},
                DELIVERIES: {"r1": "1"},
                DONE_M1: "1",
            },
            id="completed-marker-ignored-without-prefix",
        ),
        pytest.param(
            {LIST: ["r1"], DONE_M1: "1"},
            1,
            DONE_PREFIX,
            0,
            [["r1", None], [], [], 0, 0],
            {ACKS: {"r1"}, DELIVERIES: {"r1": "1"}, DONE_M1: "1"},
            id="vanished-body-with-prefix-is-still-returned",
        ),
        pytest.param(
            {LIST: ["r1"], MSGS: {"r1": "not json {"}},
            1,
            DONE_PREFIX,
            0,
            [["r1", "not json {"], [], [], 0, 0],
            {MSGS: {"r1": "not json {"}, ACKS: {"r1"}, DELIVERIES: {"r1": "1"}},
            id="non-json-body-is-returned-not-dropped",
        ),
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r1": "[1, 2]", "r2": '{"message_id": 7}'}},
            2,
            DONE_PREFIX,
            0,
            [["r1", "[1, 2]", "r2", '{"message_id": 7}'], [], [], 0, 0],
            {
                MSGS: {"r1": "[1, 2]", "r2": '{"message_id": 7}'},
                ACKS: {"r1", "r2"},
                DELIVERIES: {"r1": "1", "r2": "1"},
            },
            id="json-without-a-string-message-id-is-returned",
        ),
        # -- suspects while the consumer holds messages: set aside, healthy ones still come
        pytest.param(
            {
                LIST: ["r1", "r2", "r3", "r4"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3", "r4": "b4"},
                DELIVERIES: {"r1": "1", "r3": "2"},
            },
            2,
            "",
            1,
            [["r2", "b2", "r4", "b4"], [], [], 2, 0],
            {
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3", "r4": "b4"},
                ACKS: {"r2", "r4"},
                DELIVERIES: {"r1": "1", "r2": "1", "r3": "2", "r4": "1"},
                SUSPECTS: ["r1", "r3"],
            },
            id="holding-suspects-go-to-the-suspects-list-loop-goes-on",
        ),
        pytest.param(
            {
                LIST: ["r1"],
                MSGS: {"r1": "b1", "r2": "b2"},
                DELIVERIES: {"r2": str(MAX_DELIVERIES)},
                SUSPECTS: ["r2"],
            },
            2,
            "",
            1,
            [["r1", "b1"], [], [], 1, 0],
            {
                MSGS: {"r1": "b1", "r2": "b2"},
                ACKS: {"r1"},
                DELIVERIES: {"r1": "1", "r2": str(MAX_DELIVERIES)},
                SUSPECTS: ["r2"],
            },
            id="holding-the-suspects-list-is-not-touched",
        ),
        # -- idle (ARGV[9] = 0): one suspect runs alone
        pytest.param(
            {
                LIST: ["r1"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                DELIVERIES: {"r2": "1", "r3": "2"},
                SUSPECTS: ["r2", "r3"],
            },
            3,
            "",
            0,
            [["r2", "b2"], [], [], 1, 1],
            {
                LIST: ["r1"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                ACKS: {"r2"},
                DELIVERIES: {"r2": "2", "r3": "2"},
                SUSPECTS: ["r3"],
            },
            id="idle-first-suspect-of-the-list-claimed-alone",
        ),
        pytest.param(
            {
                LIST: ["r2", "r1"],
                MSGS: {"r1": "b1", "r2": "b2"},
                DELIVERIES: {"r2": str(MAX_DELIVERIES - 1)},
            },
            3,
            "",
            0,
            [["r2", "b2"], [], [], 0, 1],
            {
                LIST: ["r1"],
                MSGS: {"r1": "b1", "r2": "b2"},
                ACKS: {"r2"},
                DELIVERIES: {"r2": str(MAX_DELIVERIES)},
            },
            id="idle-no-suspects-waiting-suspect-popped-first-claimed-alone",
        ),
        pytest.param(
            {
                LIST: ["r1", "r2", "r3"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                DELIVERIES: {"r2": "1"},
            },
            3,
            "",
            0,
            [["r1", "b1", "r3", "b3"], [], [], 1, 0],
            {
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                ACKS: {"r1", "r3"},
                DELIVERIES: {"r1": "1", "r2": "1", "r3": "1"},
                SUSPECTS: ["r2"],
            },
            id="idle-suspect-after-a-healthy-claim-is-set-aside",
        ),
        pytest.param(
            {
                LIST: ["r2"],
                MSGS: {"r1": message("m1"), "r2": message("m2"), "r3": message("m3")},
                DELIVERIES: {"r1": "1", "r3": "1"},
                SUSPECTS: ["r1", "r3"],
                DONE_M1: "1",
            },
            2,
            DONE_PREFIX,
            0,
            [["r3", message("m3")], ["m1"], [], 0, 1],
            {
                LIST: ["r2"],
                MSGS: {"r2": message("m2"), "r3": message("m3")},
                ACKS: {"r3"},
                DELIVERIES: {"r3": "2"},
                DONE_M1: "1",
            },
            id="idle-completed-suspect-is-acked-and-the-next-runs-alone",
        ),
        # -- poison messages: dead-lettered at the max deliveries
        pytest.param(
            {
                LIST: ["r1", "r2"],
                MSGS: {"r1": "b1", "r2": "b2"},
                DELIVERIES: {"r1": str(MAX_DELIVERIES)},
            },
            2,
            "",
            0,
            [["r2", "b2"], [], ["r1", MAX_DELIVERIES], 0, 0],
            {
                MSGS: {"r2": "b2"},
                ACKS: {"r2"},
                DELIVERIES: {"r2": "1"},
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": "b1"},
            },
            id="at-max-from-the-main-list-dead-lettered",
        ),
        pytest.param(
            {
                LIST: ["r1", "r2"],
                MSGS: {"r1": "b1", "r2": "b2"},
                DELIVERIES: {"r1": str(MAX_DELIVERIES + 2)},
            },
            2,
            "",
            1,
            [["r2", "b2"], [], ["r1", MAX_DELIVERIES + 2], 0, 0],
            {
                MSGS: {"r2": "b2"},
                ACKS: {"r2"},
                DELIVERIES: {"r2": "1"},
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": "b1"},
            },
            id="above-max-while-holding-dead-lettered",
        ),
        pytest.param(
            {
                LIST: ["r3"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                DELIVERIES: {"r1": str(MAX_DELIVERIES), "r2": "1"},
                SUSPECTS: ["r1", "r2"],
            },
            2,
            "",
            0,
            [["r2", "b2"], [], ["r1", MAX_DELIVERIES], 0, 1],
            {
                LIST: ["r3"],
                MSGS: {"r2": "b2", "r3": "b3"},
                ACKS: {"r2"},
                DELIVERIES: {"r2": "2"},
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": "b1"},
            },
            id="at-max-from-the-suspects-list-dead-lettered-next-runs-alone",
        ),
        pytest.param(
            {LIST: ["r1"], DELIVERIES: {"r1": str(MAX_DELIVERIES)}},
            1,
            "",
            0,
            [[], [], ["r1", MAX_DELIVERIES], 0, 0],
            {},
            id="at-max-with-a-vanished-body-count-still-cleared",
        ),
    ],
)
def test_fetch_lane(
    env: Env,
    given: State,
    count: int,
    done_prefix: str,
    held: int,
    reply: list[Any],
    after: State,
) -> None:
    env.seed(given)

    result = env.lua.fetch_lane(
        keys=[NAMESPACE, env.key(DELIVERIES), env.key(SUSPECTS)],
        args=[*env.head(), count, env.key(done_prefix), held, MAX_DELIVERIES],
    )

    assert text(result) == reply
    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


def test_fetch_lane_maintenance_recovers_a_dead_workers_message_as_a_suspect(env: Env) -> None:
    # Given: dead w0 held r1 (delivered once); r0 waits on the queue
    env.client.zadd(HEARTBEATS, {env.names["w0"]: DEAD_AT})
    env.seed(
        {LIST: ["r0"], MSGS: {"r0": "b0", "r1": "b1"}, DEAD_ACKS: {"r1"}, DELIVERIES: {"r1": "1"}}
    )

    # When: idle w1 fetches two with maintenance
    result = env.lua.fetch_lane(
        keys=[NAMESPACE, env.key(DELIVERIES), env.key(SUSPECTS)],
        args=[*env.head(maintenance=True), 2, "", 0, MAX_DELIVERIES],
    )

    # Then: r1 came back behind r0; r0 was claimed, so r1 waits in the suspects list
    assert text(result) == [["r0", "b0"], [], [], 1, 0]
    env.assert_state(
        {
            MSGS: {"r0": "b0", "r1": "b1"},
            ACKS: {"r0"},
            DELIVERIES: {"r0": "1", "r1": "1"},
            SUSPECTS: ["r1"],
        }
    )
    assert env.heartbeat("w0") is None


# == ack ====================================================================================
@pytest.mark.parametrize(
    ("given", "reply", "after"),
    [
        pytest.param(
            {MSGS: {"r1": "b1", "r2": "b2"}, ACKS: {"r1", "r2"}},
            1,
            {MSGS: {"r2": "b2"}, ACKS: {"r2"}},
            id="owned",
        ),
        pytest.param(
            {MSGS: {"r1": "b1"}, ACKS_W2: {"r1"}},
            0,
            {MSGS: {"r1": "b1"}, ACKS_W2: {"r1"}},
            id="not-owned",
        ),
        pytest.param(
            {MSGS: {"r1": "b1"}, ACKS: {"r1"}, DONE_M1: "1", DELIVERIES: {"r1": "1"}},
            1,
            {DONE_M1: "1", DELIVERIES: {"r1": "1"}},
            id="kumiko-records-untouched",
        ),
    ],
)
def test_ack(env: Env, given: State, reply: int, after: State) -> None:
    env.seed(given)

    assert env.lua.ack(keys=[NAMESPACE], args=[*env.head(), "r1"]) == reply

    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


# == settle =================================================================================
# Every call clears r1's deliveries count (r2's stays); "completed" writes the marker even
# when the delivery is no longer this worker's.
SETTLE_OWNED: State = {
    MSGS: {"r1": "b1", "r0": "b0"},
    ACKS: {"r1"},
    DELIVERIES: {"r1": "1", "r2": "1"},
}
SETTLE_FOREIGN: State = {MSGS: {"r1": "b1"}, ACKS_W2: {"r1"}, DELIVERIES: {"r1": "1", "r2": "1"}}


@pytest.mark.parametrize(
    ("given", "outcome", "retry_queue", "reply", "after", "ttls"),
    [
        pytest.param(
            SETTLE_OWNED,
            "ack",
            None,
            1,
            {MSGS: {"r0": "b0"}, DELIVERIES: {"r2": "1"}},
            {},
            id="ack-owned",
        ),
        pytest.param(
            SETTLE_FOREIGN,
            "ack",
            None,
            0,
            {MSGS: {"r1": "b1"}, ACKS_W2: {"r1"}, DELIVERIES: {"r2": "1"}},
            {},
            id="ack-not-owned-clears-only-the-count",
        ),
        pytest.param(
            {MSGS: {"r1": "b1"}, ACKS: {"r1"}},
            "ack",
            None,
            1,
            {},
            {},
            id="ack-without-a-count",
        ),
        pytest.param(
            SETTLE_OWNED,
            "completed",
            None,
            1,
            {MSGS: {"r0": "b0"}, DELIVERIES: {"r2": "1"}, DONE_M1: "1"},
            {DONE_M1: TTL},
            id="completed-owned-sets-the-marker",
        ),
        pytest.param(
            SETTLE_FOREIGN,
            "completed",
            None,
            0,
            {MSGS: {"r1": "b1"}, ACKS_W2: {"r1"}, DELIVERIES: {"r2": "1"}, DONE_M1: "1"},
            {DONE_M1: TTL},
            id="completed-not-owned-still-sets-the-marker",
        ),
        pytest.param(
            SETTLE_OWNED,
            "retry",
            QUEUE,
            1,
            {LIST: ["r3"], MSGS: {"r0": "b0", "r3": "retry"}, DELIVERIES: {"r2": "1"}},
            {},
            id="retry-owned-on-the-queue",
        ),
        pytest.param(
            SETTLE_OWNED,
            "retry",
            DQ,
            1,
            {
                MSGS: {"r0": "b0"},
                DQ_LIST: ["r3"],
                DQ_MSGS: {"r3": "retry"},
                DELIVERIES: {"r2": "1"},
            },
            {},
            id="retry-owned-on-the-delay-queue",
        ),
        pytest.param(
            SETTLE_FOREIGN,
            "retry",
            QUEUE,
            0,
            {MSGS: {"r1": "b1"}, ACKS_W2: {"r1"}, DELIVERIES: {"r2": "1"}},
            {},
            id="retry-not-owned-enqueues-nothing",
        ),
        pytest.param(
            SETTLE_OWNED,
            "dead",
            None,
            1,
            {
                MSGS: {"r0": "b0"},
                DELIVERIES: {"r2": "1"},
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": "b1"},
            },
            {},
            id="dead-owned-dead-letters",
        ),
        pytest.param(
            {ACKS: {"r1"}, DELIVERIES: {"r1": "1"}},
            "dead",
            None,
            1,
            {},
            {},
            id="dead-owned-without-body-drops-the-claim",
        ),
        pytest.param(
            SETTLE_FOREIGN,
            "dead",
            None,
            0,
            {MSGS: {"r1": "b1"}, ACKS_W2: {"r1"}, DELIVERIES: {"r2": "1"}},
            {},
            id="dead-not-owned-moves-nothing",
        ),
    ],
)
def test_settle(
    env: Env,
    given: State,
    outcome: str,
    retry_queue: str | None,
    reply: int,
    after: State,
    ttls: dict[str, int],
) -> None:
    env.seed(given)
    retry = [] if retry_queue is None else [env.key(retry_queue), "r3", "retry"]

    result = env.lua.settle(
        keys=[NAMESPACE, env.key(DELIVERIES), env.key(DONE_M1)],
        args=[*env.head(), "r1", outcome, TTL, *retry],
    )

    assert result == reply
    env.assert_state(after)
    env.assert_ttls(ttls)
    assert env.heartbeat("w1") == NOW


def test_settle_retry_sent_twice_enqueues_once(env: Env) -> None:
    # Given: r1 claimed by w1
    env.seed({MSGS: {"r1": "b1"}, ACKS: {"r1"}, DELIVERIES: {"r1": "1"}})
    keys = [NAMESPACE, env.key(DELIVERIES), env.key(DONE_M1)]
    args = [*env.head(), "r1", "retry", TTL, env.key(QUEUE), "r3", "retry"]

    # When: the same settle is sent twice (a command re-sent after a dropped connection)
    first = env.lua.settle(keys=keys, args=args)
    second = env.lua.settle(keys=keys, args=args)

    # Then: the retry is there once
    assert (first, second) == (1, 0)
    env.assert_state({LIST: ["r3"], MSGS: {"r3": "retry"}})


# == nack ===================================================================================
@pytest.mark.parametrize(
    ("given", "queue", "reply", "after"),
    [
        pytest.param(
            {MSGS: {"r1": "b1", "r2": "b2"}, ACKS: {"r1", "r2"}},
            QUEUE,
            1,
            {MSGS: {"r2": "b2"}, ACKS: {"r2"}, XQ: Z({"r1": NOW}), XQ_MSGS: {"r1": "b1"}},
            id="owned-with-body-dead-letters",
        ),
        pytest.param(
            {ACKS: {"r1"}},
            QUEUE,
            0,
            {},
            id="owned-without-body-drops-the-claim",
        ),
        pytest.param(
            {MSGS: {"r1": "b1"}, ACKS_W2: {"r1"}},
            QUEUE,
            0,
            {MSGS: {"r1": "b1"}, ACKS_W2: {"r1"}},
            id="not-owned",
        ),
        pytest.param(
            {DQ_MSGS: {"r1": "b1"}, DQ_ACKS: {"r1"}},
            DQ,
            1,
            {XQ: Z({"r1": NOW}), XQ_MSGS: {"r1": "b1"}},
            id="delay-queue-dead-letters-into-canonical-xq",
        ),
    ],
)
def test_nack(env: Env, given: State, queue: str, reply: int, after: State) -> None:
    env.seed(given)

    assert env.lua.nack(keys=[NAMESPACE], args=[*env.head(queue), "r1"]) == reply

    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


def test_nack_scores_the_dead_letter_by_a_real_millisecond_clock(env: Env) -> None:
    # Given: a 13-digit "now", as the broker passes it (Lua numbers must keep every digit)
    now = 1_796_080_435_717
    env.seed({MSGS: {"r1": "b1"}, ACKS: {"r1"}})

    assert env.lua.nack(keys=[NAMESPACE], args=[*env.head(now=now), "r1"]) == 1

    env.assert_state({XQ: Z({"r1": now}), XQ_MSGS: {"r1": "b1"}})
    assert env.heartbeat("w1") == now


# == requeue ================================================================================
REQUEUE_GIVEN: State = {
    LIST: ["r0"],
    MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
    ACKS: {"r1", "r2", "r3"},
    ACKS_W2: {"r4"},
}


@pytest.mark.parametrize(
    ("ids", "reply", "after"),
    [
        pytest.param(
            [],
            0,
            REQUEUE_GIVEN,
            id="no-ids",
        ),
        pytest.param(
            ["r2", "r1"],
            2,
            {
                LIST: ["r0", "r2", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r3"},
                ACKS_W2: {"r4"},
            },
            id="owned-with-body-go-back-in-order",
        ),
        pytest.param(
            ["r1", "r3", "r4", "r9"],
            1,
            {
                LIST: ["r0", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r2"},
                ACKS_W2: {"r4"},
            },
            id="bodyless-and-foreign-and-unknown-stay-out",
        ),
        pytest.param(
            ["r1", "r1"],
            1,
            {
                LIST: ["r0", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r2", "r3"},
                ACKS_W2: {"r4"},
            },
            id="an-id-given-twice-goes-back-once",
        ),
    ],
)
def test_requeue(env: Env, ids: list[str], reply: int, after: State) -> None:
    env.seed(REQUEUE_GIVEN)

    assert env.lua.requeue(keys=[NAMESPACE], args=[*env.head(), *ids]) == reply

    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


# With KEYS[2] (a kumiko lane), each id that goes back has its delivery undone: its
# deliveries count goes down by one and the field goes at 0 (never below).
@pytest.mark.parametrize(
    ("deliveries", "ids", "lane", "reply", "after"),
    [
        pytest.param(
            {"r1": "2", "r2": "1", "r3": "1", "r4": "1"},
            ["r2", "r1"],
            True,
            2,
            {
                LIST: ["r0", "r2", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r3"},
                ACKS_W2: {"r4"},
                DELIVERIES: {"r1": "1", "r3": "1", "r4": "1"},
            },
            id="counts-go-down-and-the-field-goes-at-zero",
        ),
        pytest.param(
            {"r1": "2", "r2": "1", "r3": "1", "r4": "1", "r9": "1"},
            ["r3", "r4", "r9"],
            True,
            0,
            {
                LIST: ["r0"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r1", "r2"},
                ACKS_W2: {"r4"},
                DELIVERIES: {"r1": "2", "r2": "1", "r4": "1", "r9": "1"},
            },
            id="an-owned-bodyless-id-loses-its-count-foreign-and-unknown-keep-theirs",
        ),
        pytest.param(
            {"r4": "1"},
            ["r1"],
            True,
            1,
            {
                LIST: ["r0", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r2", "r3"},
                ACKS_W2: {"r4"},
                DELIVERIES: {"r4": "1"},
            },
            id="no-count-never-goes-negative",
        ),
        pytest.param(
            {"r1": "2"},
            ["r1", "r1"],
            True,
            1,
            {
                LIST: ["r0", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r2", "r3"},
                ACKS_W2: {"r4"},
                DELIVERIES: {"r1": "1"},
            },
            id="an-id-given-twice-is-undone-once",
        ),
        pytest.param(
            {"r1": "2", "r2": "1"},
            ["r2", "r1"],
            False,
            2,
            {
                LIST: ["r0", "r2", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r3"},
                ACKS_W2: {"r4"},
                DELIVERIES: {"r1": "2", "r2": "1"},
            },
            id="without-the-hash-counts-stay",
        ),
    ],
)
def test_requeue_undoes_lane_deliveries(
    env: Env, deliveries: dict[str, str], ids: list[str], lane: bool, reply: int, after: State
) -> None:
    env.seed({**REQUEUE_GIVEN, DELIVERIES: deliveries})
    keys = [NAMESPACE, env.key(DELIVERIES)] if lane else [NAMESPACE]

    assert env.lua.requeue(keys=keys, args=[*env.head(), *ids]) == reply

    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


# == purge ==================================================================================
PURGE_GIVEN: State = {
    LIST: ["r1"],
    MSGS: {"r1": "b1", "r2": "b2"},
    ACKS: {"r2"},
    ACKS_W2: {"r3"},
    XQ: Z({"x1": NOW}),
    XQ_MSGS: {"x1": "bx"},
    DQ_LIST: ["d1"],
    DQ_MSGS: {"d1": "bd", "d2": "bd2"},
    DQ_ACKS: {"d2"},
    DQ_ACKS_W2: {"d3"},
}


@pytest.mark.parametrize(
    ("queue", "after"),
    [
        pytest.param(
            QUEUE,
            {
                ACKS_W2: {"r3"},
                DQ_LIST: ["d1"],
                DQ_MSGS: {"d1": "bd", "d2": "bd2"},
                DQ_ACKS: {"d2"},
                DQ_ACKS_W2: {"d3"},
            },
            id="queue",
        ),
        pytest.param(
            DQ,
            {
                LIST: ["r1"],
                MSGS: {"r1": "b1", "r2": "b2"},
                ACKS: {"r2"},
                ACKS_W2: {"r3"},
                DQ_ACKS_W2: {"d3"},
            },
            id="delay-queue-also-drops-the-canonical-xq",
        ),
    ],
)
def test_purge(env: Env, queue: str, after: State) -> None:
    env.seed(PURGE_GIVEN)

    assert env.lua.purge(keys=[NAMESPACE], args=env.head(queue)) is None

    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


# == qsize ==================================================================================
@pytest.mark.parametrize("queue", [pytest.param(QUEUE, id="queue"), pytest.param(DQ, id="dq")])
def test_qsize_counts_queue_and_delay_queue_with_own_claims(env: Env, queue: str) -> None:
    env.seed(
        {
            LIST: ["r1", "r2"],  # the list is not counted: its ids are counted in MSGS
            MSGS: {"r1": "b", "r2": "b"},
            ACKS: {"r3"},
            ACKS_W2: {"r4", "r5"},  # another worker's claims are not counted
            DQ_MSGS: {"d1": "b"},
            DQ_ACKS: {"d2", "d3"},
            XQ: Z({"x1": NOW}),  # nor are dead letters
            XQ_MSGS: {"x1": "b"},
        }
    )

    assert env.lua.qsize(keys=[NAMESPACE], args=env.head(queue)) == 2 + 1 + 1 + 2
    assert env.heartbeat("w1") == NOW


def test_qsize_of_nothing_is_zero(env: Env) -> None:
    assert env.lua.qsize(keys=[NAMESPACE], args=env.head()) == 0


# == guarded_enqueue ========================================================================
@pytest.mark.parametrize(
    ("given", "reply", "after", "ttls"),
    [
        pytest.param(
            {},
            [1],
            {LIST: ["r1"], MSGS: {"r1": "body"}, GUARD: "sched-1"},
            {GUARD: TTL},
            id="guard-absent-enqueues",
        ),
        pytest.param(
            {GUARD: "sched-0"},
            [0],
            {GUARD: "sched-0"},
            {GUARD: NO_TTL},
            id="guard-present-writes-nothing",
        ),
    ],
)
def test_guarded_enqueue(
    env: Env, given: State, reply: list[int], after: State, ttls: dict[str, int]
) -> None:
    env.seed(given)

    result = env.lua.guarded_enqueue(
        keys=[env.key(MSGS), env.key(LIST), env.key(GUARD)], args=["r1", "body", TTL, "sched-1"]
    )

    assert result == reply
    env.assert_state(after)
    env.assert_ttls(ttls)


def test_guarded_enqueue_behind_a_sent_marker_is_written_once(env: Env) -> None:
    # Given: the call KumikoBroker.enqueue makes: the guard is the "sent" marker of the rid
    keys = [env.key(MSGS), env.key(LIST), env.key(SENT)]
    args: list[str | int] = ["r1", "body", TTL, "1"]

    # When: the same write is sent twice (a command re-sent after a dropped connection)
    first = env.lua.guarded_enqueue(keys=keys, args=args)
    second = env.lua.guarded_enqueue(keys=keys, args=args)

    # Then: the message is there once, and the marker keeps its first TTL
    assert (first, second) == ([1], [0])
    env.assert_state({LIST: ["r1"], MSGS: {"r1": "body"}, SENT: "1"})
    env.assert_ttls({SENT: TTL})


# == guarded_enqueue_batch ==================================================================
@pytest.mark.parametrize(
    ("given", "triples", "reply", "after", "ttls"),
    [
        pytest.param(
            {GUARD_2: "sched-0"},
            [(GUARD, "r1", "b1"), (GUARD_2, "r2", "b2"), (GUARD_3, "r3", "b3")],
            [1, 0, 1],
            {
                LIST: ["r1", "r3"],
                MSGS: {"r1": "b1", "r3": "b3"},
                GUARD: "sched-1",
                GUARD_2: "sched-0",
                GUARD_3: "sched-1",
            },
            {GUARD: TTL, GUARD_2: NO_TTL, GUARD_3: TTL},
            id="mixed-guards",
        ),
        pytest.param(
            {},
            [(GUARD, "r1", "b1"), (GUARD, "r2", "b2")],
            [1, 0],
            {LIST: ["r1"], MSGS: {"r1": "b1"}, GUARD: "sched-1"},
            {GUARD: TTL},
            id="same-guard-twice-in-one-batch",
        ),
        pytest.param({}, [], [], {}, {}, id="empty-batch"),
    ],
)
def test_guarded_enqueue_batch(
    env: Env,
    given: State,
    triples: list[tuple[str, str, str]],
    reply: list[int],
    after: State,
    ttls: dict[str, int],
) -> None:
    env.seed(given)
    args: list[Any] = [TTL, "sched-1"]
    for guard, rid, body in triples:
        args += [env.key(guard), rid, body]

    result = env.lua.guarded_enqueue_batch(keys=[env.key(MSGS), env.key(LIST)], args=args)

    assert result == reply
    env.assert_state(after)
    env.assert_ttls(ttls)


# == boot_once ==============================================================================
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
            {LIST: ["r1"], MSGS: {"r1": "body"}, BOOT_MARKER: "m1", GUARD: "m1"},
            {BOOT_MARKER: NO_TTL, GUARD: TTL},
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


# == cron_tick ==============================================================================
TICK = 1_700_000_000


@pytest.mark.parametrize(
    ("given", "tick", "reply", "after", "ttls"),
    [
        pytest.param(
            {},
            TICK,
            [1],
            {LIST: ["r1"], MSGS: {"r1": "body"}, GUARD: "sched-1", LAST_TICK: str(TICK)},
            {GUARD: TTL, LAST_TICK: TTL},
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
            {LIST: ["r1"], MSGS: {"r1": "body"}, GUARD: "sched-1", LAST_TICK: str(TICK + 60)},
            {GUARD: TTL, LAST_TICK: TTL},
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
        keys=[env.key(MSGS), env.key(LIST), env.key(GUARD), env.key(LAST_TICK)],
        args=["r1", "body", TTL, "sched-1", tick, TTL],
    )

    assert result == reply
    env.assert_state(after)
    env.assert_ttls(ttls)


# == dedup_dispatch =========================================================================
@pytest.mark.parametrize(
    ("given", "reply", "after", "ttls"),
    [
        pytest.param(
            {},
            [1, "m1"],
            {LIST: ["r1"], MSGS: {"r1": "body"}, RECORD: {"id": "m1", "state": "queued"}},
            {RECORD: TTL},
            id="no-record-enqueues",
        ),
        pytest.param(
            {RECORD: {"fid": "m7", "fpayload": "{}"}},
            [1, "m1"],
            {LIST: ["r1"], MSGS: {"r1": "body"}, RECORD: {"id": "m1", "state": "queued"}},
            {RECORD: TTL},
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
        keys=[env.key(MSGS), env.key(LIST), env.key(RECORD)],
        args=["r1", "body", TTL, "m1", '{"n": 2}', "t2"],
    )

    assert text(result) == reply
    env.assert_state(after)
    env.assert_ttls(ttls)


# == dedup_mark_running =====================================================================
@pytest.mark.parametrize(
    ("given", "reply", "after", "ttls"),
    [
        pytest.param(
            {RECORD: {"id": "m1", "state": "queued", "fid": "m5"}},
            1,
            {RECORD: {"id": "m1", "state": "running", "fid": "m5"}},
            {RECORD: TTL},
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

    assert env.lua.dedup_mark_running(keys=[env.key(RECORD)], args=["m1", TTL]) == reply

    env.assert_state(after)
    env.assert_ttls(ttls)


# == dedup_requeue ==========================================================================
@pytest.mark.parametrize(
    ("given", "next_id", "reply", "after", "ttls"),
    [
        pytest.param(
            {RECORD: {"id": "m1", "state": "running"}},
            "m1",
            1,
            {RECORD: {"id": "m1", "state": "queued"}},
            {RECORD: TTL},
            id="retry-same-id-queued-again",
        ),
        pytest.param(
            {RECORD: {"id": "m1", "state": "running", "fid": "m5", "fpayload": "{}"}},
            "m2",
            1,
            {RECORD: {"id": "m2", "state": "queued", "fid": "m5", "fpayload": "{}"}},
            {RECORD: TTL},
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

    assert env.lua.dedup_requeue(keys=[env.key(RECORD)], args=["m1", next_id, TTL]) == reply

    env.assert_state(after)
    env.assert_ttls(ttls)


# == dedup_finish ===========================================================================
@pytest.mark.parametrize(
    ("given", "reply", "after", "ttls"),
    [
        pytest.param(
            {RECORD: {"id": "m1", "state": "running"}},
            ["freed"],
            {},
            {},
            id="freed",
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
                }
            },
            {RECORD: TTL},
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

    result = env.lua.dedup_finish(keys=[env.key(RECORD)], args=["m1", TTL])

    assert text(result) == reply
    env.assert_state(after)
    env.assert_ttls(ttls)


# == dedup_handover =========================================================================
ENDING: dict[str, str] = {
    "id": "m1",
    "state": "ending",
    "fid": "m5",
    "fpayload": "{}",
    "ftrigger": "t2",
}


@pytest.mark.parametrize(
    ("record", "reply", "after", "ttls"),
    [
        pytest.param(
            ENDING,
            [1],
            {LIST: ["r5"], MSGS: {"r5": "follow-up"}, RECORD: {"id": "m5", "state": "queued"}},
            {RECORD: TTL},
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
        keys=[env.key(MSGS), env.key(LIST), env.key(RECORD)],
        args=["r5", "follow-up", "m1", "m5", TTL],
    )

    assert result == reply
    env.assert_state(after)
    env.assert_ttls(ttls)


# == enqueue steps: the message is written before its guard =================================
# Lua does not roll back: a message that fails to write (here: its hash key holds a string)
# must leave no guard, marker or record behind that would block it for good.
@pytest.mark.parametrize(
    "script",
    ["guarded_enqueue", "guarded_enqueue_batch", "boot_once", "cron_tick", "dedup_handover"],
)
def test_a_failed_message_write_leaves_no_guard(env: Env, script: str) -> None:
    # Given: the queue's message hash key holds a string
    env.seed({MSGS: "not a hash"})
    if script == "dedup_handover":
        env.seed({RECORD: ENDING})
    queue_keys = [env.key(MSGS), env.key(LIST)]
    calls: dict[str, tuple[list[str], list[str | int]]] = {
        "guarded_enqueue": ([*queue_keys, env.key(GUARD)], ["r1", "body", TTL, "sched-1"]),
        "guarded_enqueue_batch": (queue_keys, [TTL, "sched-1", env.key(GUARD), "r1", "body"]),
        "boot_once": (
            [*queue_keys, env.key(BOOT_MARKER), env.key(GUARD)],
            ["r1", "body", TTL, "m1"],
        ),
        "cron_tick": (
            [*queue_keys, env.key(GUARD), env.key(LAST_TICK)],
            ["r1", "body", TTL, "sched-1", TICK, TTL],
        ),
        "dedup_handover": (
            [*queue_keys, env.key(RECORD)],
            ["r5", "follow-up", "m1", "m5", TTL],
        ),
    }
    keys, args = calls[script]

    # When / Then: the script errors out, and nothing besides the seeded keys exists
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        getattr(env.lua, script)(keys=keys, args=args)
    expected: State = {MSGS: "not a hash"}
    if script == "dedup_handover":
        expected[RECORD] = ENDING
    env.assert_state(expected)


# == lock_acquire ===========================================================================
@pytest.mark.parametrize(
    ("given", "reply", "after", "ttls"),
    [
        pytest.param(
            {GUARD: "1"},
            2,
            {GUARD: "1"},
            {},
            id="handed-off-before-takes-nothing",
        ),
        pytest.param(
            {GUARD: "1", LOCK: "token-b"},
            2,
            {GUARD: "1", LOCK: "token-b"},
            {LOCK: SHORT_TTL},
            id="handed-off-before-even-when-held",
        ),
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

    result = env.lua.lock_acquire(keys=[env.key(LOCK), env.key(GUARD)], args=["token-a", TTL])

    assert result == reply
    env.assert_state(after)
    env.assert_ttls(ttls)


# == lock_renew =============================================================================
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


# == lock_release ===========================================================================
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
