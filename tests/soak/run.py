"""Soak under faults: nothing lost, nothing run twice, nothing stuck.

``python -m tests.soak.run --short`` (about a minute: CI) or ``--long`` (15 minutes of
load; ``--seconds N`` chooses), from the repository root. Exit status 0 iff no violation.

It starts a private ``redis-server`` on a free port of 127.0.0.1 (never another Redis:
the soak kills client connections), two ``dramatiq kumiko_dramatiq.app -p 1 -t 4``
worker processes and two ``kumiko_dramatiq.scheduler`` processes for
:mod:`tests.soak.app`, then for the chosen time dispatches a mix of jobs (parallel with
planned failures, per-tenant over 50 tenants, sequential, dedup-keyed bursts, batches whose
``on_complete`` checks that each child ended once and completed, chains of a step, a group and
a step that check ``ctx.previous_result``; the app
adds a cron job every second and a boot job) while a fault thread, seeded, injects:
SIGKILL of a worker (a new one starts at once), ``CLIENT KILL TYPE normal SKIPME yes``,
SIGTERM and restart of one scheduler (never both), malformed messages pushed
straight onto the queue (garbage bytes, an unknown actor, a kumiko actor with wrong
arguments, a kumiko message with forged options), and poison messages (a job whose
handler kills its own worker process: ``os._exit`` or a segfault), and a burst of
delayed jobs all due at one instant whose holder is SIGKILLed a few ms after that
instant, while it moves them from the delay queue to the queue. A supervisor restarts
at once any worker that exits on its own, as a real one would, and notes the death.
Then it stops the load and the schedulers, waits until the queues, delay queues,
suspect lists and ack sets are empty and every job is final, stops the workers
gracefully, waits out the lock TTL, and checks the handlers' records and what is left
in Redis (:mod:`tests.soak.check`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar, cast

import redis
from dramatiq.message import Message

from examples.redis_server import private_redis
from kumiko_dramatiq import JobRunner, KumikoError
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.ids import boot_message_id, child_message_id
from kumiko_dramatiq.messages import build_message

from . import check
from .app import (
    BACKOFF_MS,
    BATCH_DONE,
    BOOT,
    CAPPED,
    CAPPED_MAX_RUNNING,
    DEDUP,
    PARALLEL,
    PER_TENANT,
    POISON,
    RATED,
    RATED_COUNT,
    RATED_PER_MS,
    RETRIES,
    SEQUENTIAL,
    STEP,
    TENANTS,
    TICK,
    build_runner,
    records_key,
    registry,
)

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT_TIMEOUT_MS = 3_000
MAINTENANCE_CHANCE = 100_000
LOCK_TTL_MS = 3_000
MAX_ATTEMPTS = RETRIES + 1
SHORT_SECONDS = 40
LONG_SECONDS = 15 * 60
#: Dispatches per second, by kind (per-tenant: 50 children each).
RATES = {
    "parallel": 12.0,
    "sequential": 1.5,
    "dedup": 3.0,
    "per_tenant": 1 / 3,
    "capped": 8.0,
    "rated": 3.0,
    "batch": 0.5,
    "chain": 0.5,
}
DEDUP_KEYS = ("k0", "k1", "k2")
#: One round of faults; each round is shuffled, so every kind shows up every round.
FAULT_ROUND = (
    "worker_kill",
    "worker_kill",
    "client_kill",
    "client_kill",
    "scheduler_restart",
    "malformed_garbage",
    "malformed_unknown_actor",
    "malformed_wrong_args",
    "malformed_forged_options",
    "delayed_kill",
)
#: Poison messages: each round holds one, the kinds taking turns (each poison message
#: costs MAX_DELIVERIES worker deaths, each a heartbeat timeout before its redelivery).
POISON_FAULTS = ("poison_exit", "poison_segfault")
FAULT_KINDS = frozenset(FAULT_ROUND) | frozenset(POISON_FAULTS)
#: How a kumiko message's options are forged (``malformed_forged_options``).
FORGERIES = (
    "bogus backoff",
    "backoff without a delay",
    "negative delay",
    "tenant not a string",
    "no trigger",
    "actor name not a string",
    "options not an object",
    "another queue",
)
#: ``delayed_kill``: this many parallel jobs dispatched in one call, all due this long after
#: it; the worker holding most of them is SIGKILLed this many ms (uniform) after they are due.
BURST_SIZE = 40
BURST_DELAY_MS = 1_500
KILL_AFTER_DUE_MS = (1.0, 15.0)
#: Deaths that dead-letter a poison message (the default of ``KUMIKO_MAX_DELIVERIES``).
MAX_DELIVERIES = 5
#: How often the supervisor looks at the worker processes.
SUPERVISE_EVERY_S = 0.05
FAULT_GAP_S = (1.0, 4.0)
QUIESCENCE_S = 60 + LOCK_TTL_MS / 1000
#: What each kind of process logs once it runs (and handles SIGTERM).
READY = {"worker": b"is ready for action", "scheduler": b" started: "}
STOP_TIMEOUT_S = 30

#: Pushes a message the way Dramatiq's enqueue does, once: KEYS[3] remembers the push,
#: so a retry after a dropped connection does not push it twice.
PUSH_ONCE = """
if redis.call("set", KEYS[3], "1", "NX") then
    redis.call("hset", KEYS[1], ARGV[1], ARGV[2])
    redis.call("rpush", KEYS[2], ARGV[1])
    return 1
end
return 0
"""

T = TypeVar("T")


def say(text: str) -> None:
    print(f"soak: {text}", flush=True)


def retry_once(call: Callable[[], T]) -> T:
    """``call()``, again once if the connection was killed under it."""
    try:
        return call()
    except redis.ConnectionError:
        return call()


# -- Redis ---------------------------------------------------------------------------------------


class DoneMarkers(threading.Thread):
    """Notes when each "already completed" marker was first set (keyspace notifications)."""

    def __init__(self, url: str, prefix: str) -> None:
        super().__init__(name="soak-done-markers", daemon=True)
        self.url = url
        self.pattern = f"__keyspace@0__:kumiko:{prefix}:done:*"
        self.first_set: dict[str, float] = {}
        self.gaps = 0
        self.ready = threading.Event()
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            client = redis.Redis.from_url(self.url, socket_timeout=5)
            pubsub = client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call, unused-ignore]
            try:
                pubsub.psubscribe(self.pattern)
                self.ready.set()
                while not self.stopping.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is None or message["data"] != b"set":
                        continue
                    channel = message["channel"].decode()
                    self.first_set.setdefault(channel.split(":done:", 1)[1], time.time())
            except redis.ConnectionError:
                self.gaps += 1
            finally:
                pubsub.close()
                client.close()


# -- processes -----------------------------------------------------------------------------------


@dataclass
class Proc:
    role: str
    slot: int
    popen: subprocess.Popen[bytes]
    log: Path
    #: the soak stops or kills it: its exit is no death
    by_soak: bool = False
    #: when the supervisor found it dead (it exited on its own)
    died_at: float | None = None
    #: the child processes seen alive (Dramatiq's worker process)
    children: set[int] = field(default_factory=set)
    #: when the supervisor first saw one of them gone
    child_gone_at: float | None = None

    @property
    def pgid(self) -> int:
        return self.popen.pid


@dataclass
class Fleet:
    """The worker and scheduler processes, each the leader of its own process group."""

    env: dict[str, str]
    logs: Path
    workers: dict[int, Proc] = field(default_factory=dict)
    schedulers: dict[int, Proc] = field(default_factory=dict)
    #: the soak's SIGKILLs of workers
    kills: list[check.Kill] = field(default_factory=list)
    #: workers that exited on their own, when the supervisor noticed
    deaths: list[check.Kill] = field(default_factory=list)
    stuck: list[str] = field(default_factory=list)
    started: int = 0
    #: held while a worker is replaced (the fault thread and the supervisor both do)
    lock: threading.RLock = field(default_factory=threading.RLock)

    def start(self, role: str, slot: int) -> Proc:
        if role == "worker":
            # --worker-fork-timeout: Dramatiq's main process waits this long for its worker to
            # say it booted before it watches it; a poison message can kill the worker before
            # it says so, and the default 30 s would leave that dead group running meanwhile
            command = [
                *("-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "4"),
                *("--worker-fork-timeout", "500"),
            ]
        else:
            command = ["-m", "kumiko_dramatiq.scheduler"]
        with self.lock:
            self.started += 1
            log = self.logs / f"{role}-{slot}-{self.started:03d}.log"
            popen = subprocess.Popen(
                [sys.executable, *command],
                cwd=ROOT,
                env=self.env,
                stdout=log.open("wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            proc = Proc(role, slot, popen, log)
            (self.workers if role == "worker" else self.schedulers)[slot] = proc
            return proc

    def kill_worker(self, slot: int) -> None:
        """SIGKILL worker ``slot`` (its whole process group) and start a new one.

        A worker whose worker process had exited on its own already (the supervisor saw it
        gone and was waiting for the main process to follow) died then: that is noted as
        its death, at that time, not as a kill now."""
        with self.lock:
            proc = self.workers[slot]
            proc.by_soak = True
            _signal_group(proc.pgid, signal.SIGKILL)
            proc.popen.wait()
            if proc.died_at is not None:
                pass  # it had died on its own: that death is noted
            elif proc.child_gone_at is not None:
                proc.died_at = proc.child_gone_at
                self.deaths.append(check.Kill(proc.pgid, proc.died_at))
            else:
                self.kills.append(check.Kill(proc.pgid, time.time()))
            self.start("worker", slot)

    def supervise(self, *, restart: bool = True) -> None:
        """One look at the workers, as a supervisor: a worker whose main process exited on
        its own (Dramatiq's main process exits within a second or two of its worker
        process) is noted as a death and started anew. The death's time is when the
        supervisor first saw its worker process gone (a zombie or reaped), else when
        it saw the main process gone: at or after the death, and well before the
        heartbeat timeout lets its messages be delivered again."""
        with self.lock:
            for slot, proc in list(self.workers.items()):
                if proc.by_soak or proc.died_at is not None:
                    continue
                now = time.time()
                if proc.popen.poll() is None:
                    proc.children |= _children(proc.pgid)
                    if proc.child_gone_at is None and any(_gone(pid) for pid in proc.children):
                        proc.child_gone_at = now
                    if proc.child_gone_at is None or now - proc.child_gone_at < STOP_TIMEOUT_S:
                        continue
                    self.stuck.append(
                        f"worker {proc.pgid}: its main process did not exit within "
                        f"{STOP_TIMEOUT_S} s of its worker process"
                    )
                    _signal_group(proc.pgid, signal.SIGKILL)
                    proc.popen.wait()
                proc.died_at = now if proc.child_gone_at is None else proc.child_gone_at
                self.deaths.append(check.Kill(proc.pgid, proc.died_at))
                _signal_group(proc.pgid, signal.SIGKILL)  # stray children of the dead leader
                if restart:
                    self.start("worker", slot)

    def restart_scheduler(self, slot: int) -> None:
        self.stop(self.schedulers[slot])
        self.start("scheduler", slot)

    def stop(self, proc: Proc) -> None:
        """Once ``proc`` is ready, SIGTERM, then wait; SIGKILL (and note it as stuck)
        after ``STOP_TIMEOUT_S``.

        A process still starting has not installed its signal handlers: SIGTERM would
        kill it like SIGKILL, which is a fault of the soak, not of the product.
        """
        proc.by_soak = True
        if not self.wait_ready(proc):
            self.stuck.append(f"{proc.role} {proc.pgid} was not ready within {STOP_TIMEOUT_S} s")
        _signal_group(proc.pgid, signal.SIGTERM, leader_only=True)
        try:
            status = proc.popen.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.stuck.append(f"{proc.role} {proc.pgid} did not stop within {STOP_TIMEOUT_S} s")
            _signal_group(proc.pgid, signal.SIGKILL)
            proc.popen.wait()
            return
        if status != 0:
            self.stuck.append(f"{proc.role} {proc.pgid} exited with status {status} on SIGTERM")

    def wait_ready(self, proc: Proc) -> bool:
        """Wait (bounded) until ``proc`` logged that it runs; ``False`` if it never did."""
        marker = READY[proc.role]
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while marker not in proc.log.read_bytes():
            if proc.popen.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def kill_all(self) -> None:
        for proc in [*self.workers.values(), *self.schedulers.values()]:
            if proc.popen.poll() is None:
                _signal_group(proc.pgid, signal.SIGKILL)
                proc.popen.wait()
            else:
                _signal_group(proc.pgid, signal.SIGKILL)  # stray children of a dead leader

    def exited(self, roles: Collection[str] = ("worker", "scheduler")) -> list[str]:
        """The current processes of ``roles`` that have exited, but for the workers whose
        death the supervisor noted."""
        return [
            f"{proc.role} {proc.slot} (exit {proc.popen.returncode})"
            for proc in [*self.workers.values(), *self.schedulers.values()]
            if proc.role in roles and proc.died_at is None and proc.popen.poll() is not None
        ]


class Supervisor(threading.Thread):
    """Calls :meth:`Fleet.supervise` every :data:`SUPERVISE_EVERY_S` until stopped."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(name="soak-supervisor", daemon=True)
        self.fleet = fleet
        self.stopping = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stopping.wait(SUPERVISE_EVERY_S):
            try:
                self.fleet.supervise()
            except Exception as exc:  # reported, and the supervisor goes on
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self.stopping.set()
        self.join()
        self.fleet.supervise(restart=False)


def _children(pid: int) -> set[int]:
    """The child processes of ``pid`` (empty once it is gone)."""
    found: set[int] = set()
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found.update(int(item) for item in path.read_text().split())
        except OSError:
            continue
    return found


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


def _signal_group(pgid: int, signum: int, *, leader_only: bool = False) -> None:
    try:
        if leader_only:
            os.kill(pgid, signum)
        else:
            os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


# -- the load -------------------------------------------------------------------------------------


@dataclass
class Ledger:
    """What the driver dispatched and what it therefore expects."""

    expected: list[check.Expected] = field(default_factory=list)
    keyed: list[check.KeyedDispatch] = field(default_factory=list)
    wrappers: list[int] = field(default_factory=list)
    dispatched: Counter[str] = field(default_factory=Counter)
    uncertain: list[str] = field(default_factory=list)
    dedup_ids: set[str] = field(default_factory=set)
    #: (time before the call, kind, n, message id) of every dispatch, for post-mortems.
    log: list[tuple[float, str, int, str]] = field(default_factory=list)
    next_n: int = 0

    def token(self) -> int:
        self.next_n += 1
        return self.next_n


class Load:
    """Dispatches the mix at :data:`RATES` (seeded), keeping the ledger."""

    def __init__(self, producer: JobRunner, rng: random.Random, ledger: Ledger) -> None:
        self.producer = producer
        self.rng = rng
        self.ledger = ledger
        self.hot_key = DEDUP_KEYS[0]
        self.hot_until = 0.0

    def run_for(self, seconds: float) -> None:
        start = time.monotonic()
        end = start + seconds
        due = {kind: start + self.rng.uniform(0, 1 / rate) for kind, rate in RATES.items()}
        while True:
            kind = min(due, key=due.__getitem__)
            if due[kind] >= end:
                return
            pause = due[kind] - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            getattr(self, kind)()
            due[kind] += self.rng.expovariate(RATES[kind])

    def _dispatch(self, kind: str, job: str, payload: dict[str, Any], **kw: Any) -> str | None:
        at = time.time()
        try:
            message_id = self.producer.dispatch(job, payload, **kw)
        except KumikoError as exc:
            self.ledger.uncertain.append(f"{kind} n={payload['n']}: {exc}")
            return None
        self.ledger.dispatched[kind] += 1
        self.ledger.log.append((at, kind, payload["n"], message_id))
        return message_id

    def parallel(self) -> None:
        n = self.ledger.token()
        fail_first = self.rng.choices([0, 1, 2, 3], weights=[60, 20, 10, 10])[0]
        payload = {"n": n, "fail_first": fail_first, "sleep_ms": self.rng.choice([0, 0, 5, 20, 50])}
        if self._dispatch("parallel", PARALLEL, payload) is not None:
            self.ledger.expected.append(
                check.Expected(f"parallel n={n}", PARALLEL, fail_first, MAX_ATTEMPTS, n=n)
            )

    def sequential(self) -> None:
        n = self.ledger.token()
        fail_first = self.rng.choices([0, 1, 3], weights=[80, 15, 5])[0]
        payload = {"n": n, "fail_first": fail_first, "sleep_ms": self.rng.randint(30, 120)}
        if self._dispatch("sequential", SEQUENTIAL, payload) is not None:
            self.ledger.expected.append(
                check.Expected(f"sequential n={n}", SEQUENTIAL, fail_first, MAX_ATTEMPTS, n=n)
            )

    def capped(self) -> None:
        n = self.ledger.token()
        fail_first = self.rng.choices([0, 1, 3], weights=[80, 15, 5])[0]
        payload = {"n": n, "fail_first": fail_first, "sleep_ms": self.rng.randint(20, 150)}
        if self._dispatch("capped", CAPPED, payload) is not None:
            self.ledger.expected.append(
                check.Expected(f"capped n={n}", CAPPED, fail_first, MAX_ATTEMPTS, n=n)
            )

    def rated(self) -> None:
        n = self.ledger.token()
        fail_first = self.rng.choices([0, 1], weights=[85, 15])[0]
        payload = {"n": n, "fail_first": fail_first, "sleep_ms": self.rng.choice([0, 5, 20])}
        if self._dispatch("rated", RATED, payload) is not None:
            self.ledger.expected.append(
                check.Expected(f"rated n={n}", RATED, fail_first, MAX_ATTEMPTS, n=n)
            )

    def dedup(self) -> None:
        now = time.monotonic()
        if now >= self.hot_until:
            self.hot_key, self.hot_until = self.rng.choice(DEDUP_KEYS), now + 2.0
        key = self.hot_key if self.rng.random() < 0.8 else self.rng.choice(DEDUP_KEYS)
        n = self.ledger.token()
        fail_first = 1 if key == "k1" else 0
        payload = {"n": n, "fail_first": fail_first, "sleep_ms": 300}
        at = time.time()
        message_id = self._dispatch("dedup", DEDUP, payload, dedup_key=key)
        if message_id is None:
            return
        self.ledger.keyed.append(check.KeyedDispatch(message_id, at))
        if message_id not in self.ledger.dedup_ids:
            self.ledger.dedup_ids.add(message_id)
            self.ledger.expected.append(
                check.Expected(
                    f"dedup key {key} {message_id}",
                    DEDUP,
                    fail_first,
                    MAX_ATTEMPTS,
                    message_id=message_id,
                )
            )

    def _step(self, **extra: Any) -> tuple[dict[str, Any], check.Expected]:
        n = self.ledger.token()
        fail_first = self.rng.choices([0, 1, 2], weights=[70, 20, 10])[0]
        payload = {
            "n": n,
            "fail_first": fail_first,
            "sleep_ms": self.rng.choice([0, 5, 20]),
            **extra,
        }
        return payload, check.Expected(f"step n={n}", STEP, fail_first, MAX_ATTEMPTS, n=n)

    def _composed(
        self, kind: str, dispatch: Callable[[], str], expected: list[check.Expected]
    ) -> None:
        at = time.time()
        try:
            composed_id = dispatch()
        except KumikoError as exc:  # all or none: nothing of it runs
            self.ledger.uncertain.append(f"{kind}: {exc}")
            return
        self.ledger.dispatched[kind] += 1
        self.ledger.log.append((at, kind, expected[0].n or 0, composed_id))
        self.ledger.expected.extend(expected)

    def batch(self) -> None:
        """A batch of 2-8 steps and an on_complete that checks their ends (exactly once)."""
        children = [self._step() for _ in range(self.rng.randint(2, 8))]
        n = self.ledger.token()
        done = {"n": n, "children": [payload["n"] for payload, _ in children]}
        self._composed(
            "batch",
            lambda: self.producer.dispatch_batch(
                [(STEP, payload) for payload, _ in children], on_complete=(BATCH_DONE, done)
            ),
            [*(expected for _, expected in children),
             check.Expected(f"batch n={n} on_complete", BATCH_DONE, 0, MAX_ATTEMPTS, n=n)],
        )  # fmt: skip

    def chain(self) -> None:
        """A chain: a step, a group of two, a step; each sees the step before's value."""
        first = self._step()
        group = [self._step(previous=first[0]["n"]) for _ in range(2)]
        last = self._step(previous=[payload["n"] for payload, _ in group])
        self._composed(
            "chain",
            lambda: self.producer.dispatch_chain(
                [(STEP, first[0]), [(STEP, payload) for payload, _ in group], (STEP, last[0])]
            ),
            [first[1], *(expected for _, expected in group), last[1]],
        )

    def per_tenant(self) -> None:
        n = self.ledger.token()
        failing = sorted(self.rng.sample(TENANTS, 5))
        payload = {"n": n, "fail_first": 1, "fail_tenants": failing}
        if self._dispatch("per_tenant", PER_TENANT, payload) is None:
            return
        self.ledger.wrappers.append(n)
        for tenant in TENANTS:
            self.ledger.expected.append(
                check.Expected(
                    f"per_tenant n={n} {tenant}",
                    PER_TENANT,
                    1 if tenant in failing else 0,
                    MAX_ATTEMPTS,
                    n=n,
                    tenant=tenant,
                )
            )


# -- the faults -----------------------------------------------------------------------------------


def deal(round_number: int, skip: Collection[str], rng: random.Random) -> list[str]:
    """Round ``round_number`` (from 0) of faults, shuffled: :data:`FAULT_ROUND` and one
    of :data:`POISON_FAULTS`, the kinds taking turns; kinds in ``skip`` left out."""
    deck = [kind for kind in FAULT_ROUND if kind not in skip]
    poisons = [kind for kind in POISON_FAULTS if kind not in skip]
    if poisons:
        deck.append(poisons[round_number % len(poisons)])
    rng.shuffle(deck)
    return deck


class Faults(threading.Thread):
    """Injects one fault every 1-4 s, in shuffled rounds (:func:`deal`)."""

    def __init__(
        self,
        fleet: Fleet,
        client: redis.Redis,
        producer: JobRunner,
        prefix: str,
        rng: random.Random,
        skip: set[str],
    ) -> None:
        super().__init__(name="soak-faults", daemon=True)
        self.fleet = fleet
        self.client = client
        self.producer = producer
        self.prefix = prefix
        self.queue = f"{prefix}-worker"
        self.rng = rng
        self.skip = skip
        self.counts: Counter[str] = Counter()
        self.malformed: list[check.Malformed] = []
        self.poisons: list[check.Poison] = []
        #: the delayed bursts of ``delayed_kill``, and how their jobs must end
        self.bursts: list[check.DelayedBurst] = []
        self.expected: list[check.Expected] = []
        #: what ``delayed_kill`` could not do as planned
        self.burst_notes: list[str] = []
        self.rounds = 0
        self.clients_killed = 0
        self.client_kills_at: list[float] = []
        self.errors: list[str] = []
        self.stopping = threading.Event()
        self._push_once = client.register_script(PUSH_ONCE)

    def run(self) -> None:
        deck: list[str] = []
        while not self.stopping.wait(self.rng.uniform(*FAULT_GAP_S)):
            if not deck:
                deck = deal(self.rounds, self.skip, self.rng)
                self.rounds += 1
                if not deck:
                    return
            kind = deck.pop()
            try:
                getattr(self, kind)()
            except Exception as exc:  # a fault that could not be injected is reported
                self.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
                continue
            self.counts[kind] += 1

    def worker_kill(self) -> None:
        self.fleet.kill_worker(self.rng.choice(sorted(self.fleet.workers)))

    def delayed_kill(self) -> None:
        """:data:`BURST_SIZE` parallel jobs (a quarter failing once: their retries are
        delayed messages too) due :data:`BURST_DELAY_MS` after one ``dispatch_many``, and a
        SIGKILL, 1-15 ms after they are due, of a worker whose delay-queue consumer may be
        moving them from the schedule to the queue (``lua/move.lua``, a batch per call), before
        or after each step (the worker holding most of them in memory, where an older version
        left delayed messages in workers' memory). Their ids go to check 2
        (:class:`DelayedBurst`)."""
        number = len(self.bursts) + len(self.burst_notes) + 1
        payloads = [
            {"n": -(number * 1_000 + index), "fail_first": self.rng.choice([0, 0, 0, 1])}
            for index in range(BURST_SIZE)
        ]
        message_ids = self.producer.dispatch_many(PARALLEL, payloads, delay_ms=BURST_DELAY_MS)
        due = time.time() + BURST_DELAY_MS / 1000  # every eta is at or before this
        for payload, message_id in zip(payloads, message_ids, strict=True):
            self.expected.append(
                check.Expected(
                    f"delayed n={payload['n']}",
                    PARALLEL,
                    payload["fail_first"],
                    MAX_ATTEMPTS,
                    n=payload["n"],
                    message_id=message_id,
                )
            )
        time.sleep(max(0.0, due - 0.3 - time.time()))  # the burst is fetched by now
        holder = self._delay_holder()
        if holder is None:
            # Delayed messages wait on the schedule, held by no worker: kill any worker as they
            # come due (its delay-queue consumer may be in the middle of a move step)
            with self.fleet.lock:
                slot = self.rng.choice(sorted(self.fleet.workers))
                pgid = self.fleet.workers[slot].pgid
            time.sleep(max(0.0, due + self.rng.uniform(*KILL_AFTER_DUE_MS) / 1000 - time.time()))
            with self.fleet.lock:
                if self.fleet.workers[slot].pgid != pgid:
                    self.burst_notes.append(f"burst {number}: worker {pgid} died before the kill")
                    return
                self.fleet.kill_worker(slot)
            self.bursts.append(check.DelayedBurst(tuple(message_ids), due, pgid, 0, 0))
            return
        slot, pgid, acks, held = holder
        time.sleep(max(0.0, due + self.rng.uniform(*KILL_AFTER_DUE_MS) / 1000 - time.time()))
        with self.fleet.lock:
            if self.fleet.workers[slot].pgid != pgid:
                self.burst_notes.append(f"burst {number}: its holder {pgid} died before the kill")
                return
            self.fleet.kill_worker(slot)
        unmoved = int(retry_once(lambda: self.client.scard(acks)))
        self.bursts.append(check.DelayedBurst(tuple(message_ids), due, pgid, held, unmoved))

    def _delay_holder(self) -> tuple[int, int, str, int] | None:
        """The worker (slot, process group) whose delay-queue consumer holds the most delayed
        messages, its ack set of the delay queue and how many it holds; ``None`` if no
        worker's can be told (its liveness entry names its pid)."""
        best: tuple[int, str] | None = None
        for raw in self.client.scan_iter(match=f"dramatiq:__acks__.*.{self.queue}.DQ"):
            acks = _text(raw)
            count = int(self.client.scard(acks))
            if best is None or count > best[0]:
                best = (count, acks)
        if best is None:
            return None
        held, acks = best
        broker_id = acks.removeprefix("dramatiq:__acks__.").removesuffix(f".{self.queue}.DQ")
        entry = self.client.get(keys.process(self.prefix, broker_id))
        try:
            pgid = os.getpgid(int(json.loads(entry or b"null")["pid"]))
        except (TypeError, KeyError, ValueError, ProcessLookupError):
            return None
        for slot, proc in self.fleet.workers.items():
            if proc.pgid == pgid and proc.popen.poll() is None:
                return slot, pgid, acks, held
        return None

    def poison_exit(self) -> None:
        self._poison("exit")

    def poison_segfault(self) -> None:
        self._poison("segfault")

    def _poison(self, how: str) -> None:
        at = time.time()
        message_id = self.producer.dispatch(POISON, {"how": how})
        self.poisons.append(check.Poison(how, message_id, at))

    def client_kill(self) -> None:
        killed = self.client.client_kill_filter(_type="normal", skipme=True)
        self.clients_killed += int(killed)
        self.client_kills_at.append(time.time())

    def scheduler_restart(self) -> None:
        self.fleet.restart_scheduler(self.rng.choice(sorted(self.fleet.schedulers)))

    def malformed_garbage(self) -> None:
        token = f"soak-garbage-{uuid.uuid4().hex[:12]}"
        data = b"\xff\xfe\x00" + token.encode() + b" {not json"
        self._push("garbage", token, data, needle=token)

    def malformed_unknown_actor(self) -> None:
        actor = f"soak:job:ghost_{uuid.uuid4().hex[:12]}"
        rid = f"soak-unknown-{uuid.uuid4().hex}"
        message: Message[Any] = Message(
            queue_name=self.queue,
            actor_name=actor,
            args=({},),
            kwargs={},
            options={"redis_message_id": rid},
        )
        self._push(
            "unknown_actor", rid, message.encode(), needle=actor, message_id=message.message_id
        )

    def malformed_wrong_args(self) -> None:
        job = registry.jobs[self.rng.choice([PARALLEL, SEQUENTIAL, DEDUP, PER_TENANT])]
        rid = f"soak-wrongargs-{uuid.uuid4().hex}"
        message_id = f"soak-wrongargs-{uuid.uuid4().hex[:12]}"
        message = build_message(
            job, {}, queue_prefix=self.prefix, trigger="manual", message_id=message_id
        )
        variant = self.rng.choice(["no args", "a string", "two args", "kwargs", "bad options"])
        if variant == "no args":
            message = message.copy(args=())
        elif variant == "a string":
            message = message.copy(args=("not an object",))
        elif variant == "two args":
            message = message.copy(args=({}, 1))
        elif variant == "kwargs":
            message = message.copy(kwargs={"payload": {}})
        else:
            message = message.copy(options={"kumiko_failures": "many"})
        if job.options.per_tenant and self.rng.random() < 0.5:
            message = message.copy(actor_name=job.wrapper_actor_name)
        message = message.copy(options={"redis_message_id": rid})
        self._push(
            "wrong_args",
            rid,
            message.encode(),
            needle=f"dead-lettering message {message_id}",
            message_id=message_id,
        )

    def malformed_forged_options(self) -> None:
        """A message of a real soak job whose kumiko options (or Dramatiq fields) were
        forged in one of the :data:`FORGERIES` ways."""
        job = registry.jobs[self.rng.choice([PARALLEL, SEQUENTIAL, DEDUP, PER_TENANT])]
        forgery = self.rng.choice(FORGERIES)
        rid = f"soak-forged-{uuid.uuid4().hex}"
        message_id = f"soak-forged-{uuid.uuid4().hex[:12]}"
        tenant = TENANTS[0] if job.options.per_tenant else None
        message = build_message(
            job,
            {},
            queue_prefix=self.prefix,
            trigger="manual",
            message_id=message_id,
            tenant_id=tenant,
        )
        fields = message.asdict()
        options = fields["options"] = {**message.options, "redis_message_id": rid}
        if forgery == "bogus backoff":
            options["kumiko_backoff"] = "bogus"
        elif forgery == "backoff without a delay":
            options.update(kumiko_backoff="fixed", kumiko_backoff_delay_ms=None)
        elif forgery == "negative delay":
            options.update(kumiko_backoff="fixed", kumiko_backoff_delay_ms=-BACKOFF_MS)
        elif forgery == "tenant not a string":
            options["kumiko_tenant_id"] = 7
        elif forgery == "no trigger":
            del options["kumiko_trigger"]
        elif forgery == "actor name not a string":
            fields["actor_name"] = 42
        elif forgery == "options not an object":
            fields["options"] = [rid]
        else:
            fields["queue_name"] = f"{self.prefix}-elsewhere"
        self._push(
            "forged_options",
            rid,
            json.dumps(fields, separators=(",", ":")).encode(),
            needle=f"dead-lettering message {message_id}",
            message_id=message_id,
        )

    def _push(
        self, kind: str, rid: str, data: bytes, *, needle: str, message_id: str | None = None
    ) -> None:
        keys = [
            f"dramatiq:{self.queue}.msgs",
            f"dramatiq:{self.queue}",
            f"kumiko:{self.prefix}:soak:pushed:{rid}",
        ]
        retry_once(lambda: self._push_once(keys=keys, args=[rid, data]))
        self.malformed.append(check.Malformed(kind, rid, needle, time.time(), message_id))


# -- waiting and gathering ----------------------------------------------------------------------


class Records:
    """The handlers' records, read incrementally."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.key = records_key(prefix)
        self.items: list[dict[str, Any]] = []

    def refresh(self) -> list[dict[str, Any]]:
        start = len(self.items)
        raw = retry_once(lambda: self.client.lrange(self.key, start, -1))
        self.items += [json.loads(item) for item in raw]
        return self.items


def leftovers(client: redis.Redis, prefix: str, queue: str) -> list[str]:
    """Messages still in the queue, its delay queue, its suspects list or any ack set,
    described."""
    found: list[str] = []

    def describe(name: str, rid: bytes | str) -> str:
        base = name.removesuffix(".DQ")
        data = client.hget(f"dramatiq:{base}.msgs", rid) or client.hget(
            f"dramatiq:{base}.DQ.msgs", rid
        )
        try:
            fields = json.loads(data or b"null")
            what = f"{fields['actor_name']} {fields['message_id']} options {fields['options']}"
        except Exception:
            what = repr(data)[:80]
        return f"{_text(rid)}: {what}"

    for rid in client.lrange(keys.suspects(prefix, queue), 0, 20):
        found.append(f"suspect of {queue}: {describe(queue, rid)}")
    for name in (queue, f"{queue}.DQ"):
        for rid in client.lrange(f"dramatiq:{name}", 0, 20):
            found.append(f"queued on {name}: {describe(name, rid)}")
        count = client.hlen(f"dramatiq:{name}.msgs")
        if count:
            found.append(f"{count} message(s) in dramatiq:{name}.msgs")
    for key in client.scan_iter(match=f"dramatiq:__acks__.*.{queue}*", count=1000):
        name = queue + (".DQ" if key.endswith(b".DQ") else "")
        for rid in list(client.smembers(key))[:20]:
            found.append(f"unacked in {key.decode()}: {describe(name, rid)}")
    return found


def wait_until_quiet(
    client: redis.Redis, prefix: str, queue: str, records: Records, ledger: Ledger, seconds: float
) -> tuple[list[str], int]:
    """Wait (bounded) until nothing is queued or unacked and every job is final.

    Returns what is still left and how many jobs are not final.
    """
    deadline = time.monotonic() + seconds
    while True:
        left = retry_once(lambda: leftovers(client, prefix, queue))
        runs, _ = check.assemble_runs(records.refresh())
        index = check.RunIndex(runs)
        open_jobs = sum(
            1 for item in ledger.expected if not check.is_terminal(item, index.of(item))
        )
        if (not left and not open_jobs) or time.monotonic() >= deadline:
            return left, open_jobs
        time.sleep(0.5)


_MISFIRE = re.compile(
    r"cron misfire: job=(?P<job>\S+): (?:\d+ missed tick\(s\) from (?P<cfrom>\S+) coalesced "
    r"into tick (?P<cinto>\S+)|missed ticks from (?P<sfrom>\S+) through (?P<sthrough>\S+) skipped)"
)


def misfired_ranges(log_text: str, job: str) -> list[tuple[float, float]]:
    """Tick ranges the schedulers logged as coalesced (not enqueued) or skipped."""
    ranges = []
    for match in _MISFIRE.finditer(log_text):
        if match["job"] != job:
            continue
        if match["cfrom"]:
            first = datetime.fromisoformat(match["cfrom"]).timestamp()
            last = datetime.fromisoformat(match["cinto"]).timestamp() - 1
        else:
            first = datetime.fromisoformat(match["sfrom"]).timestamp()
            last = datetime.fromisoformat(match["sthrough"]).timestamp()
        ranges.append((first, last))
    return ranges


_NOISE = re.compile(r"\b[0-9a-f]{8}-[0-9a-f-]{27}\b|\b\d+(\.\d+)?\b|0x[0-9a-f]+")
_LEVEL = re.compile(r"\[(WARNING|ERROR|CRITICAL)\] (.*)|\b(WARNING|ERROR|CRITICAL) (\S+: .*)")


#: Log lines the planned failures cause by the hundred (their tracebacks are counted instead).
_EXPECTED = ("Failed to process message", "SoakFailure")


def log_digest(log_text: str, limit: int = 12) -> list[str]:
    """The most frequent warning/error lines of the logs (numbers and ids blanked),
    leaving out those of the planned failures, then the tracebacks by the exception
    that ended them."""
    lines: Counter[str] = Counter()
    tracebacks: Counter[str] = Counter()
    pending: str | None = None
    in_traceback = False
    for line in log_text.splitlines():
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
            continue
        if in_traceback and line and not line.startswith(" "):
            if line.startswith(("The above exception", "During handling")):
                continue
            pending, in_traceback = line.split(":", 1)[0], False
            continue
        if line.startswith("["):
            if pending is not None:
                tracebacks[pending] += 1
                pending = None
            match = _LEVEL.search(line)
            if match is not None and not any(text in line for text in _EXPECTED):
                text = _NOISE.sub("#", match[2] or match[4])[:110]
                lines[f"{match[1] or match[3]} {text}"] += 1
    if pending is not None:
        tracebacks[pending] += 1
    digest = [f"{count:6d} x {text}" for text, count in lines.most_common(limit)]
    digest += [
        f"{count:6d} x traceback ending in {name}" for name, count in tracebacks.most_common()
    ]
    return digest


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def dead_letters(client: redis.Redis, queue: str) -> tuple[set[str], dict[str, check.DeadLetter]]:
    """The queue's dead-letter set: its redis ids, and by message id (of the bodies that
    decode) the redis id and when it was dead-lettered."""
    scored = client.zrange(f"dramatiq:{queue}.XQ", 0, -1, withscores=True)
    at = {_text(rid): float(score) / 1000 for rid, score in cast(list[Any], scored)}
    letters = {}
    for rid, data in client.hgetall(f"dramatiq:{queue}.XQ.msgs").items():
        try:
            message_id = str(json.loads(data)["message_id"])
        except Exception:
            continue
        letters[message_id] = check.DeadLetter(_text(rid), at.get(_text(rid), math.inf))
    return set(at), letters


def still_running(client: redis.Redis, prefix: str) -> list[str]:
    """The run-history records in the "running" index, described."""
    found = []
    for member in client.zrange(f"kumiko:{prefix}:runs:status:running", 0, -1):
        message_id, _, attempt = _text(member).rpartition(":")
        record = client.hget(f"kumiko:{prefix}:run:{message_id}", attempt)
        try:
            fields = json.loads(record or b"null")
            what = (
                f"{fields.get('j')} status {fields.get('s')} worker {fields.get('w')} "
                f"deliveries {fields.get('n')} trigger {fields.get('tr')}"
            )
        except Exception:
            what = repr(record)[:80]
        found.append(f"{_text(member)}: {what}")
    return found


def scan_keys(client: redis.Redis, prefix: str) -> list[tuple[str, int]]:
    found = []
    for key in client.scan_iter(match=f"kumiko:{prefix}:*", count=1000):
        found.append((key.decode(), int(client.pttl(key))))
    return found


def scan_queue_keys(client: redis.Redis, prefix: str) -> list[tuple[str, int]]:
    """Every key of the prefix's queues in Dramatiq's layout (``dramatiq:{prefix}-...``:
    lists, message hashes, delay and dead-letter queues, doorbells) with its ``PTTL``."""
    found = []
    for key in client.scan_iter(match=f"dramatiq:{prefix}-*", count=1000):
        found.append((key.decode(), int(client.pttl(key))))
    return found


def inflight_entries(client: redis.Redis, prefix: str, limit: int = 5) -> list[str]:
    """The in-flight hash's entries (redis id -> deliveries|claimed ms|worker), described."""
    entries = client.hgetall(keys.inflight(prefix))
    described = [f"{_text(rid)}={_text(value)}" for rid, value in list(entries.items())[:limit]]
    return [f"{len(entries)} in-flight entries left: {described}"] if entries else []


def guarded_ids(
    prefix: str, ledger: Ledger, index: check.RunIndex, scheduler_logs: str
) -> set[str]:
    """The message ids that may carry an enqueue guard: the boot job's, every fan-out child's
    (of each wrapper dispatched, and each child that ran) and every cron tick's (each one a
    scheduler logged as enqueued, and each that ran)."""
    ids = {boot_message_id(BOOT, prefix)}
    for _, kind, _, message_id in ledger.log:
        if kind == "per_tenant":
            ids.update(child_message_id(message_id, tenant) for tenant in TENANTS)
    ids.update(run.message_id for run in index.of_job(PER_TENANT) if run.tenant is not None)
    ids.update(run.message_id for run in index.of_job(TICK))
    ids.update(match["id"] for match in _TICK_ENQUEUED.finditer(scheduler_logs))
    return ids


_TICK_ENQUEUED = re.compile(r"cron tick enqueued: job=\S+ tick=\S+ message_id=(?P<id>[0-9a-f-]+)")
_DROPPED = re.compile(r"message (?P<id>\S+) on \S+ already completed: acked without running it")


def completed_drops(log_text: str) -> dict[str, int]:
    """Message id -> how many copies of it a fetch acked unrun as already completed (the
    workers' WARNING lines)."""
    return dict(Counter(match["id"] for match in _DROPPED.finditer(log_text)))


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.soak.run", description=__doc__)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--short", action="store_true", help=f"{SHORT_SECONDS} s of load (CI)")
    mode.add_argument("--long", action="store_true", help=f"{LONG_SECONDS} s of load (default)")
    parser.add_argument("--seconds", type=float, help="seconds of load (overrides the mode)")
    parser.add_argument("--seed", type=int, help="random seed (printed; default: random)")
    parser.add_argument(
        "--skip-faults",
        default="",
        help="comma-separated fault kinds to leave out: " + ", ".join(sorted(FAULT_KINDS)),
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    unknown = set(filter(None, args.skip_faults.split(","))) - FAULT_KINDS
    if unknown:
        parser.error(f"unknown fault kinds: {sorted(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    seconds = args.seconds or (SHORT_SECONDS if args.short else LONG_SECONDS)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    skip = set(filter(None, args.skip_faults.split(",")))
    prefix = f"soak{uuid.uuid4().hex[:6]}"
    workdir = Path(tempfile.mkdtemp(prefix="kumiko-soak-"))
    say(f"seed {seed}, {seconds:.0f} s of load, prefix {prefix}, work dir {workdir}")
    if skip:
        say(f"leaving out faults: {', '.join(sorted(skip))}")
    status = 1
    try:
        # Keyspace notifications for string commands: the driver watches completed markers.
        with private_redis("--notify-keyspace-events", "K$", workdir=workdir) as url:
            status = soak(url, prefix, workdir, seconds, seed, skip)
    finally:
        if status == 0 and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"logs and records kept in {workdir}")
    return status


def soak(url: str, prefix: str, workdir: Path, seconds: float, seed: int, skip: set[str]) -> int:
    queue = f"{prefix}-worker"
    env = {
        **os.environ,
        "KUMIKO_APP": "tests.soak.app:runner",
        "KUMIKO_REDIS_URL": url,
        "KUMIKO_QUEUE_PREFIX": prefix,
        "PYTHONPATH": str(ROOT),
        "KUMIKO_HEARTBEAT_TIMEOUT_MS": str(HEARTBEAT_TIMEOUT_MS),
        "KUMIKO_MAINTENANCE_CHANCE": str(MAINTENANCE_CHANCE),
        "KUMIKO_LOCK_TTL_MS": str(LOCK_TTL_MS),
        "KUMIKO_MAX_DELIVERIES": str(MAX_DELIVERIES),
    }
    logs = workdir / "logs"
    logs.mkdir()
    fleet = Fleet(env, logs)
    supervisor = Supervisor(fleet)
    markers = DoneMarkers(url, prefix)
    markers.start()
    if not markers.ready.wait(10):
        markers.stopping.set()
        say("FAIL: could not subscribe to the completed markers' keyspace notifications")
        return 1
    admin = redis.Redis.from_url(url, socket_timeout=10)
    fault_client = redis.Redis.from_url(url, socket_timeout=10)
    producer = build_runner({"KUMIKO_REDIS_URL": url, "KUMIKO_QUEUE_PREFIX": prefix})
    fault_producer = build_runner({"KUMIKO_REDIS_URL": url, "KUMIKO_QUEUE_PREFIX": prefix})
    records = Records(admin, prefix)
    ledger = Ledger()
    faults = Faults(fleet, fault_client, fault_producer, prefix, random.Random(seed + 1), skip)
    try:
        for slot in (0, 1):
            fleet.start("worker", slot)
        for slot in (0, 1):
            fleet.start("scheduler", slot)
        supervisor.start()
        booted = time.monotonic() + 60
        while not {BOOT, TICK} <= {r["job"] for r in records.refresh() if r["ev"] == "end"}:
            if time.monotonic() > booted:
                say(
                    "FAIL: no boot job and cron tick completed within 60 s; process exits: "
                    + str(fleet.exited())
                )
                return 1
            time.sleep(0.2)
        say("workers ran the boot job and a cron tick; load and faults start")
        faults.start()
        load_started = time.time()
        Load(producer, random.Random(seed), ledger).run_for(seconds)
        faults.stopping.set()
        faults.join()
        ledger.expected += faults.expected
        load_ended = time.time()
        say(f"load over after {load_ended - load_started:.0f} s; stopping the schedulers")
        dead_processes = fleet.exited(["scheduler"])  # the supervisor watches the workers
        for proc in fleet.schedulers.values():
            fleet.stop(proc)
        schedulers_stopped = time.time()
        left, open_jobs = wait_until_quiet(admin, prefix, queue, records, ledger, QUIESCENCE_S)
        say(
            f"quiet after {time.time() - schedulers_stopped:.0f} s"
            if not left and not open_jobs
            else f"NOT quiet after {QUIESCENCE_S:.0f} s: {open_jobs} job(s) not final, "
            f"{len(left)} leftover(s)"
        )
        supervisor.stop()  # notes a worker death it has not seen yet, starts no worker
        for proc in fleet.workers.values():
            if proc.popen.poll() is None:
                fleet.stop(proc)
        time.sleep(LOCK_TTL_MS / 1000 + 0.5)  # waiting out the lock TTL is the point here
        stuck = left + fleet.stuck + [f"process died on its own: {d}" for d in dead_processes]
        stuck += [f"supervisor: {error}" for error in supervisor.errors]
        return verdicts(
            admin=admin,
            prefix=prefix,
            queue=queue,
            workdir=workdir,
            records=records,
            ledger=ledger,
            fleet=fleet,
            faults=faults,
            markers=markers,
            stuck=stuck,
            cron_window=(load_started + 2, load_ended - 2),
            ttl_bound_ms=producer.retention.completed_age_s * 1000,
            marker_ttls_ms={
                "done": producer.broker.completed_ttl_ms,
                "sent": producer.broker.resend_window_ms,
            },
            history_ttl_ms=producer.retention.failed_age_s * 1000,
        )
    finally:
        faults.stopping.set()
        supervisor.stopping.set()
        if supervisor.is_alive():
            supervisor.join()  # it starts no worker after this
        fleet.kill_all()
        markers.stopping.set()
        producer.stop()
        fault_producer.stop()
        admin.close()
        fault_client.close()


def verdicts(
    *,
    admin: redis.Redis,
    prefix: str,
    queue: str,
    workdir: Path,
    records: Records,
    ledger: Ledger,
    fleet: Fleet,
    faults: Faults,
    markers: DoneMarkers,
    stuck: list[str],
    cron_window: tuple[float, float],
    ttl_bound_ms: int,
    marker_ttls_ms: dict[str, int],
    history_ttl_ms: int,
) -> int:
    raw = records.refresh()
    runs, problems = check.assemble_runs(raw)
    index = check.RunIndex(runs)
    kills = check.KillLog([*fleet.kills, *fleet.deaths])
    xq_rids, letters = dead_letters(admin, queue)
    worker_logs = "\n".join(
        path.read_text(errors="replace") for path in sorted(fleet.logs.glob("worker-*.log"))
    )
    scheduler_logs = "\n".join(
        path.read_text(errors="replace") for path in sorted(fleet.logs.glob("scheduler-*.log"))
    )
    keys = scan_keys(admin, prefix)
    done_at = dict(markers.first_set)

    marked = set(done_at) | {
        key.rsplit(":done:", 1)[1] for key, pttl in keys if ":done:" in key and pttl != -2
    }
    rerun_result, explained = check.check_reruns(
        index,
        done_at,
        kills,
        marked=marked,
        bursts=faults.bursts,
        dropped=completed_drops(worker_logs),
    )
    results = [
        check.check_terminal(
            ledger.expected,
            index,
            kills,
            keyed=ledger.keyed,
            dead_lettered=set(letters),
            record_problems=problems,
            explained=explained,
        ),
        rerun_result,
    ]
    results.append(check.check_tenants(PER_TENANT, ledger.wrappers, TENANTS, index, explained))
    results.append(check.check_sequential([SEQUENTIAL], index, kills))
    results.append(check.check_capped(CAPPED, CAPPED_MAX_RUNNING, index, kills))
    results.append(check.check_rated(RATED, RATED_COUNT, RATED_PER_MS, index))
    results.append(
        check.check_cron(TICK, index, cron_window, explained, misfired_ranges(scheduler_logs, TICK))
    )
    results.append(check.check_boot(BOOT, index, explained))
    leftover = check.check_leftovers(
        keys,
        prefix,
        ttl_bound_ms,
        stuck=stuck,
        history_ttl_ms=history_ttl_ms,
        running=still_running(admin, prefix),
        marker_ttls_ms=marker_ttls_ms,
        guarded=guarded_ids(prefix, ledger, index, scheduler_logs),
        queue_keys=scan_queue_keys(admin, prefix),
        caps_ttls_ms={"slots": 2 * LOCK_TTL_MS, "rate": RATED_PER_MS + 1_000},
    )
    leftover.notes += inflight_entries(admin, prefix)
    results.append(leftover)
    results.append(check.check_malformed(faults.malformed, xq_rids, worker_logs, index))
    results.append(
        check.check_poison(
            faults.poisons,
            POISON,
            index,
            letters,
            worker_logs,
            MAX_DELIVERIES,
            kills=fleet.kills,
            deaths=fleet.deaths,
        )
    )
    if markers.gaps:
        results[1].notes.append(f"the marker listener lost its connection {markers.gaps} time(s)")
    if ledger.uncertain:
        results[0].notes.append(
            f"{len(ledger.uncertain)} dispatch(es) raised: {ledger.uncertain[:3]}"
        )
    if faults.errors:
        results[0].notes.append(f"faults that could not be injected: {faults.errors[:3]}")
    if faults.burst_notes:
        results[1].notes.append(f"delayed bursts without a kill: {faults.burst_notes[:3]}")

    for result in results:
        print(result.render(), flush=True)
    print("log digest (worker logs; planned SoakFailures left out of the lines):")
    for line in log_digest(worker_logs):
        print("  " + line)
    print(
        f"dispatched by kind: {dict(sorted(ledger.dispatched.items()))}; "
        f"clients killed by CLIENT KILL: {faults.clients_killed}; "
        f"worker processes started: {len(list(fleet.logs.glob('worker-*.log')))} "
        f"({len(fleet.kills)} SIGKILLed, {len(fleet.deaths)} died on their own)"
    )
    (workdir / "records.jsonl").write_text("\n".join(json.dumps(r) for r in raw))
    (workdir / "driver.json").write_text(
        json.dumps(
            {
                "kills": [asdict(k) for k in fleet.kills],
                "deaths": [asdict(k) for k in fleet.deaths],
                "poisons": [asdict(p) for p in faults.poisons],
                "delayed_bursts": [asdict(b) for b in faults.bursts],
                "client_kills_at": faults.client_kills_at,
                "dispatches": ledger.log,
                "malformed": [asdict(m) for m in faults.malformed],
                "done_at": done_at,
                "keyed": [asdict(k) for k in ledger.keyed],
                "expected": [asdict(e) for e in ledger.expected],
                "wrappers": ledger.wrappers,
                "cron_window": cron_window,
            }
        )
    )
    print(
        check.summary_line(sum(ledger.dispatched.values()), len(runs), faults.counts, results),
        flush=True,
    )
    return 0 if all(result.passed for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
