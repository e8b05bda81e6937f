"""State tables for every Lua script in ``kumiko_dramatiq/lua/``.

Each row is (Redis state before, KEYS, ARGV) -> (reply, Redis state after, TTLs). Rows
name their keys with templates (``LIST``, ``ACKS``, ``GUARD``, ...) that :class:`Env` fills
with the test's own prefix and worker ids, so every key is deleted by the ``prefix`` fixture.
:meth:`Env.state` reads back every key of the prefix, so a row's "after" is the WHOLE state:
a key a script should not touch, or should not create, fails the row when it does.

The broker commands (``lua/_dispatch.lua``) take the queue as ARGV[1] and one packed head
"<now ms> <worker id> <heartbeat timeout ms> <dead message TTL ms> <0|1 maintenance>" as
ARGV[2] (:meth:`Env.head`); their own arguments start at ARGV[3]. They all write the worker's
heartbeat to the shared ``dramatiq:__heartbeats__``: the tests use worker ids built from the
prefix, call the scripts with a fake ``now`` (:data:`NOW`, far older than any live worker's
heartbeat, so maintenance only ever sees this test's workers as dead) and remove their worker
ids from the heartbeats afterwards.

Kumiko's lane queues keep every message out with a worker in the in-flight hash
(``INFLIGHT``: redis id -> "<deliveries>|<claimed ms>|<host:pid>", :func:`entry`):
``fetch_lane`` counts each delivery there, ``settle`` removes the entry of a delivery still
its worker's (on every outcome; another worker's entry stays) and
``requeue`` undoes a delivery that never ran. The run history (:mod:`kumiko_dramatiq.history`:
``fetch_lane`` for a poison message, ``settle``, ``run_put``, ``cancel``; ``trim_runs`` in
``lua/_history.lua``) stores each record as JSON: rows name records with :class:`J`, equal to
any string that decodes to the same object (Lua's cjson orders keys as it likes), and check
the TTL of every key they leave (:meth:`Env.assert_expiry`).

Every write onto a queue rings the queue's doorbell (``lua/_bell.lua``): the list ``BELL``
("<queue list>:bell") gets one token "1", with a TTL of :data:`BELL_TTL`, unless a token
waits there already (then neither the token nor its TTL changes). :meth:`Env.assert_state`
checks that every bell left holds a TTL of at most :data:`BELL_TTL`; the bell's own rows
check it was set just now, or left as it was.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pytest
import redis

from kumiko_dramatiq.broker import acl
from kumiko_dramatiq.broker.lua import LuaScripts
from kumiko_dramatiq.context import JobContext, Trigger
from kumiko_dramatiq.messages import build_message
from kumiko_dramatiq.registry import Feature

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
DEAD_DQ_ACKS = "dramatiq:__acks__.{w0}.{q}.DQ"
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
#: The index of app.job's live dedup records (member: the dedup key, score: its expiry).
DEDUP_INDEX = "kumiko:{p}:dedupidx:app.job"
#: The index of held locks (member: the lock key after "lock:", score: its lease's expiry)
#: and when each was taken.
LOCKS = "kumiko:{p}:locks"
LOCKS_SINCE = "kumiko:{p}:locks:since"
LOCK = "kumiko:{p}:lock:app.job"
LOCK_2 = "kumiko:{p}:lock:app.job2"
LOCK_3 = "kumiko:{p}:lock:app.job3"
INFLIGHT = "kumiko:{p}:inflight"
SUSPECTS = "kumiko:{p}:suspects:{q}"
PAUSED = "kumiko:{p}:paused"
PARKED = "kumiko:{p}:parked:app:job:sync"
#: Ids cancel withdrew (their body deleted) still in the queue's lists, or in the job's
#: parked list while it is paused.
WITHDRAWN = "dramatiq:{q}:withdrawn"
PARKED_WITHDRAWN = "kumiko:{p}:parked-withdrawn:app:job:sync"
CANCEL_M1 = "kumiko:{p}:cancel:m1"
BELL = "dramatiq:{q}:bell"
DQ_BELL = "dramatiq:{q}.DQ:bell"
#: The TTL (ms) of a doorbell's token, set when the token is pushed (never refreshed).
BELL_TTL = 60_000


PROBE_DRAMATIQ = "dramatiq:{p}-probe"
PROBE_KUMIKO = "kumiko:{p}:probe"

# -- run history (records: kumiko_dramatiq/history.py; keys: lua/_history.lua) -------------
ROOT = "kumiko:{p}:"
JOB = "app:job:sync"  # retries=2: 3 attempts at most
TENANT_JOB = "app:job:nightly"  # per tenant, retries=1: 2 attempts at most
RUN_WORKER = "host-a:101"  # fetch_lane's ARGV[6] ("host:pid"), named in in-flight entries
OTHER_RUN_WORKER = "host-b:202"  # the worker of an earlier delivery (it died)
#: TTLs (ms) of completed and cancelled records, and of running, failed and dead ones; the
#: tenant and origin indexes live as long as the longer of the two.
COMPLETED_TTL = 300_000
FAILED_TTL = 900_000
LONG_TTL = max(COMPLETED_TTL, FAILED_TTL)
CAP = 100
#: fetch_lane dead-letters a message delivered this many times without an outcome.
MAX_DELIVERIES = 3
ENQUEUED_AT = NOW - 30_000
STARTED_AT = NOW - 20_000
#: The claim time of an earlier delivery (its worker died).
CLAIMED_AT = NOW - 90_000
TICK_AT = "2024-05-01T02:00:00+00:00"
#: The times of index entries older than the completed and than the failed status age.
PAST_COMPLETED_AGE = NOW - COMPLETED_TTL - 1_000
PAST_FAILED_AGE = NOW - FAILED_TTL - 1_000


def run_hash(message_id: str) -> str:
    return f"{ROOT}run:{message_id}"


def by_job(status: str, job: str = JOB) -> str:
    return f"{ROOT}runs:job:{job}:{status}"


def by_status(status: str) -> str:
    return f"{ROOT}runs:status:{status}"


def by_tenant(tenant: str) -> str:
    return f"{ROOT}runs:tenant:{tenant}"


def by_origin(origin: str) -> str:
    return f"{ROOT}runs:origin:{origin}"


def dead_note(message_id: str) -> str:
    return f"{ROOT}dead:{message_id}"


def entry(deliveries: int, claimed: int = NOW, worker: str = RUN_WORKER) -> str:
    """An in-flight entry: ``"<deliveries>|<claimed ms>|<host:pid>"`` (fetch_lane writes
    ``now`` and its ARGV[6])."""
    return f"{deliveries}|{claimed}|{worker}"


def earlier(deliveries: int) -> str:
    """The entry of a message another worker claimed earlier (and died with)."""
    return entry(deliveries, CLAIMED_AT, OTHER_RUN_WORKER)


def encoded(data: dict[str, Any]) -> str:
    """``data`` as Dramatiq's JSON encoder writes a message (compact, fields in order)."""
    return json.dumps(data, separators=(",", ":"))


def message(message_id: str, actor: str = "a") -> str:
    """An encoded message as Dramatiq writes it, not kumiko's: its message id is the last
    field but one (fetch_lane reads it there without decoding) and its actor name is what
    fetch_lane matches against the paused jobs."""
    return encoded(
        {
            "queue_name": "q",
            "actor_name": actor,
            "args": [],
            "kwargs": {},
            "options": {},
            "message_id": message_id,
            "message_timestamp": ENQUEUED_AT,
        }
    )


def _noop(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


_APP = Feature("app")
_APP.job("sync", retries=2)(_noop)
_APP.job("nightly", per_tenant=True, retries=1)(_noop)


def kumiko_message(
    message_id: str,
    *,
    job: str = JOB,
    trigger: Trigger = "manual",
    failures: int = 0,
    tenant: str | None = None,
    origin: str | None = None,
    dedup_key: str | None = None,
    scheduled_at: str | None = None,
    **options: Any,
) -> str:
    """An encoded kumiko message as ``build_message`` makes it and Dramatiq encodes it,
    enqueued at ENQUEUED_AT (``options`` replace some of its options)."""
    built = build_message(
        _APP.jobs[job],
        {"n": 1},
        queue_prefix="t",
        trigger=trigger,
        message_id=message_id,
        tenant_id=tenant,
        failures=failures,
        dedup_key=dedup_key,
        scheduled_at=None if scheduled_at is None else datetime.fromisoformat(scheduled_at),
        origin_id=origin,
    ).asdict()
    built["message_timestamp"] = ENQUEUED_AT
    built["options"] = {**built["options"], **options}
    return encoded(built)


class Z(dict[str, Any]):
    """A sorted set in a state table: member -> score (equal to a plain dict of the same; a
    score may be a :class:`DueIn`)."""


class DueIn:
    """A sorted-set score that is Redis's clock (this machine's) plus ``ms``, as a script
    that reads ``TIME`` wrote it just now."""

    def __init__(self, ms: int) -> None:
        self.ms = ms

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, int | float):
            return NotImplemented
        due = time.time() * 1000 + self.ms
        return due - TTL_SLACK - 1_000 < other <= due + 1_000

    def __repr__(self) -> str:
        return f"DueIn({self.ms})"


class JustNow:
    """A hash value holding Redis's clock in ms, written just now."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, str):
            return NotImplemented
        now = time.time() * 1000
        return other.isdigit() and now - TTL_SLACK - 1_000 < int(other) <= now + 1_000

    def __repr__(self) -> str:
        return "JustNow()"


class J(dict[str, Any]):
    """A JSON object kept as a string (a run record, a dead letter's note) in a state table:
    equal to any string that decodes to the same object (key order and spacing aside). Its
    string values may hold key templates (``{q}``, ``{w1}``): :meth:`Env.fill` fills them."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str | bytes):
            try:
                decoded = json.loads(other)
            except ValueError:
                return False
            return isinstance(decoded, dict) and decoded == dict(self)
        if isinstance(other, dict):
            return dict(self) == dict(other)
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        return not self == other

    def compact(self) -> str:
        """As Lua's cjson and kumiko's ``record_write`` write it (no spaces)."""
        return json.dumps(dict(self), separators=(",", ":"))

    def python(self) -> str:
        """As Python's ``json.dumps`` writes it by default (", " and ": ")."""
        return json.dumps(dict(self))


def record(
    message_id: str = "m1",
    attempt: int = 1,
    status: str = "completed",
    *,
    job: str = JOB,
    max_attempts: int = 3,
    **fields: Any,
) -> J:
    """A run record (short keys, see history.FIELDS); ``None`` fields are left out."""
    base: dict[str, Any] = {
        "j": job,
        "m": message_id,
        "o": message_id,
        "tr": "manual",
        "a": attempt,
        "ma": max_attempts,
        "s": status,
    }
    return J({k: v for k, v in {**base, **fields}.items() if v is not None})


def ended(message_id: str = "m1", attempt: int = 1, status: str = "completed", **fields: Any) -> J:
    """An end record as history.end_record makes it (settle adds "n" after a crash)."""
    times = {"q": ENQUEUED_AT, "st": STARTED_AT, "en": NOW, "d": NOW - STARTED_AT, "w": RUN_WORKER}
    return record(message_id, attempt, status, **{**times, **fields})


def died(
    message_id: str = "m1", attempt: int = 1, deliveries: int = MAX_DELIVERIES, **fields: Any
) -> J:
    """The "dead" record fetch_lane writes, from the message alone, for a message whose
    worker died ``deliveries`` times (no start, no duration)."""
    reason = f"worker died during {deliveries} deliveries"
    base = {"q": ENQUEUED_AT, "w": RUN_WORKER, "en": NOW, "et": "WorkerDied", "em": reason}
    return record(message_id, attempt, "dead", **{**base, "n": deliveries, **fields})


def died_note(rid: str, run: J) -> J:
    """The dead letter's note fetch_lane writes beside :func:`died`'s record."""
    fields = {k: run[k] for k in ("j", "m", "o", "t", "a", "ma", "et", "em") if k in run}
    return J({"r": rid, "q": QUEUE, **fields, "at": NOW})


def indexed(run: J, at: float) -> State:
    """``run`` as put_run leaves it: its field of the run hash and its index entries (job,
    status, its tenant's, its origin's when not its own id), scored ``at``."""
    message_id, attempt = run["m"], run["a"]
    member = f"{message_id}:{attempt}"
    state: State = {
        run_hash(message_id): {str(attempt): run},
        by_job(run["s"], run["j"]): Z({member: at}),
        by_status(run["s"]): Z({member: at}),
    }
    if "t" in run:
        state[by_tenant(run["t"])] = Z({member: at})
    if run["o"] != message_id:
        state[by_origin(run["o"])] = Z({member: at})
    return state


def merge(*states: State) -> State:
    """The union of state tables: hashes and sorted sets of the same key are merged."""
    out: State = {}
    for state in states:
        for key, value in state.items():
            old = out.get(key)
            if isinstance(old, Z) and isinstance(value, Z):
                out[key] = Z({**old, **value})
            elif type(old) is dict and type(value) is dict:
                out[key] = {**old, **value}
            else:
                out[key] = value
    return out


def header(
    message_id: str = "m1",
    attempt: int = 1,
    job: str = JOB,
    status: str = "completed",
    tenant: str = "",
    origin: str | None = None,
    *,
    cap: int = CAP,
    trim: int = 0,
) -> str:
    """settle's ARGV[5], the run record's header as the broker joins it (tab-separated):
    root, message id, attempt, job, status, tenant, origin, completed TTL, failed TTL, cap,
    trim budget. A template (ROOT): :meth:`Env.key` fills it."""
    fields = (
        ROOT,
        message_id,
        attempt,
        job,
        status,
        tenant,
        message_id if origin is None else origin,
        COMPLETED_TTL,
        FAILED_TTL,
        cap,
        trim,
    )
    return "\t".join(map(str, fields))


def header_of(run: J, *, cap: int = CAP, trim: int = 0) -> str:
    """The header of the record ``run`` (its own message id, attempt, job, ...)."""
    return header(
        run["m"], run["a"], run["j"], run["s"], run.get("t", ""), run["o"], cap=cap, trim=trim
    )


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
        return {self.key(key): self.fill_value(value) for key, value in state.items()}

    def fill_value(self, value: Any) -> Any:
        """The templates in the string values of a :class:`J` (also as a hash's value) filled."""
        if isinstance(value, J):
            return J(
                {k: v.format(**self.names) if isinstance(v, str) else v for k, v in value.items()}
            )
        if type(value) is dict:
            return {field: self.fill_value(item) for field, item in value.items()}
        return value

    def encode(self, value: J | str) -> str:
        """A script argument: a :class:`J` filled and written compact, a string as it is."""
        return value if isinstance(value, str) else self.fill_value(value).compact()

    def head(
        self, queue: str = QUEUE, worker: str = "w1", *, now: int = NOW, maintenance: bool = False
    ) -> list[Any]:
        """ARGV[1..2] of a broker command: the queue, then "<now> <worker id> <heartbeat
        timeout> <dead message TTL> <0|1 maintenance>"."""
        packed = f"{now} {self.names[worker]} {HEARTBEAT_TIMEOUT} {DEAD_TTL} {int(maintenance)}"
        return [self.key(queue), packed]

    def fetch_lane(
        self,
        count: int,
        held: int = 0,
        *,
        done_prefix: str = DONE_PREFIX,
        root: str = ROOT,
        worker: str = "w1",
        now: int = NOW,
        maintenance: bool = False,
    ) -> Any:
        """fetch_lane as the broker calls it (ARGV[3] "<N> <held> <max deliveries> <completed
        TTL> <failed TTL>", done prefix, root, host:pid); the reply decoded."""
        result = self.lua.fetch_lane(
            keys=[NAMESPACE, self.key(INFLIGHT), self.key(SUSPECTS)],
            args=[
                *self.head(worker=worker, now=now, maintenance=maintenance),
                f"{count} {held} {MAX_DELIVERIES} {COMPLETED_TTL} {FAILED_TTL}",
                self.key(done_prefix),
                self.key(root),
                RUN_WORKER,
            ],
        )
        return text(result)

    def settle(
        self,
        outcome: str,
        *,
        rid: str = "r1",
        run_header: str = "",
        run: J | str = "",
        note: J | str = "",
        retry: tuple[str, str, str] | None = None,
        marker_ttl: int = TTL,
        worker: str = "w1",
        now: int = NOW,
    ) -> Any:
        """settle (of r1, message m1) as the broker calls it: ARGV[3] the redis id, ARGV[4]
        "<outcome> <marker TTL>", ARGV[5] the record's header, ARGV[6] the record, ARGV[7]
        the dead note, ARGV[8..10] the retry (queue, redis id, body)."""
        args = [
            *self.head(worker=worker, now=now),
            rid,
            f"{outcome} {marker_ttl}",
            self.key(run_header),
            self.encode(run),
            self.encode(note),
        ]
        if retry is not None:
            args += [self.key(retry[0]), retry[1], retry[2]]
        return self.lua.settle(
            keys=[NAMESPACE, self.key(INFLIGHT), self.key(DONE_M1), self.key(SUSPECTS)], args=args
        )

    def seed(self, given: State) -> None:
        """Write ``given``; a :class:`J` is written as cjson writes it (no spaces)."""
        for template, raw in given.items():
            key = self.key(template)
            value = self.fill_value(raw)
            if isinstance(value, Z):
                self.client.zadd(key, dict(value))
            elif isinstance(value, J):
                self.client.set(key, value.compact())
            elif isinstance(value, dict):
                mapping = {f: v.compact() if isinstance(v, J) else v for f, v in value.items()}
                self.client.hset(key, mapping=mapping)
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
        """The WHOLE state is ``expected``, and every doorbell in it expires within
        :data:`BELL_TTL` (a token nobody takes never outlives its listeners by more)."""
        found = self.state()
        assert found == self.fill(expected)
        for key in found:
            if key.endswith(":bell"):
                actual = int(self.client.pttl(key))
                assert 0 < actual <= BELL_TTL, f"{key}: PTTL {actual}, expected (0, {BELL_TTL}]"

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

    def assert_expiry(self, expected: dict[str, int]) -> None:
        """The TTL of EVERY key of the state: each key of ``expected`` was set to that many ms
        just now (it must exist), every other key has none."""
        filled = {self.key(template): ttl for template, ttl in expected.items()}
        present = set(self.state())
        assert set(filled) <= present, f"no such keys: {sorted(set(filled) - present)}"
        for key in sorted(present):
            ttl = filled.get(key, NO_TTL)
            actual = int(self.client.pttl(key))
            if ttl == NO_TTL:
                assert actual == NO_TTL, f"{key}: PTTL {actual}, expected none"
            else:
                assert ttl - TTL_SLACK < actual <= ttl, f"{key}: PTTL {actual}, set to {ttl}"

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


# == the dispatch head ======================================================================
# Every broker command starts by parsing ARGV[2]; a head it cannot read is an error before
# anything is written (not even the heartbeat).
@pytest.mark.parametrize(
    "packed",
    [
        pytest.param(f"{NOW} w {HEARTBEAT_TIMEOUT} {DEAD_TTL}", id="a-field-missing"),
        pytest.param(f"{NOW} w {HEARTBEAT_TIMEOUT} {DEAD_TTL} 2", id="maintenance-not-0-or-1"),
        pytest.param(f"-{NOW} w {HEARTBEAT_TIMEOUT} {DEAD_TTL} 0", id="negative-now"),
        pytest.param(str(NOW), id="the-old-unpacked-head"),
    ],
)
def test_a_malformed_dispatch_head_is_refused(env: Env, packed: str) -> None:
    with pytest.raises(redis.ResponseError, match="malformed dispatch head"):
        env.lua.enqueue(keys=[NAMESPACE], args=[env.key(QUEUE), packed, "r1", "body"])

    env.assert_state({})


# == enqueue ================================================================================
# Dramatiq's own enqueue command: no marker (kumiko's idempotent enqueue of a new message is
# guarded_enqueue behind its "sent" marker, see test_guarded_enqueue). It rings the queue's
# doorbell, as every write of a message does (enqueue_message in lua/_enqueue.lua).
@pytest.mark.parametrize(
    ("given", "queue", "after"),
    [
        pytest.param(
            {},
            QUEUE,
            {LIST: ["r1"], MSGS: {"r1": "body"}, BELL: ["1"]},
            id="writes-hash-and-list-and-rings",
        ),
        pytest.param(
            {LIST: ["r0"], MSGS: {"r0": "b0"}},
            QUEUE,
            {LIST: ["r0", "r1"], MSGS: {"r0": "b0", "r1": "body"}, BELL: ["1"]},
            id="appends-to-the-tail",
        ),
        pytest.param(
            {},
            DQ,
            {DQ_LIST: ["r1"], DQ_MSGS: {"r1": "body"}, DQ_BELL: ["1"]},
            id="delay-queue-rings-its-own-bell",
        ),
    ],
)
def test_enqueue(env: Env, given: State, queue: str, after: State) -> None:
    env.seed(given)

    assert env.lua.enqueue(keys=[NAMESPACE], args=[*env.head(queue), "r1", "body"]) == 1

    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


# == the doorbell (lua/_bell.lua, rung here by enqueue) =====================================
# One token at most, however many writes: a token is pushed, with its TTL, only when none
# waits; a waiting token is left as it is (its TTL not refreshed).
@pytest.mark.parametrize(
    ("waiting", "enqueues", "ttl"),
    [
        pytest.param(False, 1, BELL_TTL, id="an-enqueue-leaves-one-token-for-a-minute"),
        pytest.param(False, 3, BELL_TTL, id="many-enqueues-leave-one-token"),
        pytest.param(True, 2, SHORT_TTL, id="a-waiting-token-gets-no-second-and-keeps-its-ttl"),
    ],
)
def test_the_bell_holds_one_token_at_most(env: Env, waiting: bool, enqueues: int, ttl: int) -> None:
    # Given: a token left SHORT_TTL to live waits, or none does
    if waiting:
        env.seed({BELL: ["1"]})
        env.expire(BELL, SHORT_TTL)
    rids = [f"r{n}" for n in range(1, enqueues + 1)]

    for rid in rids:
        assert env.lua.enqueue(keys=[NAMESPACE], args=[*env.head(), rid, "body"]) == 1

    env.assert_state({LIST: rids, MSGS: dict.fromkeys(rids, "body"), BELL: ["1"]})
    env.assert_ttls({BELL: ttl})


def test_a_taken_token_is_rung_again_by_the_next_enqueue(env: Env) -> None:
    # Given: r1 was enqueued and an idle consumer took the token (its BLPOP)
    assert env.lua.enqueue(keys=[NAMESPACE], args=[*env.head(), "r1", "body"]) == 1
    assert env.client.lpop(env.key(BELL)) == b"1"
    env.assert_state({LIST: ["r1"], MSGS: {"r1": "body"}})

    # When: r2 is enqueued
    assert env.lua.enqueue(keys=[NAMESPACE], args=[*env.head(), "r2", "body"]) == 1

    # Then: a new token waits, for a minute again
    env.assert_state({LIST: ["r1", "r2"], MSGS: {"r1": "body", "r2": "body"}, BELL: ["1"]})
    env.assert_ttls({BELL: BELL_TTL})


# == fetch ==================================================================================
# Dramatiq's own fetch: pops and claims, checks nothing (kumiko's lane queues use
# fetch_lane). Its reply is flat: rid, body, rid, body, ... A full batch (N) that leaves
# messages on the queue rings its doorbell for the next idle consumer; a fetch that takes
# fewer than N, or empties the queue, does not.
@pytest.mark.parametrize(
    ("given", "count", "reply", "after"),
    [
        pytest.param({}, 3, [], {}, id="empty-queue"),
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r1": "b1", "r2": "b2"}},
            3,
            ["r1", "b1", "r2", "b2"],
            {MSGS: {"r1": "b1", "r2": "b2"}, ACKS: {"r1", "r2"}},
            id="fewer-than-n-does-not-ring",
        ),
        pytest.param(
            {LIST: ["r1", "r2", "r3"], MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"}},
            2,
            ["r1", "b1", "r2", "b2"],
            {
                LIST: ["r3"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                ACKS: {"r1", "r2"},
                BELL: ["1"],
            },
            id="exactly-n-leftover-stays-and-rings",
        ),
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r1": "b1", "r2": "b2"}},
            2,
            ["r1", "b1", "r2", "b2"],
            {MSGS: {"r1": "b1", "r2": "b2"}, ACKS: {"r1", "r2"}},
            id="exactly-n-emptying-the-queue-does-not-ring",
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
            {LIST: ["r1"], MSGS: {"r1": "b1"}, BELL: ["1"]},
            id="zero-fetches-nothing-a-full-batch-of-0-with-messages-left-rings",
        ),
        pytest.param(
            {LIST: ["r1"], MSGS: {"r1": "b1"}},
            1,
            ["r1", "b1"],
            {MSGS: {"r1": "b1"}, ACKS: {"r1"}},
            id="no-in-flight-entry-for-dramatiqs-own-queues",
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

    # Then: r1 went back to the tail (r0 was fetched first) and the bell rang, r2 is
    # forgotten, the ack set is gone and w0, with no ack set left anywhere, left the heartbeats
    assert text(result) == ["r0", "b0"]
    env.assert_state({LIST: ["r1"], MSGS: {"r0": "b0", "r1": "b1"}, ACKS: {"r0"}, BELL: ["1"]})
    assert env.heartbeat("w0") is None
    assert env.heartbeat("w1") == NOW


def test_fetch_maintenance_keeps_a_dead_worker_with_another_queues_ack_set(env: Env) -> None:
    env.client.zadd(HEARTBEATS, {env.names["w0"]: DEAD_AT})
    env.seed({MSGS: {"r1": "b1"}, DEAD_ACKS: {"r1"}, DEAD_ACKS_OTHER: {"x1"}})

    result = env.lua.fetch(keys=[NAMESPACE], args=[*env.head(maintenance=True), 0])

    # Then: this queue's claims are recovered; the other queue's ack set (and w0) stay
    assert text(result) == []
    env.assert_state({LIST: ["r1"], MSGS: {"r1": "b1"}, DEAD_ACKS_OTHER: {"x1"}, BELL: ["1"]})
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


# Maintenance rings the queue's doorbell iff a dead worker's message went back (once, however
# many did). These rows run it through ack (of an id nobody holds), which rings nothing of
# its own, unlike fetch. Dead workers are recovered oldest heartbeat first.
@pytest.mark.parametrize(
    ("heartbeats", "queue", "given", "after"),
    [
        pytest.param(
            {"w0": DEAD_AT, "w2": DEAD_AT + 1},
            QUEUE,
            {MSGS: {"r1": "b1", "r2": "b2"}, DEAD_ACKS: {"r1"}, ACKS_W2: {"r2"}},
            {LIST: ["r1", "r2"], MSGS: {"r1": "b1", "r2": "b2"}, BELL: ["1"]},
            id="two-dead-workers-messages-went-back-one-token",
        ),
        pytest.param(
            {"w0": DEAD_AT},
            DQ,
            {DQ_MSGS: {"d1": "bd"}, DEAD_DQ_ACKS: {"d1"}},
            {DQ_LIST: ["d1"], DQ_MSGS: {"d1": "bd"}, DQ_BELL: ["1"]},
            id="a-delay-queues-message-went-back-its-bell-rings",
        ),
        pytest.param(
            {"w0": DEAD_AT},
            QUEUE,
            {DEAD_ACKS: {"r1", "r2"}},
            {},
            id="only-bodyless-claims-nothing-went-back-no-ring",
        ),
        pytest.param(
            {"w0": ALIVE_AT},
            QUEUE,
            {MSGS: {"r1": "b1"}, DEAD_ACKS: {"r1"}},
            {MSGS: {"r1": "b1"}, DEAD_ACKS: {"r1"}},
            id="a-live-workers-claims-stay-no-ring",
        ),
    ],
)
def test_maintenance_rings_only_when_a_message_went_back(
    env: Env, heartbeats: dict[str, int], queue: str, given: State, after: State
) -> None:
    env.client.zadd(HEARTBEATS, {env.names[worker]: at for worker, at in heartbeats.items()})
    env.seed(given)

    assert env.lua.ack(keys=[NAMESPACE], args=[*env.head(queue, maintenance=True), "r9"]) == 0

    env.assert_state(after)
    env.assert_ttls({key: BELL_TTL for key in after if key.endswith(":bell")})


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
# Each claim joins the ack set and puts "<deliveries + 1>|<now>|<host:pid>" in the in-flight
# hash; no run record is written (running runs are read off that hash). A "suspect" is an id
# with an in-flight entry already (its worker died while holding it); "held" is the messages
# the consumer holds (0 = idle). A paused job's message is parked, not claimed. The queue's
# doorbell rings when a full batch (N) left messages on the queue, or when a consumer that
# holds messages leaves a suspect waiting. These rows use messages that are not kumiko's (no
# run record): see test_fetch_lane_run_history.
PAUSED_JOB = {PAUSED: {JOB}}


@pytest.mark.parametrize(
    ("given", "count", "done_prefix", "held", "reply", "after"),
    [
        pytest.param({}, 3, "", 0, [[], [], [], 0, 0], {}, id="empty-queue"),
        # -- plain claims
        pytest.param(
            {
                LIST: ["r1", "r2", "r3"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                INFLIGHT: {"r9": earlier(1)},
            },
            2,
            "",
            0,
            [["r1", "b1", "r2", "b2"], [], [], 0, 0],
            {
                LIST: ["r3"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                ACKS: {"r1", "r2"},
                INFLIGHT: {"r1": entry(1), "r2": entry(1), "r9": earlier(1)},
                BELL: ["1"],
            },
            id="claims-n-each-gets-an-in-flight-entry-leftover-stays-and-rings",
        ),
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r1": "b1", "r2": "b2"}},
            2,
            "",
            0,
            [["r1", "b1", "r2", "b2"], [], [], 0, 0],
            {
                MSGS: {"r1": "b1", "r2": "b2"},
                ACKS: {"r1", "r2"},
                INFLIGHT: {"r1": entry(1), "r2": entry(1)},
            },
            id="claims-n-emptying-the-queue-does-not-ring",
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
                INFLIGHT: {"r1": entry(1)},
                BELL: ["1"],
            },
            id="n-counts-messages-not-reply-entries",
        ),
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r2": "b2"}},
            3,
            "",
            0,
            [["r1", None, "r2", "b2"], [], [], 0, 0],
            {MSGS: {"r2": "b2"}, ACKS: {"r1", "r2"}, INFLIGHT: {"r1": entry(1), "r2": entry(1)}},
            id="fewer-than-n-vanished-body-is-none-and-still-claimed-no-ring",
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
                INFLIGHT: {"r2": entry(1), "r3": entry(1)},
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
                INFLIGHT: {"r1": entry(1)},
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
            {ACKS: {"r1"}, INFLIGHT: {"r1": entry(1)}, DONE_M1: "1"},
            id="vanished-body-with-prefix-is-still-returned",
        ),
        pytest.param(
            {LIST: ["r1"], MSGS: {"r1": "not json {"}},
            1,
            DONE_PREFIX,
            0,
            [["r1", "not json {"], [], [], 0, 0],
            {MSGS: {"r1": "not json {"}, ACKS: {"r1"}, INFLIGHT: {"r1": entry(1)}},
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
                INFLIGHT: {"r1": entry(1), "r2": entry(1)},
            },
            id="json-without-a-string-message-id-is-returned",
        ),
        pytest.param(
            {LIST: ["r1"], MSGS: {"r1": json.dumps({"message_id": "m1"})}, DONE_M1: "1"},
            1,
            DONE_PREFIX,
            0,
            [["r1", json.dumps({"message_id": "m1"})], [], [], 0, 0],
            {
                MSGS: {"r1": json.dumps({"message_id": "m1"})},
                ACKS: {"r1"},
                INFLIGHT: {"r1": entry(1)},
                DONE_M1: "1",
            },
            id="a-body-not-laid-out-as-dramatiq-encodes-is-not-checked-for-its-marker",
        ),
        # -- suspects while the consumer holds messages: set aside (the bell rings for an
        # idle consumer), healthy ones still come
        pytest.param(
            {
                LIST: ["r1", "r2", "r3", "r4"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3", "r4": "b4"},
                INFLIGHT: {"r1": earlier(1), "r3": earlier(2)},
            },
            2,
            "",
            1,
            [["r2", "b2", "r4", "b4"], [], [], 2, 0],
            {
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3", "r4": "b4"},
                ACKS: {"r2", "r4"},
                INFLIGHT: {"r1": earlier(1), "r2": entry(1), "r3": earlier(2), "r4": entry(1)},
                SUSPECTS: ["r1", "r3"],
                BELL: ["1"],
            },
            id="holding-suspects-go-to-the-suspects-list-loop-goes-on",
        ),
        pytest.param(
            {LIST: ["r1"], MSGS: {"r1": "b1"}, INFLIGHT: {"r1": earlier(1)}},
            2,
            "",
            1,
            [[], [], [], 1, 0],
            {MSGS: {"r1": "b1"}, INFLIGHT: {"r1": earlier(1)}, SUSPECTS: ["r1"], BELL: ["1"]},
            id="holding-a-suspect-left-waiting-rings-though-nothing-was-claimed",
        ),
        pytest.param(
            {
                LIST: ["r1"],
                MSGS: {"r1": "b1", "r2": "b2"},
                INFLIGHT: {"r2": earlier(MAX_DELIVERIES)},
                SUSPECTS: ["r2"],
            },
            2,
            "",
            1,
            [["r1", "b1"], [], [], 1, 0],
            {
                MSGS: {"r1": "b1", "r2": "b2"},
                ACKS: {"r1"},
                INFLIGHT: {"r1": entry(1), "r2": earlier(MAX_DELIVERIES)},
                SUSPECTS: ["r2"],
                BELL: ["1"],
            },
            id="holding-the-suspects-list-is-not-touched-a-waiting-suspect-rings",
        ),
        # -- idle (held = 0): one suspect runs alone, its deliveries counted on; messages it
        # leaves behind a suspect run alone ring the bell for other consumers
        pytest.param(
            {
                LIST: ["r1"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                INFLIGHT: {"r2": earlier(1), "r3": earlier(2)},
                SUSPECTS: ["r2", "r3"],
            },
            3,
            "",
            0,
            [["r2", "b2"], [], [], 1, 1],
            {
                LIST: ["r1"],
                BELL: ["1"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                ACKS: {"r2"},
                INFLIGHT: {"r2": entry(2), "r3": earlier(2)},
                SUSPECTS: ["r3"],
            },
            id="idle-first-suspect-of-the-list-claimed-alone-by-this-worker",
        ),
        pytest.param(
            {
                LIST: ["r2", "r1"],
                MSGS: {"r1": "b1", "r2": "b2"},
                INFLIGHT: {"r2": earlier(MAX_DELIVERIES - 1)},
            },
            3,
            "",
            0,
            [["r2", "b2"], [], [], 0, 1],
            {
                LIST: ["r1"],
                BELL: ["1"],
                MSGS: {"r1": "b1", "r2": "b2"},
                ACKS: {"r2"},
                INFLIGHT: {"r2": entry(MAX_DELIVERIES)},
            },
            id="idle-no-suspects-waiting-suspect-popped-first-claimed-alone",
        ),
        pytest.param(
            {
                LIST: ["r1", "r2", "r3"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                INFLIGHT: {"r2": earlier(1)},
            },
            3,
            "",
            0,
            [["r1", "b1", "r3", "b3"], [], [], 1, 0],
            {
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                ACKS: {"r1", "r3"},
                INFLIGHT: {"r1": entry(1), "r2": earlier(1), "r3": entry(1)},
                SUSPECTS: ["r2"],
            },
            id="idle-suspect-after-a-healthy-claim-is-set-aside",
        ),
        pytest.param(
            {
                LIST: ["r2"],
                MSGS: {"r1": message("m1"), "r2": message("m2"), "r3": message("m3")},
                INFLIGHT: {"r1": earlier(1), "r3": earlier(1)},
                SUSPECTS: ["r1", "r3"],
                DONE_M1: "1",
            },
            2,
            DONE_PREFIX,
            0,
            [["r3", message("m3")], ["m1"], [], 0, 1],
            {
                LIST: ["r2"],
                BELL: ["1"],
                MSGS: {"r2": message("m2"), "r3": message("m3")},
                ACKS: {"r3"},
                INFLIGHT: {"r3": entry(2)},
                DONE_M1: "1",
            },
            id="idle-completed-suspect-is-acked-its-entry-dropped-and-the-next-runs-alone",
        ),
        # -- poison messages: dead-lettered at the max deliveries, their entry dropped
        pytest.param(
            {
                LIST: ["r1", "r2"],
                MSGS: {"r1": "b1", "r2": "b2"},
                INFLIGHT: {"r1": earlier(MAX_DELIVERIES)},
            },
            2,
            "",
            0,
            [["r2", "b2"], [], ["r1", MAX_DELIVERIES], 0, 0],
            {
                MSGS: {"r2": "b2"},
                ACKS: {"r2"},
                INFLIGHT: {"r2": entry(1)},
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": "b1"},
            },
            id="at-max-from-the-main-list-dead-lettered",
        ),
        pytest.param(
            {
                LIST: ["r1", "r2"],
                MSGS: {"r1": "b1", "r2": "b2"},
                INFLIGHT: {"r1": earlier(MAX_DELIVERIES + 2)},
            },
            2,
            "",
            1,
            [["r2", "b2"], [], ["r1", MAX_DELIVERIES + 2], 0, 0],
            {
                MSGS: {"r2": "b2"},
                ACKS: {"r2"},
                INFLIGHT: {"r2": entry(1)},
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": "b1"},
            },
            id="above-max-while-holding-dead-lettered",
        ),
        pytest.param(
            {
                LIST: ["r3"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                INFLIGHT: {"r1": earlier(MAX_DELIVERIES), "r2": earlier(1)},
                SUSPECTS: ["r1", "r2"],
            },
            2,
            "",
            0,
            [["r2", "b2"], [], ["r1", MAX_DELIVERIES], 0, 1],
            {
                LIST: ["r3"],
                BELL: ["1"],
                MSGS: {"r2": "b2", "r3": "b3"},
                ACKS: {"r2"},
                INFLIGHT: {"r2": entry(2)},
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": "b1"},
            },
            id="at-max-from-the-suspects-list-dead-lettered-next-runs-alone",
        ),
        pytest.param(
            {LIST: ["r1"], INFLIGHT: {"r1": earlier(MAX_DELIVERIES)}},
            1,
            "",
            0,
            [[], [], ["r1", MAX_DELIVERIES], 0, 0],
            {},
            id="at-max-with-a-vanished-body-entry-still-dropped",
        ),
        # -- paused jobs: their messages are parked (in order), never claimed or counted
        pytest.param(
            {
                **PAUSED_JOB,
                LIST: ["r1", "r2", "r3"],
                MSGS: {"r1": message("m1", JOB), "r2": message("m2"), "r3": message("m3", JOB)},
            },
            1,
            "",
            0,
            [["r2", message("m2")], [], [], 0, 0],
            {
                **PAUSED_JOB,
                PARKED: ["r1"],
                LIST: ["r3"],
                MSGS: {"r1": message("m1", JOB), "r2": message("m2"), "r3": message("m3", JOB)},
                ACKS: {"r2"},
                INFLIGHT: {"r2": entry(1)},
                BELL: ["1"],
            },
            id="paused-jobs-message-is-parked-not-claimed-not-counted-in-n",
        ),
        pytest.param(
            {
                **PAUSED_JOB,
                PARKED: ["r0"],
                LIST: ["r1"],
                MSGS: {"r0": message("m0", JOB), "r1": message("m1", f"{JOB}:fanout")},
            },
            1,
            "",
            0,
            [[], [], [], 0, 0],
            {
                **PAUSED_JOB,
                PARKED: ["r0", "r1"],
                MSGS: {"r0": message("m0", JOB), "r1": message("m1", f"{JOB}:fanout")},
            },
            id="paused-jobs-fan-out-wrapper-is-parked-behind-its-job",
        ),
        pytest.param(
            {
                **PAUSED_JOB,
                LIST: ["r2"],
                MSGS: {"r1": message("m1", JOB), "r2": message("m2")},
                INFLIGHT: {"r1": earlier(1)},
                SUSPECTS: ["r1"],
            },
            2,
            "",
            0,
            [["r2", message("m2")], [], [], 0, 0],
            {
                **PAUSED_JOB,
                PARKED: ["r1"],
                MSGS: {"r1": message("m1", JOB), "r2": message("m2")},
                ACKS: {"r2"},
                INFLIGHT: {"r1": earlier(1), "r2": entry(1)},
            },
            id="paused-suspect-is-parked-keeping-its-count-next-is-claimed-normally",
        ),
        pytest.param(
            {
                **PAUSED_JOB,
                LIST: ["r1"],
                MSGS: {"r1": message("m1", JOB)},
                INFLIGHT: {"r1": earlier(MAX_DELIVERIES)},
            },
            1,
            "",
            0,
            [[], [], ["r1", MAX_DELIVERIES], 0, 0],
            {**PAUSED_JOB, XQ: Z({"r1": NOW}), XQ_MSGS: {"r1": message("m1", JOB)}},
            id="paused-jobs-poison-message-is-dead-lettered-not-parked",
        ),
        # -- ids cancel withdrew (body deleted): dropped without a word, out of their set
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r2": "b2"}, WITHDRAWN: {"r1", "r9"}},
            2,
            "",
            0,
            [["r2", "b2"], [], [], 0, 0],
            {MSGS: {"r2": "b2"}, ACKS: {"r2"}, INFLIGHT: {"r2": entry(1)}, WITHDRAWN: {"r9"}},
            id="withdrawn-id-dropped-and-forgotten-the-next-claimed",
        ),
        pytest.param(
            {SUSPECTS: ["r1"], LIST: ["r2"], MSGS: {"r2": "b2"}, WITHDRAWN: {"r1"}},
            2,
            "",
            0,
            [["r2", "b2"], [], [], 0, 0],
            {MSGS: {"r2": "b2"}, ACKS: {"r2"}, INFLIGHT: {"r2": entry(1)}},
            id="withdrawn-suspect-dropped-and-the-queue-claimed-as-usual",
        ),
        pytest.param(
            {**PAUSED_JOB, LIST: ["r1"], PARKED_WITHDRAWN: {"r1", "r9"}},
            1,
            "",
            0,
            [[], [], [], 0, 0],
            {**PAUSED_JOB, PARKED_WITHDRAWN: {"r9"}},
            id="withdrawn-id-of-a-paused-job-met-before-it-was-parked-is-dropped",
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

    assert env.fetch_lane(count, held, done_prefix=done_prefix) == reply

    env.assert_state(after)
    env.assert_expiry({BELL: BELL_TTL} if BELL in after else {})  # the bell was rung just now
    assert env.heartbeat("w1") == NOW


def test_fetch_lane_maintenance_recovers_a_dead_workers_message_as_a_suspect(env: Env) -> None:
    # Given: dead w0 held r1 (delivered once); r0 waits on the queue
    env.client.zadd(HEARTBEATS, {env.names["w0"]: DEAD_AT})
    env.seed(
        {
            LIST: ["r0"],
            MSGS: {"r0": "b0", "r1": "b1"},
            DEAD_ACKS: {"r1"},
            INFLIGHT: {"r1": earlier(1)},
        }
    )

    # When: idle w1 fetches two with maintenance
    result = env.fetch_lane(2, 0, done_prefix="", maintenance=True)

    # Then: r1 came back behind r0 (the bell rang); r0 was claimed, so r1 waits in the
    # suspects list, its entry (the dead worker's delivery) untouched
    assert result == [["r0", "b0"], [], [], 1, 0]
    env.assert_state(
        {
            MSGS: {"r0": "b0", "r1": "b1"},
            ACKS: {"r0"},
            INFLIGHT: {"r0": entry(1), "r1": earlier(1)},
            SUSPECTS: ["r1"],
            BELL: ["1"],
        }
    )
    assert env.heartbeat("w0") is None


# -- fetch_lane and the run history: a claim writes no record; a message dead-lettered at the
# max deliveries gets a "dead" record read off its body ("worker died during N deliveries"),
# kept the failed TTL, and a dead letter's note kept as long as dead letters.
KUMIKO_M2 = kumiko_message(
    "m2",
    job=TENANT_JOB,
    trigger="cron",
    failures=1,
    tenant="acme",
    origin="o1",
    dedup_key="k1",
    scheduled_at=TICK_AT,
)
DIED_M2 = died(
    "m2",
    2,
    job=TENANT_JOB,
    max_attempts=2,
    o="o1",
    t="acme",
    tr="cron",
    sa=TICK_AT,
    dk="k1",
)


@pytest.mark.parametrize(
    ("given", "root", "reply", "after", "expiry"),
    [
        pytest.param(
            {LIST: ["r1"], MSGS: {"r1": kumiko_message("m1")}},
            ROOT,
            [["r1", kumiko_message("m1")], [], [], 0, 0],
            {MSGS: {"r1": kumiko_message("m1")}, ACKS: {"r1"}, INFLIGHT: {"r1": entry(1)}},
            {},
            id="a-claim-writes-no-record-running-runs-live-in-the-in-flight-hash",
        ),
        pytest.param(
            {
                LIST: ["r1"],
                MSGS: {"r1": kumiko_message("m1")},
                INFLIGHT: {"r1": earlier(MAX_DELIVERIES)},
            },
            ROOT,
            [[], [], ["r1", MAX_DELIVERIES], 0, 0],
            {
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": kumiko_message("m1")},
                **indexed(died(), NOW),
                dead_note("m1"): died_note("r1", died()),
            },
            {run_hash("m1"): FAILED_TTL, dead_note("m1"): DEAD_TTL},
            id="at-max-dead-record-and-note-read-off-the-message",
        ),
        pytest.param(
            {LIST: ["r2"], MSGS: {"r2": KUMIKO_M2}, INFLIGHT: {"r2": earlier(MAX_DELIVERIES)}},
            ROOT,
            [[], [], ["r2", MAX_DELIVERIES], 0, 0],
            {
                XQ: Z({"r2": NOW}),
                XQ_MSGS: {"r2": KUMIKO_M2},
                **indexed(DIED_M2, NOW),
                dead_note("m2"): died_note("r2", DIED_M2),
            },
            {
                run_hash("m2"): FAILED_TTL,
                by_tenant("acme"): LONG_TTL,
                by_origin("o1"): LONG_TTL,
                dead_note("m2"): DEAD_TTL,
            },
            id="at-max-a-tenants-second-attempt-keeps-tenant-origin-schedule-and-key",
        ),
        pytest.param(
            {
                LIST: ["r1", "r2"],
                MSGS: {"r1": kumiko_message("m1"), "r2": kumiko_message("m2")},
                INFLIGHT: {"r2": earlier(MAX_DELIVERIES)},
            },
            "",
            [["r1", kumiko_message("m1")], [], ["r2", MAX_DELIVERIES], 0, 0],
            {
                MSGS: {"r1": kumiko_message("m1")},
                ACKS: {"r1"},
                INFLIGHT: {"r1": entry(1)},
                XQ: Z({"r2": NOW}),
                XQ_MSGS: {"r2": kumiko_message("m2")},
            },
            {},
            id="no-history-root-no-record-and-no-note",
        ),
    ],
)
def test_fetch_lane_run_history(
    env: Env, given: State, root: str, reply: list[Any], after: State, expiry: dict[str, int]
) -> None:
    env.seed(given)

    assert env.fetch_lane(2, 0, root=root) == reply

    env.assert_state(after)
    env.assert_expiry(expiry)


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
            {MSGS: {"r1": "b1"}, ACKS: {"r1"}, DONE_M1: "1", INFLIGHT: {"r1": entry(1)}},
            1,
            {DONE_M1: "1", INFLIGHT: {"r1": entry(1)}},
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
# A call for a delivery of w1's removes r1's in-flight entry (r2's stays); one no longer w1's
# (w2 holds r1) leaves the entry, w2's now, as it was; "completed" writes the marker even
# when the delivery is no longer this worker's; an enqueued retry rings its queue's doorbell.
# These rows write no run record (header ""): see test_settle_writes_the_run_record.
R2_ENTRY = {"r2": earlier(1)}
SETTLE_OWNED: State = {
    MSGS: {"r1": "b1", "r0": "b0"},
    ACKS: {"r1"},
    INFLIGHT: {"r1": entry(1), **R2_ENTRY},
}
SETTLE_FOREIGN: State = {
    MSGS: {"r1": "b1"},
    ACKS_W2: {"r1"},
    INFLIGHT: {"r1": entry(2), **R2_ENTRY},
}


@pytest.mark.parametrize(
    ("given", "outcome", "retry_queue", "reply", "after", "expiry"),
    [
        pytest.param(
            SETTLE_OWNED,
            "ack",
            None,
            1,
            {MSGS: {"r0": "b0"}, INFLIGHT: R2_ENTRY},
            {},
            id="ack-owned",
        ),
        pytest.param(
            SETTLE_FOREIGN,
            "ack",
            None,
            0,
            SETTLE_FOREIGN,
            {},
            id="ack-not-owned-changes-nothing",
        ),
        pytest.param(
            {MSGS: {"r1": "b1"}, ACKS: {"r1"}},
            "ack",
            None,
            1,
            {},
            {},
            id="ack-without-an-entry",
        ),
        pytest.param(
            SETTLE_OWNED,
            "completed",
            None,
            1,
            {MSGS: {"r0": "b0"}, INFLIGHT: R2_ENTRY, DONE_M1: "1"},
            {DONE_M1: TTL},
            id="completed-owned-sets-the-marker",
        ),
        pytest.param(
            SETTLE_FOREIGN,
            "completed",
            None,
            0,
            {**SETTLE_FOREIGN, DONE_M1: "1"},
            {DONE_M1: TTL},
            id="completed-not-owned-still-sets-the-marker",
        ),
        pytest.param(
            SETTLE_OWNED,
            "retry",
            QUEUE,
            1,
            {LIST: ["r3"], MSGS: {"r0": "b0", "r3": "retry"}, INFLIGHT: R2_ENTRY, BELL: ["1"]},
            {BELL: BELL_TTL},
            id="retry-owned-on-the-queue-rings",
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
                INFLIGHT: R2_ENTRY,
                DQ_BELL: ["1"],
            },
            {DQ_BELL: BELL_TTL},
            id="retry-owned-on-the-delay-queue-rings-its-bell",
        ),
        pytest.param(
            SETTLE_FOREIGN,
            "retry",
            QUEUE,
            0,
            SETTLE_FOREIGN,
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
                INFLIGHT: R2_ENTRY,
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": "b1"},
            },
            {},
            id="dead-owned-dead-letters",
        ),
        pytest.param(
            {ACKS: {"r1"}, INFLIGHT: {"r1": entry(1)}},
            "dead",
            None,
            1,
            {},
            {},
            id="dead-owned-without-body-drops-the-claim-and-the-entry",
        ),
        pytest.param(
            SETTLE_FOREIGN,
            "dead",
            None,
            0,
            SETTLE_FOREIGN,
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
    expiry: dict[str, int],
) -> None:
    env.seed(given)
    retry = None if retry_queue is None else (retry_queue, "r3", "retry")

    assert env.settle(outcome, retry=retry) == reply

    env.assert_state(after)
    env.assert_expiry(expiry)
    assert env.heartbeat("w1") == NOW


def test_settle_retry_sent_twice_enqueues_once(env: Env) -> None:
    # Given: r1 claimed by w1
    env.seed({MSGS: {"r1": "b1"}, ACKS: {"r1"}, INFLIGHT: {"r1": entry(1)}})

    # When: the same settle is sent twice (a command re-sent after a dropped connection)
    first = env.settle("retry", retry=(QUEUE, "r3", "retry"))
    second = env.settle("retry", retry=(QUEUE, "r3", "retry"))

    # Then: the retry is there once (its bell holds one token)
    assert (first, second) == (1, 0)
    env.assert_state({LIST: ["r3"], MSGS: {"r3": "retry"}, BELL: ["1"]})


@pytest.mark.parametrize(
    ("outcome", "marker_ttl", "run_header"),
    [
        pytest.param("completed", 0, "", id="completed-marker-ttl-0"),
        pytest.param("completed", 2**48 + 1, "", id="completed-marker-ttl-beyond-2-48"),
        pytest.param(
            "ack",
            TTL,
            header().replace(str(COMPLETED_TTL), "0"),
            id="completed-record-ttl-0",
        ),
        pytest.param(
            "ack",
            TTL,
            header().replace(str(FAILED_TTL), "-5"),
            id="failed-record-ttl-negative-header-unreadable",
        ),
    ],
)
def test_settle_refuses_a_bad_ttl_before_writing(
    env: Env, outcome: str, marker_ttl: int, run_header: str
) -> None:
    given: State = {MSGS: {"r1": kumiko_message("m1")}, ACKS: {"r1"}, INFLIGHT: {"r1": entry(1)}}
    env.seed(given)

    with pytest.raises(redis.ResponseError, match="TTL must be an integer"):
        env.settle(outcome, marker_ttl=marker_ttl, run_header=run_header, run=ended())

    env.assert_state(given)


# -- settle and the run history: the record (ARGV[6], its header ARGV[5]) is written on every
# outcome, owned or not; a delivery still this worker's adds "n" = the deliveries of its
# entry when more than one (another worker's entry is left as it was, unread); its hash
# lives its status TTL (at least the failed TTL after the first attempt), its tenant and
# origin indexes the longer TTL; a "dead" outcome that moves the message also writes the
# dead letter's note (ARGV[7], kept as long as dead letters). Status "" (a sequential
# hand-off) writes no record; "malformed" reads the record off the body.
SETTLE_M1: State = {MSGS: {"r1": kumiko_message("m1")}, ACKS: {"r1"}, INFLIGHT: {"r1": entry(1)}}
FAILED_M1 = ended(status="failed", et="ValueError", em="boom", tb="Traceback ...")
DEAD_M1 = ended(status="dead", et="ValueError", em="boom", tb="Traceback ...")
#: The dead letter's note as history.end_record writes it (Python's json.dumps).
DEAD_NOTE_M1 = J(
    {
        "r": "r1",
        "q": QUEUE,
        "j": JOB,
        "m": "m1",
        "o": "m1",
        "t": None,
        "a": 1,
        "ma": 3,
        "et": "ValueError",
        "em": "boom",
        "tb": "Traceback ...",
        "at": NOW,
    }
)
TENANT_RUN = ended(job=TENANT_JOB, max_attempts=2, t="acme", o="o1")
SECOND_ATTEMPT = ended(attempt=2)
#: What settle writes for a message dead-lettered unrun (malformed): its record read off the
#: message, the reason from ARGV[6].
MALFORMED_M1 = record(
    "m1",
    1,
    "dead",
    q=ENQUEUED_AT,
    w=RUN_WORKER,
    en=NOW,
    et="MalformedMessage",
    em="no such actor",
    n=2,
)
#: The entry of w2, which took r1 over: its third delivery (w1's settle must not count it).
W2_ENTRY = entry(3, NOW - 1_000, OTHER_RUN_WORKER)


@pytest.mark.parametrize(
    ("given", "outcome", "run_header", "run", "note", "retry", "reply", "after", "expiry"),
    [
        pytest.param(
            SETTLE_M1,
            "completed",
            header_of(ended()),
            ended(),
            "",
            None,
            1,
            {DONE_M1: "1", **indexed(ended(), NOW)},
            {DONE_M1: TTL, run_hash("m1"): COMPLETED_TTL},
            id="completed-record-indexed-with-the-completed-ttl",
        ),
        pytest.param(
            SETTLE_M1,
            "retry",
            header_of(FAILED_M1),
            FAILED_M1,
            "",
            (DQ, "r3", "retry"),
            1,
            {
                DQ_LIST: ["r3"],
                DQ_MSGS: {"r3": "retry"},
                DQ_BELL: ["1"],
                **indexed(FAILED_M1, NOW),
            },
            {run_hash("m1"): FAILED_TTL, DQ_BELL: BELL_TTL},
            id="failed-record-with-the-failed-ttl-and-the-retry-enqueued",
        ),
        pytest.param(
            {**SETTLE_M1, INFLIGHT: {"r1": entry(3)}},
            "completed",
            header_of(ended()),
            ended(),
            "",
            None,
            1,
            {DONE_M1: "1", **indexed(ended(n=3), NOW)},
            {DONE_M1: TTL, run_hash("m1"): COMPLETED_TTL},
            id="a-redelivered-attempts-record-counts-its-deliveries",
        ),
        pytest.param(
            {**SETTLE_M1, **indexed(FAILED_M1, NOW - 60_000)},
            "completed",
            header_of(SECOND_ATTEMPT),
            SECOND_ATTEMPT,
            "",
            None,
            1,
            {DONE_M1: "1", **merge(indexed(FAILED_M1, NOW - 60_000), indexed(SECOND_ATTEMPT, NOW))},
            {DONE_M1: TTL, run_hash("m1"): FAILED_TTL},
            id="a-second-attempt-keeps-the-failed-ttl-of-the-first",
        ),
        pytest.param(
            {**SETTLE_M1, **indexed(FAILED_M1, NOW - 60_000)},
            "completed",
            header_of(ended()),
            ended(),
            "",
            None,
            1,
            {DONE_M1: "1", **indexed(ended(), NOW)},
            {DONE_M1: TTL, run_hash("m1"): COMPLETED_TTL},
            id="an-attempt-written-again-leaves-its-old-status-indexes",
        ),
        pytest.param(
            SETTLE_M1,
            "dead",
            header_of(DEAD_M1),
            DEAD_M1,
            DEAD_NOTE_M1,
            None,
            1,
            {
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": kumiko_message("m1")},
                dead_note("m1"): DEAD_NOTE_M1,
                **indexed(DEAD_M1, NOW),
            },
            {run_hash("m1"): FAILED_TTL, dead_note("m1"): DEAD_TTL},
            id="dead-owned-dead-letter-with-its-note-and-record",
        ),
        pytest.param(
            {MSGS: {"r1": kumiko_message("m1")}, ACKS_W2: {"r1"}, INFLIGHT: {"r1": entry(1)}},
            "dead",
            header_of(DEAD_M1),
            DEAD_M1,
            DEAD_NOTE_M1,
            None,
            0,
            {
                MSGS: {"r1": kumiko_message("m1")},
                ACKS_W2: {"r1"},
                INFLIGHT: {"r1": entry(1)},
                **indexed(DEAD_M1, NOW),
            },
            {run_hash("m1"): FAILED_TTL},
            id="dead-not-owned-record-written-but-no-dead-letter-and-no-note",
        ),
        pytest.param(
            {MSGS: {"r1": kumiko_message("m1")}, ACKS_W2: {"r1"}, INFLIGHT: {"r1": W2_ENTRY}},
            "completed",
            header_of(ended()),
            ended(),
            "",
            None,
            0,
            {
                MSGS: {"r1": kumiko_message("m1")},
                ACKS_W2: {"r1"},
                INFLIGHT: {"r1": W2_ENTRY},
                DONE_M1: "1",
                **indexed(ended(), NOW),
            },
            {DONE_M1: TTL, run_hash("m1"): COMPLETED_TTL},
            id="not-owned-the-other-workers-entry-keeps-its-count-the-record-gets-no-n",
        ),
        pytest.param(
            SETTLE_M1,
            "completed",
            header_of(TENANT_RUN),
            TENANT_RUN,
            "",
            None,
            1,
            {DONE_M1: "1", **indexed(TENANT_RUN, NOW)},
            {
                DONE_M1: TTL,
                run_hash("m1"): COMPLETED_TTL,
                by_tenant("acme"): LONG_TTL,
                by_origin("o1"): LONG_TTL,
            },
            id="tenant-and-origin-indexes-live-the-longer-ttl",
        ),
        pytest.param(
            SETTLE_M1,
            "retry",
            header(status=""),
            "",
            "",
            (DQ, "r3", "handoff"),
            1,
            {DQ_LIST: ["r3"], DQ_MSGS: {"r3": "handoff"}, DQ_BELL: ["1"]},
            {DQ_BELL: BELL_TTL},
            id="a-hand-off-enqueues-its-message-and-writes-no-record",
        ),
        pytest.param(
            {**SETTLE_M1, MSGS: {"r1": "not json {"}},
            "dead",
            header("r1", 0, "", "malformed", "", ""),
            "it does not decode",
            "",
            None,
            1,
            {XQ: Z({"r1": NOW}), XQ_MSGS: {"r1": "not json {"}},
            {},
            id="malformed-not-kumikos-dead-lettered-without-a-record",
        ),
        pytest.param(
            {**SETTLE_M1, INFLIGHT: {"r1": entry(2)}},
            "dead",
            header("r1", 0, "", "malformed", "", ""),
            "no such actor",
            "",
            None,
            1,
            {
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": kumiko_message("m1")},
                **indexed(MALFORMED_M1, NOW),
            },
            {run_hash("m1"): FAILED_TTL},
            id="malformed-kumikos-record-says-dead-names-the-in-flight-worker",
        ),
    ],
)
def test_settle_writes_the_run_record(
    env: Env,
    given: State,
    outcome: str,
    run_header: str,
    run: J | str,
    note: J | str,
    retry: tuple[str, str, str] | None,
    reply: int,
    after: State,
    expiry: dict[str, int],
) -> None:
    env.seed(given)

    assert env.settle(outcome, run_header=run_header, run=run, note=note, retry=retry) == reply

    env.assert_state(after)
    env.assert_expiry(expiry)


# A settle with a trim budget trims after its write: entries older than their status age
# leave the status indexes and its job's (a hand-off names no job), then the oldest records
# beyond the cap go (trim_runs, see test_trim_runs).
OLD_COMPLETED = ended("c1")
RECENT_COMPLETED = ended("c2")


@pytest.mark.parametrize(
    ("given", "run_header", "run", "after"),
    [
        pytest.param(
            indexed(RECENT_COMPLETED, NOW - 5_000),
            header_of(ended(), cap=1, trim=32),
            ended(),
            indexed(ended(), NOW),
            id="beyond-the-cap-the-oldest-record-goes",
        ),
        pytest.param(
            indexed(RECENT_COMPLETED, NOW - 5_000),
            header_of(ended(), cap=1, trim=0),
            ended(),
            merge(indexed(RECENT_COMPLETED, NOW - 5_000), indexed(ended(), NOW)),
            id="no-budget-no-trim",
        ),
        pytest.param(
            indexed(OLD_COMPLETED, PAST_COMPLETED_AGE),
            header(status="", trim=4),
            "",
            {
                run_hash("c1"): {"1": OLD_COMPLETED},
                by_job("completed"): Z({"c1:1": PAST_COMPLETED_AGE}),
            },
            id="a-hand-off-ages-out-the-status-indexes-only",
        ),
    ],
)
def test_settle_trims_the_run_history(
    env: Env, given: State, run_header: str, run: J | str, after: State
) -> None:
    env.seed({**SETTLE_M1, **given})

    assert env.settle("ack", run_header=run_header, run=run) == 1

    env.assert_state(after)


# -- settle of a delivery maintenance recovered (w1 was presumed dead and its ack set went
# back to the queue): while the recovered copy still waits, in the queue (behind r0) or in the
# suspects list (behind the suspect r2), settle takes the copy back and settles the delivery
# as if w1 still held it (reply 1), so no second copy of a settled message is left to run;
# once another worker (w2) took the copy, nothing but the marker ("completed") and the record
# is written (reply 0), r1's entry (w2's now) left as it was and uncounted in the record: the
# copy runs there, at least once. Each row's "after" lists what the outcome leaves besides its
# run record and r2's entry, which every row adds (r1's entry, when left, is in "after").
CANCELLED_M1 = ended(status="cancelled")
#: outcome -> the run record its settle writes, and that record's TTL
OUTCOME_RUNS: dict[str, tuple[J, int]] = {
    "ack": (CANCELLED_M1, COMPLETED_TTL),
    "completed": (ended(), COMPLETED_TTL),
    "retry": (FAILED_M1, FAILED_TTL),
    "dead": (DEAD_M1, FAILED_TTL),
}
RECOVERED_TO_QUEUE: State = {
    LIST: ["r0", "r1"],
    MSGS: {"r0": "b0", "r1": "b1"},
    INFLIGHT: {"r1": entry(1), **R2_ENTRY},
}
RECOVERED_TO_SUSPECTS: State = {
    SUSPECTS: ["r2", "r1"],
    MSGS: {"r1": "b1", "r2": "b2"},
    INFLIGHT: {"r1": entry(1), **R2_ENTRY},
}
#: w2 fetched the recovered copy: its entry says so (a second delivery, by w2's process)
TAKEN_BY_W2: State = {
    MSGS: {"r1": "b1"},
    ACKS_W2: {"r1"},
    INFLIGHT: {"r1": entry(2, NOW - 1_000, OTHER_RUN_WORKER), **R2_ENTRY},
}
#: what settle leaves of it: all of it (w2's claim, its entry and the message)
TAKEN_LEFT: State = TAKEN_BY_W2


@pytest.mark.parametrize(
    ("given", "outcome", "retry_queue", "reply", "after", "expiry"),
    [
        pytest.param(
            RECOVERED_TO_QUEUE,
            "ack",
            None,
            1,
            {LIST: ["r0"], MSGS: {"r0": "b0"}},
            {},
            id="in-the-queue-ack-takes-the-copy-back",
        ),
        pytest.param(
            RECOVERED_TO_QUEUE,
            "completed",
            None,
            1,
            {LIST: ["r0"], MSGS: {"r0": "b0"}, DONE_M1: "1"},
            {DONE_M1: TTL},
            id="in-the-queue-completed-takes-the-copy-back-and-marks",
        ),
        pytest.param(
            RECOVERED_TO_QUEUE,
            "retry",
            QUEUE,
            1,
            {LIST: ["r0", "r3"], MSGS: {"r0": "b0", "r3": "retry"}, BELL: ["1"]},
            {BELL: BELL_TTL},
            id="in-the-queue-retry-replaces-the-copy-by-the-retry",
        ),
        pytest.param(
            RECOVERED_TO_QUEUE,
            "dead",
            None,
            1,
            {
                LIST: ["r0"],
                MSGS: {"r0": "b0"},
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": "b1"},
                dead_note("m1"): DEAD_NOTE_M1,
            },
            {dead_note("m1"): DEAD_TTL},
            id="in-the-queue-dead-dead-letters-the-copy-with-its-note",
        ),
        pytest.param(
            RECOVERED_TO_SUSPECTS,
            "ack",
            None,
            1,
            {SUSPECTS: ["r2"], MSGS: {"r2": "b2"}},
            {},
            id="a-suspect-ack-takes-the-copy-back",
        ),
        pytest.param(
            RECOVERED_TO_SUSPECTS,
            "completed",
            None,
            1,
            {SUSPECTS: ["r2"], MSGS: {"r2": "b2"}, DONE_M1: "1"},
            {DONE_M1: TTL},
            id="a-suspect-completed-takes-the-copy-back-and-marks",
        ),
        pytest.param(
            RECOVERED_TO_SUSPECTS,
            "retry",
            DQ,
            1,
            {
                SUSPECTS: ["r2"],
                MSGS: {"r2": "b2"},
                DQ_LIST: ["r3"],
                DQ_MSGS: {"r3": "retry"},
                DQ_BELL: ["1"],
            },
            {DQ_BELL: BELL_TTL},
            id="a-suspect-retry-takes-the-copy-back-and-delays-the-retry",
        ),
        pytest.param(
            RECOVERED_TO_SUSPECTS,
            "dead",
            None,
            1,
            {
                SUSPECTS: ["r2"],
                MSGS: {"r2": "b2"},
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": "b1"},
                dead_note("m1"): DEAD_NOTE_M1,
            },
            {dead_note("m1"): DEAD_TTL},
            id="a-suspect-dead-dead-letters-the-copy-with-its-note",
        ),
        pytest.param(
            TAKEN_BY_W2,
            "ack",
            None,
            0,
            TAKEN_LEFT,
            {},
            id="taken-by-another-worker-ack-writes-the-record-only",
        ),
        pytest.param(
            TAKEN_BY_W2,
            "completed",
            None,
            0,
            {**TAKEN_LEFT, DONE_M1: "1"},
            {DONE_M1: TTL},
            id="taken-by-another-worker-completed-writes-the-marker-and-record-only",
        ),
        pytest.param(
            TAKEN_BY_W2,
            "retry",
            QUEUE,
            0,
            TAKEN_LEFT,
            {},
            id="taken-by-another-worker-retry-enqueues-nothing",
        ),
        pytest.param(
            TAKEN_BY_W2,
            "dead",
            None,
            0,
            TAKEN_LEFT,
            {},
            id="taken-by-another-worker-dead-moves-nothing-and-writes-no-note",
        ),
    ],
)
def test_settle_of_a_delivery_recovered_by_maintenance(
    env: Env,
    given: State,
    outcome: str,
    retry_queue: str | None,
    reply: int,
    after: State,
    expiry: dict[str, int],
) -> None:
    env.seed(given)
    run, run_ttl = OUTCOME_RUNS[outcome]
    # no "n": a recovered copy's entry counts 1 delivery, and w2's entry is not w1's to count
    note = DEAD_NOTE_M1 if outcome == "dead" else ""
    retry = None if retry_queue is None else (retry_queue, "r3", "retry")

    assert env.settle(outcome, run_header=header_of(run), run=run, note=note, retry=retry) == reply

    env.assert_state({INFLIGHT: R2_ENTRY, **after, **indexed(run, NOW)})
    env.assert_expiry({**expiry, run_hash("m1"): run_ttl})
    assert env.heartbeat("w1") == NOW


# The follow-up (a retry or a hand-off) is settle's first write: when it fails (here the
# delay queue's message hash is not a hash), the script stops before anything else is
# written, so the delivery stays as it was: its claim, its entry, its message (or its
# recovered copy), no record; the worker's next attempt (or the copy) still runs it.
WRONG_TYPED_DQ: State = {DQ_MSGS: "not a hash"}


@pytest.mark.parametrize(
    "given",
    [
        pytest.param(SETTLE_OWNED, id="owned"),
        pytest.param(RECOVERED_TO_QUEUE, id="recovered-to-the-queue"),
        pytest.param(RECOVERED_TO_SUSPECTS, id="recovered-to-the-suspects"),
    ],
)
def test_settle_writes_the_follow_up_first(env: Env, given: State) -> None:
    env.seed({**given, **WRONG_TYPED_DQ})

    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        env.settle(
            "retry", run_header=header_of(FAILED_M1), run=FAILED_M1, retry=(DQ, "r3", "retry")
        )

    env.assert_state({**given, **WRONG_TYPED_DQ})


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
# The queue's doorbell rings iff a message went back (once, however many did).
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
                BELL: ["1"],
            },
            id="owned-with-body-go-back-in-order-one-token",
        ),
        pytest.param(
            ["r1", "r3", "r4", "r9"],
            1,
            {
                LIST: ["r0", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r2"},
                ACKS_W2: {"r4"},
                BELL: ["1"],
            },
            id="bodyless-and-foreign-and-unknown-stay-out",
        ),
        pytest.param(
            ["r3", "r4", "r9"],
            0,
            {
                LIST: ["r0"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r1", "r2"},
                ACKS_W2: {"r4"},
            },
            id="none-went-back-no-ring",
        ),
        pytest.param(
            ["r1", "r1"],
            1,
            {
                LIST: ["r0", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r2", "r3"},
                ACKS_W2: {"r4"},
                BELL: ["1"],
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


# With KEYS[2] (a kumiko lane's in-flight hash), each id that goes back has its delivery
# undone: its deliveries count goes down by one (the rest of its entry kept) and the entry
# goes at 0 (never below); an owned id whose message is gone loses its entry.
@pytest.mark.parametrize(
    ("inflight", "ids", "lane", "reply", "after"),
    [
        pytest.param(
            {"r1": earlier(2), "r2": entry(1), "r3": entry(1), "r4": earlier(1)},
            ["r2", "r1"],
            True,
            2,
            {
                LIST: ["r0", "r2", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r3"},
                ACKS_W2: {"r4"},
                INFLIGHT: {"r1": earlier(1), "r3": entry(1), "r4": earlier(1)},
                BELL: ["1"],
            },
            id="counts-go-down-and-the-entry-goes-at-zero",
        ),
        pytest.param(
            {"r1": earlier(2), "r2": entry(1), "r3": entry(1), "r4": earlier(1), "r9": entry(1)},
            ["r3", "r4", "r9"],
            True,
            0,
            {
                LIST: ["r0"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r1", "r2"},
                ACKS_W2: {"r4"},
                INFLIGHT: {"r1": earlier(2), "r2": entry(1), "r4": earlier(1), "r9": entry(1)},
            },
            id="an-owned-bodyless-id-loses-its-entry-foreign-and-unknown-keep-theirs",
        ),
        pytest.param(
            {"r4": earlier(1)},
            ["r1"],
            True,
            1,
            {
                LIST: ["r0", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r2", "r3"},
                ACKS_W2: {"r4"},
                INFLIGHT: {"r4": earlier(1)},
                BELL: ["1"],
            },
            id="no-entry-never-goes-negative",
        ),
        pytest.param(
            {"r1": earlier(12)},
            ["r1", "r1"],
            True,
            1,
            {
                LIST: ["r0", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r2", "r3"},
                ACKS_W2: {"r4"},
                INFLIGHT: {"r1": earlier(11)},
                BELL: ["1"],
            },
            id="an-id-given-twice-is-undone-once-two-digit-count",
        ),
        pytest.param(
            {"r1": earlier(2), "r2": entry(1)},
            ["r2", "r1"],
            False,
            2,
            {
                LIST: ["r0", "r2", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r3"},
                ACKS_W2: {"r4"},
                INFLIGHT: {"r1": earlier(2), "r2": entry(1)},
                BELL: ["1"],
            },
            id="without-the-hash-entries-stay",
        ),
    ],
)
def test_requeue_undoes_lane_deliveries(
    env: Env, inflight: dict[str, str], ids: list[str], lane: bool, reply: int, after: State
) -> None:
    env.seed({**REQUEUE_GIVEN, INFLIGHT: inflight})
    keys = [NAMESPACE, env.key(INFLIGHT)] if lane else [NAMESPACE]

    assert env.lua.requeue(keys=keys, args=[*env.head(), *ids]) == reply

    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


# == resume =================================================================================
# The job leaves the paused set; up to a step of its parked ids leave the parked list from its
# tail for the head of its queue, so that once all steps ran they wait in their parked order
# ahead of the rest; except those to drop (cron ticks its misfire policy skips): deleted,
# their run record "cancelled"; and ids cancelled while parked (no body): dropped, and out of
# the withdrawn set, which goes once the list is empty. The queue's doorbell rings iff any went
# back. Reply: {was paused, requeued, dropped, parked ids left}.
RESUME_OTHER_JOB = "app:job:other"
SKIPPED_M2 = record(
    "m2", 1, "cancelled", q=ENQUEUED_AT, w="", en=NOW, em="skipped on resume (misfire)"
)


@pytest.mark.parametrize(
    ("given", "step", "drop", "reply", "after", "expiry"),
    [
        pytest.param(
            {
                **PAUSED_JOB,
                PARKED: ["r1", "r2"],
                LIST: ["r0"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2"},
            },
            1000,
            [],
            [1, 2, 0, 0],
            {LIST: ["r1", "r2", "r0"], MSGS: {"r0": "b0", "r1": "b1", "r2": "b2"}, BELL: ["1"]},
            {BELL: BELL_TTL},
            id="parked-go-back-ahead-in-their-order-one-token",
        ),
        pytest.param(
            {
                **PAUSED_JOB,
                PARKED: ["r1", "r2", "r3"],
                LIST: ["r0"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r3": "b3"},
            },
            2,
            [],
            [1, 2, 0, 1],
            {
                PARKED: ["r1"],
                LIST: ["r2", "r3", "r0"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r3": "b3"},
                BELL: ["1"],
            },
            {BELL: BELL_TTL},
            id="a-step-takes-the-last-parked-first-and-says-how-many-are-left",
        ),
        pytest.param(
            {
                PARKED: ["r1"],
                LIST: ["r2", "r3", "r0"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r3": "b3"},
            },
            2,
            [],
            [0, 1, 0, 0],
            {
                LIST: ["r1", "r2", "r3", "r0"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r3": "b3"},
                BELL: ["1"],
            },
            {BELL: BELL_TTL},
            id="the-next-step-finishes-in-parked-order-though-no-longer-paused",
        ),
        pytest.param(
            {
                PAUSED: {JOB, RESUME_OTHER_JOB},
                PARKED: ["r1", "r2", "r3"],
                MSGS: {"r1": "b1", "r2": kumiko_message("m2"), "r3": "b3"},
            },
            1000,
            ["r2"],
            [1, 2, 1, 0],
            {
                PAUSED: {RESUME_OTHER_JOB},
                LIST: ["r1", "r3"],
                MSGS: {"r1": "b1", "r3": "b3"},
                BELL: ["1"],
                **indexed(SKIPPED_M2, NOW),
            },
            {BELL: BELL_TTL, run_hash("m2"): COMPLETED_TTL},
            id="one-dropped-its-record-cancelled-the-rest-go-back-and-ring",
        ),
        pytest.param(
            {
                **PAUSED_JOB,
                PARKED: ["r1", "r2"],
                PARKED_WITHDRAWN: {"r2"},
                MSGS: {"r1": "b1"},
            },
            1000,
            [],
            [1, 1, 0, 0],
            {LIST: ["r1"], MSGS: {"r1": "b1"}, BELL: ["1"]},
            {BELL: BELL_TTL},
            id="one-cancelled-while-parked-is-dropped-and-the-withdrawn-set-goes",
        ),
        pytest.param(
            {**PAUSED_JOB, PARKED: ["r1"], LIST: ["r0"], MSGS: {"r0": "b0", "r1": "b1"}},
            1000,
            ["r1"],
            [1, 0, 1, 0],
            {LIST: ["r0"], MSGS: {"r0": "b0"}},
            {},
            id="all-dropped-none-went-back-no-ring",
        ),
        pytest.param(
            {**PAUSED_JOB, LIST: ["r0"], MSGS: {"r0": "b0"}},
            1000,
            [],
            [1, 0, 0, 0],
            {LIST: ["r0"], MSGS: {"r0": "b0"}},
            {},
            id="nothing-parked-no-ring",
        ),
        pytest.param(
            {LIST: ["r0"], MSGS: {"r0": "b0"}},
            1000,
            [],
            [0, 0, 0, 0],
            {LIST: ["r0"], MSGS: {"r0": "b0"}},
            {},
            id="not-paused-nothing-parked-nothing-done",
        ),
    ],
)
def test_resume(
    env: Env,
    given: State,
    step: int,
    drop: list[str],
    reply: list[int],
    after: State,
    expiry: dict[str, int],
) -> None:
    env.seed(given)

    result = env.lua.resume(
        keys=[
            env.key(PAUSED),
            env.key(PARKED),
            env.key(LIST),
            env.key(MSGS),
            env.key(PARKED_WITHDRAWN),
        ],
        args=[JOB, env.key(ROOT), NOW, COMPLETED_TTL, FAILED_TTL, step, *drop],
    )

    assert result == reply
    env.assert_state(after)
    env.assert_expiry(expiry)


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


# == move ===================================================================================
# A due delayed message d1 (claimed off the delay queue by w1) goes to the queue as r9, in
# one step; its message id's cancel marker drops it instead (and is deleted).
MOVE_GIVEN: State = {LIST: ["r0"], MSGS: {"r0": "b0"}, DQ_MSGS: {"d1": "delayed"}}


@pytest.mark.parametrize(
    ("given", "reply", "after"),
    [
        pytest.param(
            {**MOVE_GIVEN, DQ_ACKS: {"d1", "d2"}},
            1,
            {
                LIST: ["r0", "r9"],
                MSGS: {"r0": "b0", "r9": "moved"},
                DQ_ACKS: {"d2"},
                BELL: ["1"],
            },
            id="owned-leaves-the-delay-queue-for-the-queues-tail-and-rings",
        ),
        pytest.param(
            {**MOVE_GIVEN, DQ_ACKS: {"d1"}, CANCEL_M1: "1"},
            2,
            {LIST: ["r0"], MSGS: {"r0": "b0"}},
            id="cancelled-is-dropped-and-its-marker-deleted",
        ),
        pytest.param(
            {**MOVE_GIVEN, DQ_ACKS_W2: {"d1"}, CANCEL_M1: "1"},
            0,
            {**MOVE_GIVEN, DQ_ACKS_W2: {"d1"}, CANCEL_M1: "1"},
            id="not-owned-changes-nothing",
        ),
    ],
)
def test_move(env: Env, given: State, reply: int, after: State) -> None:
    env.seed(given)

    result = env.lua.move(
        keys=[NAMESPACE, env.key(CANCEL_M1)],
        args=[*env.head(DQ), "d1", env.key(QUEUE), "r9", "moved"],
    )

    assert result == reply
    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


# == the in-flight hash across fetch_lane, requeue, maintenance and settle ==================
def _die(env: Env, worker: str, claimed_at: int) -> None:
    """``worker`` claimed at ``claimed_at`` and died: maintenance (w2, holding a message, so
    it claims nothing) recovers its claims once its heartbeat is past the timeout."""
    env.fetch_lane(0, 1, worker="w2", now=claimed_at + HEARTBEAT_TIMEOUT + 1, maintenance=True)
    assert env.heartbeat(worker) is None


def test_a_delivery_undone_by_requeue_leaves_no_entry_and_no_suspect(env: Env) -> None:
    # Given: w1 claimed r1 (kumiko's m1), a full batch leaving r2 (the bell rang)
    env.seed({LIST: ["r1", "r2"], MSGS: {"r1": kumiko_message("m1"), "r2": "b2"}})
    assert env.fetch_lane(1) == [["r1", kumiko_message("m1")], [], [], 0, 0]
    env.assert_state(
        {
            LIST: ["r2"],
            MSGS: {"r1": kumiko_message("m1"), "r2": "b2"},
            ACKS: {"r1"},
            INFLIGHT: {"r1": entry(1)},
            BELL: ["1"],
        }
    )

    # When: the worker shuts down and requeues it, then fetches two
    requeued = env.lua.requeue(
        keys=[NAMESPACE, env.key(INFLIGHT)], args=[*env.head(now=NOW + 1), "r1"]
    )
    refetched = env.fetch_lane(2, now=NOW + 2)

    # Then: r1 went back with no entry, so it is claimed beside r2 like any message (the
    # token nobody took still waits)
    assert requeued == 1
    assert refetched == [["r2", "b2", "r1", kumiko_message("m1")], [], [], 0, 0]
    env.assert_state(
        {
            MSGS: {"r1": kumiko_message("m1"), "r2": "b2"},
            ACKS: {"r1", "r2"},
            INFLIGHT: {"r1": entry(1, NOW + 2), "r2": entry(1, NOW + 2)},
            BELL: ["1"],
        }
    )


def test_a_crashed_delivery_runs_alone_and_its_record_counts_the_deliveries(env: Env) -> None:
    # Given: w0 claimed r1 (kumiko's m1) and died; r2 waits behind it (the bell rang, and
    # nobody takes its token in this test)
    env.seed({LIST: ["r1", "r2"], MSGS: {"r1": kumiko_message("m1"), "r2": "b2"}})
    env.fetch_lane(1, worker="w0", now=CLAIMED_AT)
    _die(env, "w0", CLAIMED_AT)
    env.assert_state(
        {
            LIST: ["r2", "r1"],
            MSGS: {"r1": kumiko_message("m1"), "r2": "b2"},
            INFLIGHT: {"r1": entry(1, CLAIMED_AT)},
            BELL: ["1"],
        }
    )

    # When: idle w1 fetches (r2 comes first, so r1 is set aside), settles r2, fetches again
    first = env.fetch_lane(2, now=NOW - 2)
    assert env.settle("ack", rid="r2", now=NOW - 2) == 1
    second = env.fetch_lane(2, now=NOW - 1)

    # Then: r1 ran alone, its second delivery counted
    assert first == [["r2", "b2"], [], [], 1, 0]
    assert second == [["r1", kumiko_message("m1")], [], [], 0, 1]
    env.assert_state(
        {
            MSGS: {"r1": kumiko_message("m1")},
            ACKS: {"r1"},
            INFLIGHT: {"r1": entry(2, NOW - 1)},
            BELL: ["1"],
        }
    )

    # When: it completes
    assert env.settle("completed", run_header=header_of(ended()), run=ended()) == 1

    # Then: the entry is gone and the record says 2 deliveries
    env.assert_state({DONE_M1: "1", BELL: ["1"], **indexed(ended(n=2), NOW)})


def test_a_message_whose_worker_dies_max_deliveries_times_is_dead_lettered(env: Env) -> None:
    # Given: r1 (kumiko's m1); each time a worker claims it, that worker dies
    env.seed({LIST: ["r1"], MSGS: {"r1": kumiko_message("m1")}})
    for delivery in range(1, MAX_DELIVERIES + 1):
        claimed_at = CLAIMED_AT + delivery * 1_000
        claimed = env.fetch_lane(1, worker="w0", now=claimed_at)
        assert claimed == [["r1", kumiko_message("m1")], [], [], 0, int(delivery > 1)]
        assert env.client.hget(env.key(INFLIGHT), "r1") == entry(delivery, claimed_at).encode()
        _die(env, "w0", claimed_at)

    # When: the next fetch meets it
    reply = env.fetch_lane(1)

    # Then: it is dead-lettered, its entry dropped, its record and note written (the bell
    # holds the one token its first recovery rang, nobody having taken it)
    assert reply == [[], [], ["r1", MAX_DELIVERIES], 0, 0]
    env.assert_state(
        {
            XQ: Z({"r1": NOW}),
            XQ_MSGS: {"r1": kumiko_message("m1")},
            BELL: ["1"],
            **indexed(died(), NOW),
            dead_note("m1"): died_note("r1", died()),
        }
    )
    env.assert_expiry({run_hash("m1"): FAILED_TTL, dead_note("m1"): DEAD_TTL, BELL: BELL_TTL})


# == guarded_enqueue ========================================================================
# Like every enqueue step below, a message written rings its queue's doorbell; one guarded
# out writes nothing, the bell included.
@pytest.mark.parametrize(
    ("given", "reply", "after", "ttls"),
    [
        pytest.param(
            {},
            [1],
            {LIST: ["r1"], MSGS: {"r1": "body"}, GUARD: "sched-1", BELL: ["1"]},
            {GUARD: TTL, BELL: BELL_TTL},
            id="guard-absent-enqueues-and-rings",
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
    env.assert_state({LIST: ["r1"], MSGS: {"r1": "body"}, SENT: "1", BELL: ["1"]})
    env.assert_ttls({SENT: TTL, BELL: BELL_TTL})


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
                BELL: ["1"],
            },
            {GUARD: TTL, GUARD_2: NO_TTL, GUARD_3: TTL, BELL: BELL_TTL},
            id="mixed-guards-two-written-one-token",
        ),
        pytest.param(
            {},
            [(GUARD, "r1", "b1"), (GUARD, "r2", "b2")],
            [1, 0],
            {LIST: ["r1"], MSGS: {"r1": "b1"}, GUARD: "sched-1", BELL: ["1"]},
            {GUARD: TTL, BELL: BELL_TTL},
            id="same-guard-twice-in-one-batch",
        ),
        pytest.param(
            {GUARD: "sched-0"},
            [(GUARD, "r1", "b1")],
            [0],
            {GUARD: "sched-0"},
            {GUARD: NO_TTL},
            id="all-guarded-no-ring",
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


# == cron_tick ==============================================================================
TICK = 1_700_000_000


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
        keys=[env.key(MSGS), env.key(LIST), env.key(GUARD), env.key(LAST_TICK)],
        args=["r1", "body", TTL, "sched-1", tick, TTL],
    )

    assert result == reply
    env.assert_state(after)
    env.assert_ttls(ttls)


# == dedup_dispatch =========================================================================
# A new record enters its job's index (DEDUP_INDEX), scored by its expiry on Redis's clock (the
# index gets two record TTLs when less than one is left); a producer hit writes neither a TTL
# nor an index entry.
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


# == dedup_mark_running =====================================================================
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


# == dedup_requeue ==========================================================================
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


# == dedup_finish ===========================================================================
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
            [*queue_keys, env.key(RECORD), env.key(DEDUP_INDEX)],
            ["r5", "follow-up", "m1", "m5", TTL, "k1"],
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
# A lock taken enters the index of held locks (LOCKS: member the key after "lock:", scored by
# its lease's expiry on Redis's clock; LOCKS_SINCE: when it was taken), and sweeps out up to
# two entries whose lease ran out while their lock is gone (one still there is scored again).
# Both keys get two leases of TTL when less than one is left.
HELD = {LOCKS: Z({"app.job": DueIn(TTL)}), LOCKS_SINCE: {"app.job": JustNow()}}


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


# == lock_renew =============================================================================
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


# == lock_release ===========================================================================
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


# == run_put ================================================================================
# One record outside a delivery (boot gates, which write "running" and then the end): the
# hash field of its attempt, its job and status index entries scored by the write's time
# (an older status's entries of the same attempt removed), its tenant's and origin's
# entries; the hash lives the record's status TTL (at least the failed TTL after the first
# attempt), the tenant and origin indexes the longer TTL. Kumiko's Python writes records
# compact, but json.dumps's default ", " and ": " must read the same.
def _run_put(
    env: Env,
    run: J,
    *,
    python: bool = False,
    at: int = NOW,
    cap: int = CAP,
    budget: int = 0,
    completed_ttl: int | str = COMPLETED_TTL,
    failed_ttl: int | str = FAILED_TTL,
) -> Any:
    """run_put of ``run`` as RunHistory.put calls it (ARGV[1..12], ARGV[13] trim budget)."""
    filled = env.fill_value(run)
    return env.lua.run_put(
        keys=[env.key(run_hash(run["m"]))],
        args=[
            env.key(ROOT),
            run["m"],
            run["a"],
            run["j"],
            run["s"],
            run.get("t", ""),
            run["o"],
            at,
            filled.python() if python else filled.compact(),
            completed_ttl,
            failed_ttl,
            cap,
            budget,
        ],
    )


RUNNING_GATE = record("m1", 1, "running", st=STARTED_AT, w=RUN_WORKER)
CANCELLED_M1 = record("m1", 1, "cancelled", q=ENQUEUED_AT, en=NOW)
TENANT_FAILED = ended(job=TENANT_JOB, max_attempts=2, status="failed", t="acme", o="o1")


@pytest.mark.parametrize(
    ("given", "run", "python", "after", "expiry"),
    [
        pytest.param(
            {},
            ended(),
            False,
            indexed(ended(), NOW),
            {run_hash("m1"): COMPLETED_TTL},
            id="a-completed-record-lives-the-completed-ttl",
        ),
        pytest.param(
            {},
            FAILED_M1,
            False,
            indexed(FAILED_M1, NOW),
            {run_hash("m1"): FAILED_TTL},
            id="a-failed-record-lives-the-failed-ttl",
        ),
        pytest.param(
            {},
            CANCELLED_M1,
            False,
            indexed(CANCELLED_M1, NOW),
            {run_hash("m1"): COMPLETED_TTL},
            id="a-cancelled-record-lives-the-completed-ttl",
        ),
        pytest.param(
            {},
            RUNNING_GATE,
            False,
            indexed(RUNNING_GATE, NOW),
            {run_hash("m1"): FAILED_TTL},
            id="a-running-record-lives-the-failed-ttl",
        ),
        pytest.param(
            indexed(FAILED_M1, NOW - 60_000),
            SECOND_ATTEMPT,
            False,
            merge(indexed(FAILED_M1, NOW - 60_000), indexed(SECOND_ATTEMPT, NOW)),
            {run_hash("m1"): FAILED_TTL},
            id="a-later-completed-attempt-keeps-the-failed-ttl",
        ),
        pytest.param(
            {
                run_hash("m1"): {"1": RUNNING_GATE.python()},
                by_job("running"): Z({"m1:1": STARTED_AT}),
                by_status("running"): Z({"m1:1": STARTED_AT, "m0:1": STARTED_AT}),
            },
            ended(),
            True,
            {**indexed(ended(), NOW), by_status("running"): Z({"m0:1": STARTED_AT})},
            {run_hash("m1"): COMPLETED_TTL},
            id="python-json-running-then-completed-leaves-the-running-indexes",
        ),
        pytest.param(
            indexed(RUNNING_GATE, STARTED_AT),
            ended(),
            False,
            indexed(ended(), NOW),
            {run_hash("m1"): COMPLETED_TTL},
            id="compact-json-running-then-completed-leaves-the-running-indexes",
        ),
        pytest.param(
            indexed(ended(), NOW - 60_000),
            ended(),
            True,
            indexed(ended(), NOW),
            {run_hash("m1"): COMPLETED_TTL},
            id="the-same-status-again-is-scored-anew",
        ),
        pytest.param(
            {by_tenant("acme"): Z({"m0:1": NOW - 1_000}), by_origin("o1"): Z({"o1:1": NOW})},
            TENANT_FAILED,
            True,
            merge(
                {by_tenant("acme"): Z({"m0:1": NOW - 1_000}), by_origin("o1"): Z({"o1:1": NOW})},
                indexed(TENANT_FAILED, NOW),
            ),
            {run_hash("m1"): FAILED_TTL, by_tenant("acme"): LONG_TTL, by_origin("o1"): LONG_TTL},
            id="tenant-and-origin-indexes-join-and-live-the-longer-ttl",
        ),
    ],
)
def test_run_put(
    env: Env, given: State, run: J, python: bool, after: State, expiry: dict[str, int]
) -> None:
    env.seed(given)

    assert _run_put(env, run, python=python) == 1

    env.assert_state(after)
    env.assert_expiry(expiry)


@pytest.mark.parametrize(
    ("completed_ttl", "failed_ttl", "attempt", "status", "ttl"),
    [
        pytest.param(
            COMPLETED_TTL, FAILED_TTL, 1, "completed", COMPLETED_TTL, id="first-completed"
        ),
        pytest.param(COMPLETED_TTL, FAILED_TTL, 1, "dead", FAILED_TTL, id="first-dead"),
        pytest.param(COMPLETED_TTL, FAILED_TTL, 2, "completed", FAILED_TTL, id="later-completed"),
        pytest.param(COMPLETED_TTL, FAILED_TTL, 3, "cancelled", FAILED_TTL, id="later-cancelled"),
        pytest.param(
            FAILED_TTL, COMPLETED_TTL, 2, "completed", FAILED_TTL, id="later-completed-longer"
        ),
        pytest.param(
            FAILED_TTL, COMPLETED_TTL, 2, "failed", COMPLETED_TTL, id="later-failed-shorter"
        ),
        pytest.param(FAILED_TTL, COMPLETED_TTL, 1, "running", COMPLETED_TTL, id="first-running"),
    ],
)
def test_run_put_hash_ttl_is_the_status_ttl_at_least_the_failed_one_after_attempt_1(
    env: Env, completed_ttl: int, failed_ttl: int, attempt: int, status: str, ttl: int
) -> None:
    run = ended(attempt=attempt, status=status, job=TENANT_JOB, max_attempts=3, t="acme")

    _run_put(env, run, completed_ttl=completed_ttl, failed_ttl=failed_ttl)

    env.assert_state(indexed(run, NOW))
    env.assert_expiry({run_hash("m1"): ttl, by_tenant("acme"): max(completed_ttl, failed_ttl)})


@pytest.mark.parametrize(
    ("completed_ttl", "failed_ttl"),
    [
        pytest.param(0, FAILED_TTL, id="completed-ttl-0"),
        pytest.param("1.5", FAILED_TTL, id="completed-ttl-fraction"),
        pytest.param(COMPLETED_TTL, "soon", id="failed-ttl-not-a-number"),
        pytest.param(COMPLETED_TTL, 2**48 + 1, id="failed-ttl-beyond-2-48"),
    ],
)
def test_run_put_refuses_a_bad_ttl_before_writing(
    env: Env, completed_ttl: int | str, failed_ttl: int | str
) -> None:
    with pytest.raises(redis.ResponseError, match="TTL must be an integer"):
        _run_put(env, ended(), completed_ttl=completed_ttl, failed_ttl=failed_ttl)

    env.assert_state({})


# == trim_runs (lua/_history.lua, run by run_put and settle with a budget) ==================
# run_put writes NEW (failed, at NOW), then trims: index entries older than their status age
# leave the status indexes and the written job's; then, while more records than the cap are
# indexed (running ones count), the oldest go, completed first, then cancelled, failed and
# dead (never running), at most the budget: each dropped record leaves its hash and its job,
# tenant and origin indexes (as far as its record tells them).
NEW = ended("m9", status="failed")
C1, C2 = ended("c1"), ended("c2")
X1 = record("x1", 1, "cancelled", en=NOW)
F1, F2 = ended("f1", status="failed"), ended("f2", status="failed")
D1 = ended("d1", status="dead")
OTHER_JOB_C9 = ended("c9", job=TENANT_JOB, max_attempts=2)
TENANT_C1 = ended("c1", job=TENANT_JOB, max_attempts=2, t="acme", o="o1")
TENANT_C2 = ended("c2", job=TENANT_JOB, max_attempts=2, t="acme", o="o1")


@pytest.mark.parametrize(
    ("given", "cap", "budget", "after"),
    [
        pytest.param(
            merge(indexed(C1, PAST_COMPLETED_AGE), indexed(C2, NOW - 5_000)),
            1,
            0,
            merge(indexed(C1, PAST_COMPLETED_AGE), indexed(C2, NOW - 5_000), indexed(NEW, NOW)),
            id="budget-0-trims-nothing",
        ),
        pytest.param(
            merge(
                indexed(C1, PAST_COMPLETED_AGE),
                indexed(OTHER_JOB_C9, PAST_COMPLETED_AGE),
                indexed(F1, PAST_COMPLETED_AGE),
                indexed(F2, PAST_FAILED_AGE),
            ),
            CAP,
            4,
            merge(
                {
                    run_hash("c1"): {"1": C1},
                    run_hash("c9"): {"1": OTHER_JOB_C9},
                    run_hash("f2"): {"1": F2},
                    by_job("completed", TENANT_JOB): Z({"c9:1": PAST_COMPLETED_AGE}),
                },
                indexed(F1, PAST_COMPLETED_AGE),
                indexed(NEW, NOW),
            ),
            id="entries-past-their-status-age-leave-the-status-and-this-jobs-indexes",
        ),
        pytest.param(
            merge(
                indexed(C1, NOW - 5_000),
                indexed(C2, NOW - 4_000),
                indexed(X1, NOW - 9_000),
                indexed(F1, NOW - 8_000),
                indexed(D1, NOW - 9_500),
            ),
            3,
            32,
            merge(indexed(F1, NOW - 8_000), indexed(D1, NOW - 9_500), indexed(NEW, NOW)),
            id="beyond-the-cap-completed-go-first-then-cancelled",
        ),
        pytest.param(
            merge(indexed(F1, NOW - 5_000), indexed(D1, NOW - 9_000)),
            2,
            32,
            merge(indexed(D1, NOW - 9_000), indexed(NEW, NOW)),
            id="failed-go-before-older-dead-ones",
        ),
        pytest.param(
            merge(indexed(C1, NOW - 5_000), indexed(C2, NOW - 4_000), indexed(F1, NOW - 8_000)),
            1,
            2,
            merge(indexed(F1, NOW - 8_000), indexed(NEW, NOW)),
            id="the-budget-bounds-the-drops-a-lowered-cap-is-reached-later",
        ),
        pytest.param(
            merge(indexed(TENANT_C1, NOW - 5_000), indexed(TENANT_C2, NOW - 4_000)),
            2,
            32,
            merge(indexed(TENANT_C2, NOW - 4_000), indexed(NEW, NOW)),
            id="a-dropped-record-leaves-its-tenant-and-origin-indexes",
        ),
        pytest.param(
            {
                by_status("completed"): Z({"c1:1": NOW - 5_000}),
                by_job("completed"): Z({"c1:1": NOW - 5_000}),
            },
            1,
            32,
            {by_job("completed"): Z({"c1:1": NOW - 5_000}), **indexed(NEW, NOW)},
            id="an-entry-whose-record-expired-leaves-the-status-index-only",
        ),
        pytest.param(
            {by_status("completed"): Z({"junk": NOW - 5_000})},
            1,
            32,
            indexed(NEW, NOW),
            id="a-member-without-an-attempt-leaves-the-status-index",
        ),
        pytest.param(
            {
                run_hash("c1"): {"1": "not json {"},
                by_status("completed"): Z({"c1:1": NOW - 5_000}),
                by_job("completed"): Z({"c1:1": NOW - 5_000}),
            },
            1,
            32,
            {by_job("completed"): Z({"c1:1": NOW - 5_000}), **indexed(NEW, NOW)},
            id="an-unreadable-record-is-dropped-with-its-status-entry",
        ),
        pytest.param(
            merge(
                {
                    by_status("running"): Z({"b1:1": PAST_FAILED_AGE, "b2:1": PAST_COMPLETED_AGE}),
                    by_job("running"): Z({"b1:1": PAST_FAILED_AGE, "b2:1": PAST_COMPLETED_AGE}),
                },
                indexed(C1, NOW - 5_000),
            ),
            2,
            32,
            {
                by_status("running"): Z({"b2:1": PAST_COMPLETED_AGE}),
                by_job("running"): Z({"b2:1": PAST_COMPLETED_AGE}),
                **indexed(NEW, NOW),
            },
            id="running-entries-age-out-at-the-failed-age-count-but-are-never-dropped",
        ),
    ],
)
def test_trim_runs(env: Env, given: State, cap: int, budget: int, after: State) -> None:
    env.seed(given)

    assert _run_put(env, NEW, cap=cap, budget=budget) == 1

    env.assert_state(after)


# == cancel =================================================================================
# cancel(m1) is handed the (queue, redis id) pairs m1 may sit at (kumiko derives a message's
# redis ids from its id) and reads only those. A message waiting in the lane queue (its list,
# suspects or a paused job's parked list) loses its body and its in-flight entry, its id
# noted as withdrawn (WITHDRAWN, or PARKED_WITHDRAWN while its job is paused) for the fetch
# or resume that meets it: the lists are never searched. One waiting on the delay queue's
# list loses its body; one held in a live worker's memory until due gets the cancel marker
# until due + GRACE (its move drops it); either way its run record says "cancelled" (no
# worker) and a dedup key it holds is freed (and leaves its index). Claimed from the lane
# queue: it runs, nothing changes. Not found: "ended" if m1 left a run record or a dead
# letter note, else "gone".
GRACE = 3_600_000
DEDUP_M1 = "kumiko:{p}:dedup:app:job:sync:k1"
DEDUP_M1_INDEX = "kumiko:{p}:dedupidx:app:job:sync"
KEYED_M1 = kumiko_message("m1", dedup_key="k1")
DELAYED_M1 = kumiko_message("m1", eta=NOW + 10_000)
HANDOFF_M5 = kumiko_message("m5", trigger="requeue", origin="m1")
CANCELLED_M5 = record("m5", 1, "cancelled", q=ENQUEUED_AT, en=NOW, o="m1", tr="requeue")
#: where cancel(m1) is told to look: r1 and r5 on the lane queue, d1 on its delay queue
PLACES = [QUEUE, "r1", DQ, "d1", QUEUE, "r5"]


@pytest.mark.parametrize(
    ("given", "reply", "after", "expiry"),
    [
        pytest.param({}, [0, "gone"], {}, {}, id="gone"),
        pytest.param(
            {LIST: ["r9"], MSGS: {"r9": kumiko_message("m1")}},
            [0, "gone"],
            {LIST: ["r9"], MSGS: {"r9": kumiko_message("m1")}},
            {},
            id="only-the-places-given-are-read",
        ),
        pytest.param(
            {MSGS: {"r1": kumiko_message("m9")}},
            [0, "gone"],
            {MSGS: {"r1": kumiko_message("m9")}},
            {},
            id="another-message-at-a-place-is-left-alone",
        ),
        pytest.param(
            indexed(CANCELLED_M1, NOW),
            [0, "ended"],
            indexed(CANCELLED_M1, NOW),
            {},
            id="ended-it-has-a-run-record",
        ),
        pytest.param(
            {"kumiko:{p}:dead:m1": "{}"},
            [0, "ended"],
            {"kumiko:{p}:dead:m1": "{}"},
            {},
            id="ended-it-has-a-dead-letter-note",
        ),
        pytest.param(
            {LIST: ["r0", "r1"], MSGS: {"r0": "b0", "r1": kumiko_message("m1")}},
            [1, QUEUE, "r1"],
            {
                LIST: ["r0", "r1"],
                MSGS: {"r0": "b0"},
                WITHDRAWN: {"r1"},
                **indexed(CANCELLED_M1, NOW),
            },
            {run_hash("m1"): COMPLETED_TTL},
            id="waiting-in-the-queue-body-deleted-id-withdrawn-record-cancelled",
        ),
        pytest.param(
            {
                SUSPECTS: ["r1"],
                MSGS: {"r1": kumiko_message("m1")},
                INFLIGHT: {"r1": earlier(1), "r2": entry(1)},
            },
            [1, QUEUE, "r1"],
            {
                SUSPECTS: ["r1"],
                WITHDRAWN: {"r1"},
                INFLIGHT: {"r2": entry(1)},
                **indexed(CANCELLED_M1, NOW),
            },
            {run_hash("m1"): COMPLETED_TTL},
            id="waiting-suspect-withdrawn-with-its-in-flight-entry",
        ),
        pytest.param(
            {**PAUSED_JOB, PARKED: ["r1", "r2"], MSGS: {"r1": kumiko_message("m1"), "r2": "b2"}},
            [1, QUEUE, "r1"],
            {
                **PAUSED_JOB,
                PARKED: ["r1", "r2"],
                PARKED_WITHDRAWN: {"r1"},
                MSGS: {"r2": "b2"},
                **indexed(CANCELLED_M1, NOW),
            },
            {run_hash("m1"): COMPLETED_TTL},
            id="parked-withdrawn-from-its-job",
        ),
        pytest.param(
            {MSGS: {"r1": kumiko_message("m1")}, ACKS_W2: {"r1"}, INFLIGHT: {"r1": entry(1)}},
            [0, "running"],
            {MSGS: {"r1": kumiko_message("m1")}, ACKS_W2: {"r1"}, INFLIGHT: {"r1": entry(1)}},
            {},
            id="claimed-from-the-lane-queue-runs-nothing-changed",
        ),
        pytest.param(
            {DQ_LIST: ["d1"], DQ_MSGS: {"d1": DELAYED_M1}},
            [1, DQ, "d1"],
            {DQ_LIST: ["d1"], **indexed(CANCELLED_M1, NOW)},
            {run_hash("m1"): COMPLETED_TTL},
            id="waiting-in-the-delay-queue-body-deleted",
        ),
        pytest.param(
            {DQ_MSGS: {"d1": DELAYED_M1}, DQ_ACKS_W2: {"d1"}},
            [1, DQ, "d1"],
            {
                DQ_MSGS: {"d1": DELAYED_M1},
                DQ_ACKS_W2: {"d1"},
                CANCEL_M1: "1",
                **indexed(CANCELLED_M1, NOW),
            },
            {CANCEL_M1: 10_000 + GRACE, run_hash("m1"): COMPLETED_TTL},
            id="held-until-due-by-a-live-worker-marked-until-due-plus-grace",
        ),
        pytest.param(
            {DQ_MSGS: {"d1": DELAYED_M1}, DQ_ACKS_W2: {"d1"}, CANCEL_M1: "1"},
            [0, "ended"],
            {DQ_MSGS: {"d1": DELAYED_M1}, DQ_ACKS_W2: {"d1"}, CANCEL_M1: "1"},
            {},
            id="held-until-due-and-marked-already-ended",
        ),
        pytest.param(
            {
                LIST: ["r1"],
                MSGS: {"r1": KEYED_M1},
                DEDUP_M1: {"id": "m1", "state": "queued"},
                DEDUP_M1_INDEX: Z({"k1": 5, "k2": 6}),
            },
            [1, QUEUE, "r1"],
            {
                LIST: ["r1"],
                WITHDRAWN: {"r1"},
                DEDUP_M1_INDEX: Z({"k2": 6}),
                **indexed(J({**CANCELLED_M1, "dk": "k1"}), NOW),
            },
            {run_hash("m1"): COMPLETED_TTL},
            id="its-dedup-key-is-freed-and-out-of-the-index",
        ),
        pytest.param(
            {
                LIST: ["r1"],
                MSGS: {"r1": KEYED_M1},
                DEDUP_M1: {"id": "m7", "state": "queued"},
                DEDUP_M1_INDEX: Z({"k1": 5}),
            },
            [1, QUEUE, "r1"],
            {
                LIST: ["r1"],
                WITHDRAWN: {"r1"},
                DEDUP_M1: {"id": "m7", "state": "queued"},
                DEDUP_M1_INDEX: Z({"k1": 5}),
                **indexed(J({**CANCELLED_M1, "dk": "k1"}), NOW),
            },
            {run_hash("m1"): COMPLETED_TTL},
            id="a-dedup-key-now-another-ids-is-kept",
        ),
        pytest.param(
            {LIST: ["r5"], MSGS: {"r5": HANDOFF_M5}},
            [1, QUEUE, "r5"],
            {LIST: ["r5"], WITHDRAWN: {"r5"}, **indexed(CANCELLED_M5, NOW)},
            {run_hash("m5"): COMPLETED_TTL, by_origin("m1"): LONG_TTL},
            id="a-hand-off-carrying-the-id-on-is-cancelled",
        ),
    ],
)
def test_cancel(
    env: Env, given: State, reply: list[Any], after: State, expiry: dict[str, int]
) -> None:
    env.seed(given)
    env.client.zadd(HEARTBEATS, {env.names["w2"]: ALIVE_AT})  # w2 is a live worker

    result = env.lua.cancel(
        keys=[NAMESPACE],
        args=[
            env.key(ROOT),
            "m1",
            NOW,
            COMPLETED_TTL,
            FAILED_TTL,
            GRACE,
            *(env.key(place) for place in PLACES),
        ],
    )

    assert text(result) == [env.key(item) if isinstance(item, str) else item for item in reply]
    env.assert_state(after)
    env.assert_expiry(expiry)


# == count_attempt ==========================================================================
ATTEMPTS = "kumiko:{p}:dashboard:signins:10.0.0.1"


@pytest.mark.parametrize(
    ("given", "ttl", "reply", "expiry"),
    [
        pytest.param(None, None, 1, TTL, id="first-attempt-opens-the-window"),
        pytest.param("4", SHORT_TTL, 5, SHORT_TTL, id="later-attempts-keep-the-window"),
        pytest.param("4", None, 5, TTL, id="a-counter-without-ttl-gets-one"),
    ],
)
def test_count_attempt(
    env: Env, given: str | None, ttl: int | None, reply: int, expiry: int
) -> None:
    if given is not None:
        env.seed({ATTEMPTS: given})
    if ttl is not None:
        env.expire(ATTEMPTS, ttl)

    assert env.lua.count_attempt(keys=[env.key(ATTEMPTS)], args=[TTL]) == reply

    env.assert_state({ATTEMPTS: str(reply)})
    env.assert_ttls({ATTEMPTS: expiry})


# == probe ==================================================================================
# The start-up permission check asks redis.acl_check_cmd about each command on each sample key:
# it runs nothing, so no key is read or written. With every command allowed the reply is
# empty. A command without a probe is named (so the probe table must cover every command of
# the rule set: the first row keeps it complete).
@pytest.mark.parametrize(
    ("commands", "reply"),
    [
        pytest.param(acl.commands(), [], id="every-command-of-the-rule-set-has-a-probe"),
        pytest.param(["zadd", "flushall"], ["unknown", "flushall", ""], id="no-probe-named"),
        pytest.param([], [], id="nothing-to-probe"),
    ],
)
def test_probe(env: Env, commands: list[str], reply: list[str]) -> None:
    samples = "\n".join([env.key(PROBE_DRAMATIQ), env.key(PROBE_KUMIKO)])
    result = env.lua.probe(keys=[], args=[samples, *commands])

    assert text(result) == reply
    env.assert_state({})
