"""What the state tables of this package share: the fake clock and TTLs, key templates, the
builders of messages, run records and index entries, and :class:`Env`, which runs a script
against a test's own keys and reads back the whole state (see the package docstring)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis

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
#: The last heartbeat of a worker presumed dead at NOW, and of one still alive.
DEAD_AT = NOW - HEARTBEAT_TIMEOUT - 1_000
ALIVE_AT = NOW - HEARTBEAT_TIMEOUT + 1_000

#: The TTL (ms) the scripts are asked to set, and a shorter one the tests seed beforehand:
#: a key left at <= SHORT_TTL was not refreshed, one near TTL was.
TTL = 600_000
SHORT_TTL = 5_000
#: How far below the TTL it was set to a PTTL may have fallen by the time it is read.
TTL_SLACK = 2_000
NO_TTL = -1

# key templates (filled by Env.key)
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
LOCK = "kumiko:{p}:lock:app.job"
LOCK_2 = "kumiko:{p}:lock:app.job2"
LOCK_3 = "kumiko:{p}:lock:app.job3"
INFLIGHT = "kumiko:{p}:inflight"
COUNTS = "dramatiq:{q}:counts"
#: a queue's counts hash ready, counting nothing (see Env.assert_state)
READY_COUNTS = {"~mode": "r"}
SUSPECTS = "kumiko:{p}:suspects:{q}"
PAUSED = "kumiko:{p}:paused"
PARKED = "kumiko:{p}:parked:app:job:sync"
CANCEL_M1 = "kumiko:{p}:cancel:m1"
BELL = "dramatiq:{q}:bell"
DQ_BELL = "dramatiq:{q}.DQ:bell"
SCHEDULE = "dramatiq:{q}.DQ:schedule"
#: The TTL (ms) of a doorbell's token, set when the token is pushed (never refreshed).
BELL_TTL = 60_000


PROBE_DRAMATIQ = "dramatiq:{p}-probe"
PROBE_KUMIKO = "kumiko:{p}:probe"

# run history (records: kumiko_dramatiq/history.py; keys: lua/_history.lua)
ROOT = "kumiko:{p}:"
JOB = "app:job:sync"  # retries=2: 3 attempts at most
TENANT_JOB = "app:job:nightly"  # per tenant, retries=1: 2 attempts at most
RUN_WORKER = "host-a:101"  # fetch_lane's ARGV[6] ("host:pid"), named in in-flight entries
OTHER_RUN_WORKER = "host-b:202"  # the worker of an earlier delivery (it died)
#: TTLs (ms) of completed and cancelled records, and of running, failed and dead ones; the
#: run indexes live 2 minutes longer than the longer of the two (INDEX_TTL_SLACK_MS in
#: include/history.lua: a settle that vouches for an index refreshed it less than a minute
#: ago).
COMPLETED_TTL = 300_000
FAILED_TTL = 900_000
INDEX_TTL_SLACK = 120_000
INDEX_TTL = max(COMPLETED_TTL, FAILED_TTL) + INDEX_TTL_SLACK
CAP = 100
#: fetch_lane dead-letters a message delivered this many times without an outcome.
MAX_DELIVERIES = 3
ENQUEUED_AT = NOW - 30_000
STARTED_AT = NOW - 20_000
#: The claim time of an earlier delivery (its worker died).
CLAIMED_AT = NOW - 90_000
TICK_AT = "2024-05-01T02:00:00+00:00"
#: A cron tick's fire time (epoch s), as cron_tick takes it.
TICK = 1_700_000_000
#: The times of index entries older than the completed and than the failed status age.
PAST_COMPLETED_AGE = NOW - COMPLETED_TTL - 1_000
PAST_FAILED_AGE = NOW - FAILED_TTL - 1_000
#: JOB paused (its messages are parked, not claimed).
PAUSED_JOB = {PAUSED: {JOB}}
#: A dedup record ending its run, with a follow-up (m5) to enqueue.
ENDING: dict[str, str] = {
    "id": "m1",
    "state": "ending",
    "fid": "m5",
    "fpayload": "{}",
    "ftrigger": "t2",
}


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


#: The end records of m1's first attempt, failed, and of its second, completed; and the
#: record cancel writes for m1 (never started: no start, no worker).
FAILED_M1 = ended(status="failed", et="ValueError", em="boom", tb="Traceback ...")
SECOND_ATTEMPT = ended(attempt=2)
CANCELLED_M1 = record("m1", 1, "cancelled", q=ENQUEUED_AT, en=NOW)


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
    """A run record's header for :meth:`Env.settle`, its fields tab-joined: root, message id,
    attempt, job, status, tenant, origin, completed TTL, failed TTL, cap, trim budget
    (:meth:`Env.settle` sends them where settle takes them: the root once per call, the
    header's fields with the delivery, tenant and origin among its extras, the TTLs, cap and
    trim in the batch head). A template (ROOT): :meth:`Env.key` fills it."""
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
    """A script reply (or a hash read) with bytes decoded (lists and dicts recursively)."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return [text(item) for item in value]
    if isinstance(value, dict):
        return {text(key): text(item) for key, item in value.items()}
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
        run_now: int | None = None,
        hold: tuple[str, ...] | None = None,
    ) -> Any:
        """fetch_lane as the broker calls it (ARGV[3] "<N> <held> <max deliveries> <completed
        TTL> <failed TTL>[ <run now>]", done prefix, root, host:pid, and with ``hold`` no
        caps TTL and the worker's hold block, ``lua/include/holds.lua``); the reply decoded."""
        spec = f"{count} {held} {MAX_DELIVERIES} {COMPLETED_TTL} {FAILED_TTL}"
        result = self.lua.fetch_lane(
            keys=[NAMESPACE, self.key(INFLIGHT), self.key(SUSPECTS)],
            args=[
                *self.head(worker=worker, now=now, maintenance=maintenance),
                spec if run_now is None else f"{spec} {run_now}",
                self.key(done_prefix),
                self.key(root),
                RUN_WORKER,
                *(() if hold is None else ("", *hold)),
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
        actor: str = "",
        dedup: str = "",
        tombstone_ttl: int | None = None,
        vouched: bool | None = None,
        result: str = "",
        batch: str = "",
    ) -> Any:
        """settle (of r1, message m1) as the broker calls it, a batch of one: ARGV[3] the
        batch head ("1 <marker TTL> <completed TTL> <failed TTL> <cap> <trim>", the TTLs, cap
        and trim from ``run_header``, :func:`header`'s old single-settle layout), then the
        kumiko root, then the delivery's 11 arguments: redis id, outcome, marker key, record
        header (message id, attempt, job, status, order score "" = now; all "" without
        ``run_header``), record, the message's actor name ("" = not known), "+" if its 9
        extras follow (as the broker sends them: only when one is not ""): tenant, origin,
        dead note, retry (queue, redis id, body), the dedup key it ended ("<index>\t<message
        id>\t<key>", keys unprefixed, or ""), the result it keeps ("<TTL ms> <JSON>", "-"
        or ""), its batch ("b <id>", "c <id>" or ""). With ``tombstone_ttl`` the head ends with
        it and an outcome other than "completed" carries r1's "sent" key (:data:`SENT`) as the
        broker sends it; without, "" (no tombstone). With ``vouched``, the head ends with "1" (the
        caller vouches for the record's job and status indexes: their TTLs are not refreshed)
        or "0" (after the tombstone TTL, the marker TTL when ``tombstone_ttl`` is None)."""
        completed_ttl, failed_ttl, cap, trim = COMPLETED_TTL, FAILED_TTL, CAP, 0
        root, record_header, tenant, origin = self.key(ROOT), [""] * 5, "", ""
        if run_header:
            fields = [self.key(field) for field in run_header.split("\t")]
            completed_ttl, failed_ttl, cap, trim = (int(f) for f in fields[7:11])
            root, record_header, tenant, origin = fields[0], [*fields[1:5], ""], *fields[5:7]
        retried = ["", "", ""] if retry is None else [self.key(retry[0]), retry[1], retry[2]]
        extras = [tenant, origin, self.encode(note), *retried, dedup, result, batch]
        args = [
            *self.head(worker=worker, now=now),
            f"1 {marker_ttl} {completed_ttl} {failed_ttl} {cap} {trim}"
            + ("" if tombstone_ttl is None else f" {tombstone_ttl}")
            + (
                ""
                if vouched is None
                else f"{'' if tombstone_ttl is not None else f' {marker_ttl}'} {int(vouched)}"
            ),
            root,
            rid,
            outcome,
            self.key(DONE_M1)
            if outcome == "completed"
            else ("" if tombstone_ttl is None else self.key(SENT)),
            *record_header,
            self.encode(run),
            actor,
            *(["+", *extras] if any(extras) else [""]),
        ]
        return self.lua.settle(keys=[NAMESPACE, self.key(INFLIGHT), self.key(SUSPECTS)], args=args)[
            0
        ]

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
        """Every key of this test's prefix (as the prefix fixture deletes them), decoded; the
        per-job stats counters left out (tests/integration/lua/test_run_stats.py)."""
        found: State = {}
        for pattern in (
            f"kumiko:{self.prefix}:*",
            f"dramatiq:{self.prefix}-*",
            f"dramatiq:__acks__.*.{self.prefix}-*",
        ):
            for raw in self.client.scan_iter(match=pattern, count=1000):
                key: str = text(raw)
                if key.startswith(f"kumiko:{self.prefix}:stats:"):
                    continue  # per-job stats counters: test_run_stats.py
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
        wanted = self.fill(expected)
        # a queue's counts start out ready at its first body (include/counts.lua): where a
        # table does not name them, they may be there, ready, and count nothing (its bodies
        # are stand-ins without an actor); the counts tests name them
        counts = self.key(COUNTS)
        if counts not in wanted and found.get(counts) == READY_COUNTS:
            del found[counts]
        assert found == wanted, "state differs: " + "; ".join(
            f"{key}: found {found.get(key, '(none)')!r}, expected {wanted.get(key, '(none)')!r}"
            for key in sorted(set(found) | set(wanted))
            if found.get(key) != wanted.get(key)
        )
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
        just now (it must exist), every other key has none; a run-history index
        (``<root>runs:...``) not in ``expected`` expects :data:`INDEX_TTL` (a write refreshes
        it to the longest record age plus the slack)."""
        filled = {self.key(template): ttl for template, ttl in expected.items()}
        present = set(self.state())
        index_prefix = self.key(ROOT) + "runs:"
        for key in present:
            if key.startswith(index_prefix) and key not in filled:
                if int(self.client.pttl(key)) == NO_TTL:
                    filled[key] = NO_TTL  # seeded, and not written by the script
                else:
                    filled[key] = INDEX_TTL
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


DEDUP_INDEX = "kumiko:{p}:dedupidx:app.job"


LOCKS = "kumiko:{p}:locks"


LOCKS_SINCE = "kumiko:{p}:locks:since"


WITHDRAWN = "dramatiq:{q}:withdrawn"


PARKED_WITHDRAWN = "kumiko:{p}:parked-withdrawn:app:job:sync"


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


HELD = {LOCKS: Z({"app.job": DueIn(TTL)}), LOCKS_SINCE: {"app.job": JustNow()}}


DEDUP_M1_INDEX = "kumiko:{p}:dedupidx:app:job:sync"


PLACES = [QUEUE, "r1", DQ, "d1", QUEUE, "r5"]


ATTEMPTS = "kumiko:{p}:dashboard:signins:10.0.0.1"
