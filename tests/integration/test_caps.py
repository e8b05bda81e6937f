"""Concurrency caps (``max_running``) and rate limits (``rate_limit``) across runners.

Real Redis, real workers: several runners (each its own broker and threads, as separate
hosts would be) consume one dataset; every start and end of a run is written to a ledger
from inside the handler, and the ledger is checked: at no instant do more runs overlap than
the cap allows, no attempt is spent waiting, and nothing is lost.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kumiko_dramatiq import (
    Feature,
    JobConfigError,
    JobContext,
    RateLimit,
    Registry,
    build_message_options,
)
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.broker.settling import Claim
from kumiko_dramatiq.dashboard.pages import parse_waiting_cursor
from kumiko_dramatiq.messages import build_message
from kumiko_dramatiq.ops import admin
from tests.apps import caps_app
from tests.conftest import Recorder, RunnerFactory, wait_for

JOB = "caps:job:work"


class Ledger:
    """Start and end instants of every run (monotonic), in the order they happened."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: list[tuple[float, int, str]] = []  # (time, +1 start / -1 end, id)
        self.running = 0
        self.peak = 0

    def start(self, message_id: str) -> None:
        with self._lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
            self.events.append((time.monotonic(), 1, message_id))

    def end(self, message_id: str) -> None:
        with self._lock:
            self.running -= 1
            self.events.append((time.monotonic(), -1, message_id))

    def starts(self) -> list[float]:
        with self._lock:
            return [t for t, kind, _ in self.events if kind == 1]


def capped(
    ledger: Ledger,
    hold_s: float = 0.05,
    fail: Callable[[dict[str, Any]], bool] | None = None,
    **options: Any,
) -> Registry:
    feature = Feature("caps")

    @feature.job("work", **options)
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        ledger.start(ctx.message_id)
        try:
            time.sleep(payload.get("hold_s", hold_s))
            if fail is not None and fail(payload) and ctx.attempt == 1:
                raise RuntimeError("first attempt fails")
        finally:
            ledger.end(ctx.message_id)

    @feature.job("free")
    def free(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    return Registry([feature])


def test_max_running_is_never_exceeded_across_runners(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    ledger = Ledger()
    registry = capped(ledger, max_running=2, retries=1, fail=lambda p: p["n"] % 5 == 0)
    runners = [make_runner(registry, worker_threads=4, **recorder.hooks()) for _ in range(3)]
    ids = [runners[0].dispatch(JOB, {"n": n}) for n in range(30)]
    for runner in runners:
        runner.start()
    recorder.wait_until(lambda r: len(r.of("complete", JOB)) == 30, timeout_s=60)
    assert ledger.peak <= 2
    assert ledger.peak == 2  # the cap was used, not a single file
    # no attempt spent waiting: only the failures planted took a second attempt
    attempts = {e.message_id: e.meta.attempt for e in recorder.of("complete", JOB)}
    assert sorted(attempts) == sorted(ids)
    assert {m for m, a in attempts.items() if a == 2} == {ids[n] for n in range(0, 30, 5)}
    assert len(recorder.of("failed", JOB)) == 6
    # every slot is given back (by the settle, right after the hook), nothing waits
    wait_for(lambda: redis_client.zcard(keys.cap_slots(prefix, JOB)) == 0, what="slots back")
    assert redis_client.llen(keys.cap_wait(prefix, JOB)) == 0
    assert int(redis_client.hget(keys.cap_waits(prefix), JOB) or 0) == 0


def test_waiting_message_holds_no_thread_other_jobs_flow(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    ledger = Ledger()
    registry = capped(ledger, hold_s=0.5, max_running=1)
    runner = make_runner(registry, worker_threads=2, **recorder.hooks())
    for n in range(6):
        runner.dispatch(JOB, {"n": n})
    runner.start()
    recorder.wait_until(lambda r: len(r.of("start", JOB)) == 1)
    # five wait in Redis, in the waiting list, not in the worker: a free job still runs
    wait_for(lambda: redis_client.llen(keys.cap_wait(prefix, JOB)) == 5, what="five waiting")
    free_id = runner.dispatch("caps:job:free")
    recorder.wait_until(lambda r: any(e.message_id == free_id for e in r.of("complete")))
    assert len(recorder.of("complete", JOB)) == 0
    recorder.wait_until(lambda r: len(r.of("complete", JOB)) == 6, timeout_s=30)
    assert ledger.peak == 1
    assert all(e.meta.attempt == 1 for e in recorder.of("start", JOB))


def test_waiters_start_in_arrival_order(make_runner: RunnerFactory, recorder: Recorder) -> None:
    ledger = Ledger()
    registry = capped(ledger, hold_s=0.02, max_running=1)
    runner = make_runner(registry, worker_threads=4, **recorder.hooks())
    ids = [runner.dispatch(JOB, {"n": n}) for n in range(12)]
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete", JOB)) == 12, timeout_s=30)
    assert [e.message_id for e in recorder.of("start", JOB)] == ids


def test_rate_limit_is_respected(make_runner: RunnerFactory, recorder: Recorder) -> None:
    ledger = Ledger()
    registry = capped(ledger, hold_s=0.0, rate_limit=RateLimit(5, 1_000))
    runners = [make_runner(registry, worker_threads=4, **recorder.hooks()) for _ in range(2)]
    for n in range(15):
        runners[0].dispatch(JOB, {"n": n})
    for runner in runners:
        runner.start()
    recorder.wait_until(lambda r: len(r.of("complete", JOB)) == 15, timeout_s=30)
    starts = sorted(ledger.starts())
    # at most 5 starts in any window of 1 s. The window is Redis's, kept at the claim; a
    # handler starts a little after its claim, by how long its thread took to get going (87 ms
    # once on a loaded machine), so the local starts get slack: 6 starts within half a second
    # would still show a limiter that lets a window's runs through twice
    for i in range(len(starts) - 5):
        assert starts[i + 5] - starts[i] >= 0.5, starts
    # and it does not wait much longer than it must: 15 starts need two more windows
    assert starts[-1] - starts[0] < 2.0 + 1.5
    assert all(e.meta.attempt == 1 for e in recorder.of("start", JOB))


def test_per_tenant_children_share_the_cap_wrapper_takes_no_slot(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    ledger = Ledger()
    tenants = [f"t{n}" for n in range(8)]
    registry = capped(ledger, hold_s=0.1, per_tenant=True, max_running=2)
    runner = make_runner(
        registry, worker_threads=6, get_active_tenant_ids=lambda: tenants, **recorder.hooks()
    )
    runner.dispatch(JOB, {})
    runner.start()
    recorder.wait_until(
        lambda r: len([e for e in r.of("complete", JOB) if e.meta.tenant_id]) == 8,
        timeout_s=30,
    )
    assert ledger.peak == 2
    wait_for(lambda: redis_client.zcard(keys.cap_slots(prefix, JOB)) == 0, what="slots back")


def test_per_tenant_rate_limit_keeps_a_window_per_tenant(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    ledger = Ledger()
    tenants = ["a", "b", "c"]
    registry = capped(
        ledger, hold_s=0.0, per_tenant=True, rate_limit=RateLimit(1, 60_000, per_tenant=True)
    )
    runner = make_runner(
        registry, worker_threads=4, get_active_tenant_ids=lambda: tenants, **recorder.hooks()
    )
    runner.dispatch(JOB, {})
    runner.dispatch(JOB, {})
    runner.start()
    # one run per tenant starts at once; the second round waits a minute
    recorder.wait_until(
        lambda r: len([e for e in r.of("complete", JOB) if e.meta.tenant_id]) == 3,
        timeout_s=30,
    )
    status = runner.status()
    lane = next(each for each in status.lanes if each.lane == "worker")
    assert lane.queued == 3  # the waiting children count as queued
    assert sorted(e.meta.tenant_id for e in recorder.of("start", JOB) if e.meta.tenant_id) == [
        "a",
        "b",
        "c",
    ]


def test_caps_ride_in_the_message_options(make_runner: RunnerFactory) -> None:
    registry = capped(Ledger(), max_running=3, rate_limit=RateLimit(10, 1_000))
    job = registry.jobs[JOB]
    assert build_message_options(job)["kumiko_caps"] == {
        "max_running": 3,
        "rate_limit": [10, 1_000, False],
    }
    assert "kumiko_caps" not in build_message_options(registry.jobs["caps:job:free"])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"max_running": 0}, r"caps:job:bad: max_running must be an integer >= 1 or None, got 0"),
        ({"max_running": True}, r"max_running must be an integer >= 1 or None, got True"),
        ({"max_running": 2.0}, r"max_running must be an integer >= 1 or None, got 2.0"),
        ({"max_running": "3"}, r"max_running must be an integer >= 1 or None, got '3'"),
        ({"rate_limit": RateLimit(0, 1_000)}, r"rate_limit.count must be a positive integer"),
        ({"rate_limit": RateLimit(1, 0)}, r"rate_limit.per_ms must be a positive integer, got 0"),
        ({"rate_limit": RateLimit(1, -5)}, r"rate_limit.per_ms must be a positive integer"),
        ({"rate_limit": RateLimit(True, 5)}, r"rate_limit.count must be a positive integer"),
        (
            {"rate_limit": RateLimit(1, 5.0)},  # type: ignore[arg-type]
            r"rate_limit.per_ms must be a positive integer",
        ),
        ({"rate_limit": (1, 5)}, r"rate_limit must be None or RateLimit"),
        (
            {"rate_limit": RateLimit(1, 5, per_tenant=True)},
            r"rate_limit.per_tenant needs per_tenant=True",
        ),
        ({"boot_gate": True, "max_running": 1}, r"max_running with boot_gate=True"),
        ({"boot_gate": True, "rate_limit": RateLimit(1, 5)}, r"rate_limit with boot_gate=True"),
    ],
)
def test_invalid_caps_are_one_config_error(options: dict[str, Any], match: str) -> None:
    feature = Feature("caps")
    with pytest.raises(JobConfigError, match=match) as caught:
        feature.job("bad", **options)
    assert "\n" not in str(caught.value)
    assert "caps:job:bad" in str(caught.value)


# -- CLI workers in several processes ----------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]


def _events(client: redis.Redis, prefix: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(caps_app.events_key(prefix), 0, -1)]


def _peak(events: list[dict[str, Any]]) -> int:
    """The most runs that overlapped at any instant (an end and a start at the same instant
    do not overlap)."""
    running = peak = 0
    for event in sorted(events, key=lambda e: (e["at"], e["event"] == "start")):
        running += 1 if event["event"] == "start" else -1
        peak = max(peak, running)
    return peak


@pytest.fixture
def workers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _spawn(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _kumiko(env: dict[str, str], *args: str) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "kumiko_dramatiq.ops.cli", *args, "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _env(redis_url: str, prefix: str, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "KUMIKO_APP": "tests.apps.caps_app:registry",
        "KUMIKO_REDIS_URL": redis_url,
        "KUMIKO_QUEUE_PREFIX": prefix,
        "PYTHONPATH": str(ROOT),
        **extra,
    }


@pytest.mark.slow
def test_cli_workers_in_several_processes_never_exceed_the_cap(
    make_runner: RunnerFactory,
    prefix: str,
    redis_url: str,
    redis_client: redis.Redis,
    workers: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    producer = make_runner(caps_app.registry)
    for n in range(24):
        producer.dispatch(caps_app.JOB, {"name": f"m{n}", "hold_s": 0.1})
    env = _env(redis_url, prefix)
    # one worker thread per process: a process holds at most one run at a time (a freed slot
    # goes to the worker that freed it, so with more threads one process could keep both)
    for i in range(3):
        workers.append(_spawn(env, tmp_path / f"w{i}.log", "-p", "2", "-t", "1"))
    wait_for(
        lambda: len([e for e in _events(redis_client, prefix) if e["event"] == "end"]) == 24,
        timeout_s=90,
        what="24 runs to end",
    )
    events = _events(redis_client, prefix)
    assert _peak(events) <= caps_app.MAX_RUNNING
    assert len({e["pid"] for e in events}) >= 2  # the runs were spread over processes
    assert all(e["attempt"] == 1 for e in events)  # waiting spent no attempt
    assert sorted(e["name"] for e in events if e["event"] == "start") == sorted(
        f"m{n}" for n in range(24)
    )


@pytest.mark.slow
def test_cli_workers_in_several_processes_keep_the_rate_limit(
    make_runner: RunnerFactory,
    prefix: str,
    redis_url: str,
    redis_client: redis.Redis,
    workers: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    producer = make_runner(caps_app.registry)
    for n in range(14):
        producer.dispatch(caps_app.RATED, {"name": f"r{n}"})
    env = _env(redis_url, prefix)
    for i in range(3):
        workers.append(_spawn(env, tmp_path / f"w{i}.log", "-p", "1", "-t", "3"))
    wait_for(
        lambda: len([e for e in _events(redis_client, prefix) if e["event"] == "end"]) == 14,
        timeout_s=90,
        what="14 runs to end",
    )
    starts = sorted(e["at"] for e in _events(redis_client, prefix) if e["event"] == "start")
    count, window_s = caps_app.RATE_COUNT, caps_app.RATE_PER_MS / 1000
    # at most count starts in any window (the handlers stamp their start a little after the
    # fetch that counted it: a loaded machine's jitter is allowed a tenth of the window)
    for i in range(len(starts) - count):
        assert starts[i + count] - starts[i] >= 0.9 * window_s, starts
    assert all(e["attempt"] == 1 for e in _events(redis_client, prefix))


@pytest.mark.slow
def test_a_slot_held_by_a_killed_worker_comes_back_within_its_lease(
    make_runner: RunnerFactory,
    prefix: str,
    redis_url: str,
    redis_client: redis.Redis,
    workers: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    env = _env(redis_url, prefix, KUMIKO_LOCK_TTL_MS="3000", KUMIKO_HEARTBEAT_TIMEOUT_MS="5000")
    slots = keys.cap_slots(prefix, caps_app.JOB)
    producer = make_runner(caps_app.registry)

    # Given a worker process whose runs hold both slots of the job (with a thread to spare)
    workers.append(_spawn(env, tmp_path / "first.log", "-p", "1", "-t", "4"))
    for name in ("held-1", "held-2"):
        producer.dispatch(caps_app.JOB, {"name": name, "hold": True})
    wait_for(lambda: len(_events(redis_client, prefix)) == 2, what="both held runs to start")
    holder_pid = _events(redis_client, prefix)[0]["pid"]
    assert redis_client.zcard(slots) == 2
    # and a message that waits for a slot
    producer.dispatch(caps_app.JOB, {"name": "next"})
    wait_for(
        lambda: redis_client.llen(keys.cap_wait(prefix, caps_app.JOB)) == 1,
        what="the next message to wait",
    )

    # (the slot holders show in `kumiko locks`, the caps and how full they are in `kumiko
    # jobs`, the waiting message as queued in `kumiko status`)
    held = _kumiko(env, "locks")["locks"]
    assert sorted((lock["kind"], lock["job_name"]) for lock in held) == [
        ("slot", caps_app.JOB),
        ("slot", caps_app.JOB),
    ]
    assert {lock["worker"].rpartition(":")[2] for lock in held} == {str(holder_pid)}
    assert all(lock["worker_alive"] and lock["expires_in_ms"] > 0 for lock in held)
    job = next(j for j in _kumiko(env, "jobs")["jobs"] if j["name"] == caps_app.JOB)
    assert (job["max_running"], job["running_slots"], job["cap_waiting"]) == (2, 2, 1)
    lanes = {lane["lane"]: lane for lane in _kumiko(env, "status")["lanes"]}
    assert (lanes["worker"]["queued"], lanes["worker"]["running"]) == (1, 2)

    # When that worker is killed with SIGKILL
    os.killpg(workers[0].pid, signal.SIGKILL)
    workers[0].wait(timeout=10)
    killed_at = time.monotonic()
    redis_client.set(caps_app.release_key(prefix), 1)

    # Then another worker runs the waiting message once the dead worker's leases ran out
    workers.append(_spawn(env, tmp_path / "second.log", "-p", "1", "-t", "2"))
    wait_for(
        lambda: any(
            e["name"] == "next" and e["event"] == "end" for e in _events(redis_client, prefix)
        ),
        timeout_s=30,
        what="the waiting run in the second worker",
    )
    nexts = [e for e in _events(redis_client, prefix) if e["name"] == "next"]
    assert nexts[0]["pid"] != holder_pid
    assert nexts[0]["at"] - killed_at >= 0  # not before the kill, of course
    # and nothing is lost: the killed runs are redelivered and run again (no attempt spent)
    wait_for(
        lambda: (
            {
                e["name"]
                for e in _events(redis_client, prefix)
                if e["event"] == "end" and e["pid"] != holder_pid
            }
            >= {"held-1", "held-2", "next"}
        ),
        timeout_s=60,
        what="the killed runs to run again",
    )
    events = [e for e in _events(redis_client, prefix) if e["pid"] != holder_pid]
    assert all(e["attempt"] == 1 for e in events)
    assert _peak(events) <= caps_app.MAX_RUNNING
    wait_for(lambda: redis_client.zcard(slots) == 0, what="every slot back")


# -- leases: renewed while the run lasts, fenced when they cannot be -----------------------------
def test_a_run_longer_than_the_lease_keeps_its_slot(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    ledger = Ledger()
    registry = capped(ledger, hold_s=0.05, max_running=1)
    runner = make_runner(registry, lock_ttl_ms=300, worker_threads=3, **recorder.hooks())
    runner.dispatch(JOB, {"n": 0, "hold_s": 1.2})  # four leases long
    for n in range(1, 4):
        runner.dispatch(JOB, {"n": n})
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete", JOB)) == 4, timeout_s=30)
    assert ledger.peak == 1
    assert [e.meta.attempt for e in recorder.of("start", JOB)] == [1, 1, 1, 1]


def test_a_run_whose_slot_was_taken_away_is_interrupted_and_runs_again(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    ledger = Ledger()
    feature = Feature("caps")
    first = threading.Event()

    @feature.job("work", max_running=1)
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        ledger.start(ctx.message_id)
        try:
            if not first.is_set():
                first.set()
                for _ in range(600):  # interrupted by the fence long before (between sleeps:
                    time.sleep(0.05)  # a blocking C call would end the process instead)
        finally:
            ledger.end(ctx.message_id)

    runner = make_runner(Registry([feature]), lock_ttl_ms=600, worker_threads=2, **recorder.hooks())
    message_id = runner.dispatch(JOB, {})
    runner.start()
    slots = keys.cap_slots(prefix, JOB)
    wait_for(first.is_set, what="the run to start")
    # the lease is lost (as when it ran out while the holder was cut off from Redis)
    redis_client.delete(slots)
    recorder.wait_until(lambda r: len(r.of("complete", JOB)) == 1, timeout_s=30)
    starts = recorder.of("start", JOB)
    assert [e.message_id for e in starts] == [message_id, message_id]
    assert [e.meta.attempt for e in starts] == [1, 1]  # the cut-short run spent no attempt
    assert recorder.of("failed", JOB) == []
    wait_for(lambda: redis_client.zcard(slots) == 0, what="slots back")


def test_sequential_and_max_running_combine(make_runner: RunnerFactory, recorder: Recorder) -> None:
    ledger = Ledger()
    tenants = ["a", "b", "c", "d"]
    feature = Feature("caps")
    by_tenant: dict[str, int] = {}
    lock = threading.Lock()

    @feature.job("work", per_tenant=True, concurrency="sequential", max_running=2)
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        assert ctx.tenant_id is not None
        with lock:
            by_tenant[ctx.tenant_id] = by_tenant.get(ctx.tenant_id, 0) + 1
            assert by_tenant[ctx.tenant_id] == 1
        ledger.start(ctx.message_id)
        time.sleep(0.1)
        ledger.end(ctx.message_id)
        with lock:
            by_tenant[ctx.tenant_id] -= 1

    runner = make_runner(
        Registry([feature]),
        worker_threads=6,
        get_active_tenant_ids=lambda: tenants,
        sequential_retry_delay_ms=50,
        **recorder.hooks(),
    )
    for _ in range(3):
        runner.dispatch(JOB, {})
    runner.start()
    recorder.wait_until(
        lambda r: len([e for e in r.of("complete", JOB) if e.meta.tenant_id]) == 12,
        timeout_s=60,
    )
    assert ledger.peak <= 2
    assert recorder.of("failed", JOB) == []


# -- operating: waiting messages are queued, can be cancelled and paused; retries obey ------
def test_a_waiting_message_can_be_cancelled(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    ledger = Ledger()
    registry = capped(ledger, hold_s=0.3, max_running=1)
    runner = make_runner(registry, worker_threads=3, **recorder.hooks())
    first = runner.dispatch(JOB, {"n": 0})
    waiting = runner.dispatch(JOB, {"n": 1})
    last = runner.dispatch(JOB, {"n": 2})
    runner.start()
    wait_for(lambda: redis_client.llen(keys.cap_wait(prefix, JOB)) == 2, what="two waiting")
    assert runner.cancel(waiting) is True
    recorder.wait_until(lambda r: len(r.of("complete", JOB)) == 2, timeout_s=30)
    assert [e.message_id for e in recorder.of("start", JOB)] == [first, last]
    runner.drain(timeout_s=30)
    assert int(redis_client.hget(keys.cap_waits(prefix), JOB) or 0) == 0


def test_a_dead_letter_retried_obeys_the_cap(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    ledger = Ledger()
    healed = threading.Event()
    registry = capped(
        ledger,
        hold_s=0.1,
        max_running=1,
        fail=lambda p: p.get("fail", False) and not healed.is_set(),
    )
    runner = make_runner(registry, worker_threads=4, **recorder.hooks())
    dead = runner.dispatch(JOB, {"n": 0, "fail": True})
    runner.start()
    recorder.wait_until(lambda r: len(r.of("failed", JOB)) == 1)
    runner.drain(timeout_s=30)
    for n in range(1, 4):
        runner.dispatch(JOB, {"n": n, "hold_s": 0.2})
    healed.set()
    runner.retry_dead(dead)
    recorder.wait_until(lambda r: len(r.of("complete", JOB)) == 4, timeout_s=30)
    assert ledger.peak == 1


def test_metrics_show_each_cap_and_how_full_it_is(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    from kumiko_dramatiq.ops.exposition import DatasetCollector

    release = threading.Event()
    feature = Feature("caps")

    @feature.job("work", max_running=1, rate_limit=RateLimit(100, 60_000))
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        release.wait(30)

    registry = Registry([feature])
    runner = make_runner(registry, worker_threads=3, **recorder.hooks())
    for _ in range(3):
        runner.dispatch(JOB, {})
    runner.start()
    try:
        wait_for(lambda: redis_client.llen(keys.cap_wait(prefix, JOB)) == 2, what="two waiting")
        reading = DatasetCollector(runner.broker, registry).read()
        assert reading.caps == {JOB: (1, 1, 1, 2)}
        assert reading.messages[("worker", "queued")] == 2
        assert reading.messages[("worker", "running")] == 1
        (info,) = runner.jobs()
        assert (info.max_running, info.rate_limit) == (1, "100 per 60000 ms")
        assert (info.running_slots, info.rate_window_starts, info.cap_waiting) == (1, 1, 2)
    finally:
        release.set()
    runner.drain(timeout_s=30)


def test_capped_jobs_of_both_lanes_wait_on_their_own_lane(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    ledgers = {"worker": Ledger(), "api": Ledger()}
    feature = Feature("caps")
    for lane in ("worker", "api"):

        def work(payload: dict[str, Any], ctx: JobContext, lane: str = lane) -> None:
            ledgers[lane].start(ctx.message_id)
            time.sleep(0.05)
            ledgers[lane].end(ctx.message_id)

        feature.job(lane, run_in=lane, max_running=1)(work)
    registry = Registry([feature])
    runners = [
        make_runner(registry, lane=lane, worker_threads=3, **recorder.hooks())
        for lane in ("worker", "api")
    ]
    for n in range(6):
        runners[0].dispatch("caps:job:worker", {"n": n})
        runners[0].dispatch("caps:job:api", {"n": n})
    for runner in runners:
        runner.start()
    recorder.wait_until(lambda r: len(r.of("complete")) == 12, timeout_s=30)
    assert ledgers["worker"].peak == ledgers["api"].peak == 1


def test_a_fetch_with_a_suspect_and_a_due_waiter_claims_one_and_returns(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    """A suspect (its worker died while it ran) is claimed only by a fetch that claimed
    nothing else, so the suspects come before the waiters: a waiter claimed first used to
    send the suspect round the suspects list for ever, inside one script."""
    registry = capped(Ledger(), max_running=1)
    runner = make_runner(registry)
    suspect_id, waiter_id = (runner.dispatch(JOB, {"n": n}) for n in range(2))
    broker = runner.broker
    queue = registry.jobs[JOB].queue_name(prefix)
    listed = keys.queue_list(queue)
    suspect_rid, waiter_rid = (text(rid) for rid in redis_client.lrange(listed, 0, 1))
    redis_client.delete(listed)
    redis_client.rpush(keys.suspects(prefix, queue), suspect_rid)
    redis_client.hset(keys.inflight(prefix), suspect_rid, "1|0|elsewhere:1")
    redis_client.rpush(keys.cap_wait(prefix, JOB), waiter_rid)
    redis_client.zadd(keys.cap_waiting(prefix, queue), {JOB: 0})
    redis_client.hset(keys.cap_waits(prefix), JOB, 1)
    fetched, _, _ = broker.fetch_lane(queue, Claim(4, 0, 4))
    # the waiter was first in line: the suspect waits behind it
    assert [rid for rid, _ in fetched.fetched] == [waiter_rid]
    assert list(fetched.slots) == [waiter_rid]
    assert redis_client.lrange(keys.cap_wait(prefix, JOB), 0, -1) == [suspect_rid.encode()]
    assert (suspect_id, waiter_id) != ("", "")


@pytest.mark.parametrize(
    "caps",
    [
        {"max_running": 0},
        {"max_running": 10**9},
        {"rate_limit": [1, 10**20, False]},
        {"rate_limit": [5, 1_000]},
        "one at a time",
    ],
)
def test_forged_caps_are_dead_lettered_at_fetch_and_take_nothing(
    make_runner: RunnerFactory,
    recorder: Recorder,
    redis_client: redis.Redis,
    prefix: str,
    caps: Any,
) -> None:
    registry = capped(Ledger(), hold_s=0.0, max_running=1)
    runner = make_runner(registry, **recorder.hooks())
    job = registry.jobs[JOB]
    message = build_message(job, {"n": 0}, queue_prefix=prefix, trigger="manual")
    body = message.asdict()
    body["options"] = {**body["options"], "kumiko_caps": caps}
    queue = job.queue_name(prefix)
    runner.broker.do_enqueue(queue, "forged-1", json.dumps(body).encode())
    good = runner.dispatch(JOB, {"n": 1})
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete")) == 1, what="the good message")
    wait_for(lambda: redis_client.zcard(f"dramatiq:{queue}.XQ") == 1, what="the dead letter")
    assert [e.message_id for e in recorder.of("start")] == [good]
    wait_for(lambda: redis_client.zcard(keys.cap_slots(prefix, JOB)) == 0, what="slots back")
    assert redis_client.exists(keys.cap_rate(prefix, JOB)) == 0


def test_waiting_messages_of_a_paused_job_stay_parked_until_it_is_resumed(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    ledger = Ledger()
    release = threading.Event()
    feature = Feature("caps")

    @feature.job("work", max_running=1)
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        ledger.start(ctx.message_id)
        if payload["n"] == 0:
            release.wait(30)
        ledger.end(ctx.message_id)

    runner = make_runner(Registry([feature]), worker_threads=3, **recorder.hooks())
    for n in range(4):
        runner.dispatch(JOB, {"n": n})
    runner.start()
    wait_for(lambda: redis_client.llen(keys.cap_wait(prefix, JOB)) == 3, what="three waiting")
    runner.pause(JOB)
    release.set()
    recorder.wait_until(lambda r: len(r.of("complete", JOB)) == 1)
    wait_for(lambda: redis_client.llen(keys.parked(prefix, JOB)) == 3, what="three parked")
    assert len(recorder.of("start", JOB)) == 1
    runner.resume(JOB)
    recorder.wait_until(lambda r: len(r.of("complete", JOB)) == 4, timeout_s=30)
    assert ledger.peak == 1


def test_max_running_and_a_per_tenant_rate_limit_hold_together(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    ledger = Ledger()
    tenants = ["a", "b", "c"]
    starts: dict[str, list[float]] = {tenant: [] for tenant in tenants}
    feature = Feature("caps")

    @feature.job(
        "work", per_tenant=True, max_running=2, rate_limit=RateLimit(2, 500, per_tenant=True)
    )
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        assert ctx.tenant_id is not None
        starts[ctx.tenant_id].append(time.monotonic())
        ledger.start(ctx.message_id)
        time.sleep(0.05)
        ledger.end(ctx.message_id)

    runner = make_runner(
        Registry([feature]),
        worker_threads=6,
        get_active_tenant_ids=lambda: tenants,
        **recorder.hooks(),
    )
    for _ in range(3):
        runner.dispatch(JOB, {})
    runner.start()
    recorder.wait_until(
        lambda r: len([e for e in r.of("complete", JOB) if e.meta.tenant_id]) == 9,
        timeout_s=30,
    )
    assert ledger.peak <= 2
    for tenant, times in starts.items():
        times.sort()
        assert len(times) == 3
        assert times[2] - times[0] >= 0.45, (tenant, times)
    runner.drain(timeout_s=30)
    assert redis_client.hlen(keys.cap_waits(prefix)) == 0


def _held(release: threading.Event, **options: Any) -> Registry:
    """caps:job:work whose run of payload {"hold": true} waits for ``release``."""
    feature = Feature("caps")

    @feature.job("work", **options)
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        if payload.get("hold"):
            release.wait(30)

    return Registry([feature])


@pytest.mark.parametrize("step_bytes", [None, 1], ids=["default steps", "one body a step"])
def test_waiters_for_a_cap_are_listed_and_purged(
    make_runner: RunnerFactory,
    recorder: Recorder,
    redis_client: redis.Redis,
    prefix: str,
    step_bytes: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if step_bytes is not None:  # a purge step of one body: its walk resumes after each
        monkeypatch.setattr(admin, "PURGE_STEP_BYTES", step_bytes)
    release = threading.Event()
    runner = make_runner(_held(release, max_running=1), worker_threads=3, **recorder.hooks())
    holder = runner.dispatch(JOB, {"hold": True})
    runner.start()
    recorder.wait_until(lambda r: len(r.of("start", JOB)) == 1)
    waiters = [runner.dispatch(JOB, {"n": n}, dedup_key=f"k{n}") for n in range(5)]
    wait_for(lambda: redis_client.llen(keys.cap_wait(prefix, JOB)) == 5, what="five waiting")
    assert runner.job_counts()[JOB]["queued"] == 5
    # queued lists them, oldest first, a page at a time
    page = runner.queued(JOB, state="queued", limit=3)
    rest = runner.queued(JOB, state="queued", after=page[-1])
    assert [m.message_id for m in page + rest] == waiters
    # the position a page carries is one the dashboard takes back
    after = parse_waiting_cursor({"after": page[-1].cursor})
    assert runner.queued(JOB, state="queued", after=after) == rest
    assert {m.state for m in page + rest} == {"queued"}
    assert runner.admin.purge(runner.registry.jobs[JOB], "queued", dry_run=True) == 5
    assert runner.purge(JOB, state="queued") == 5
    assert runner.queued(JOB, state="queued") == []
    assert runner.job_counts()[JOB]["queued"] == 0
    assert runner.admin.caps_fullness()[JOB]["cap_waiting"] == 0
    assert not redis_client.exists(keys.cap_wait(prefix, JOB))
    assert (
        redis_client.zscore(
            keys.cap_waiting(prefix, runner.registry.jobs[JOB].queue_name(prefix)), JOB
        )
        is None
    )
    assert not any(redis_client.exists(keys.dedup(prefix, JOB, f"k{n}")) for n in range(5))
    # the holder ends: nothing else runs
    release.set()
    runner.drain(timeout_s=30)
    assert [e.message_id for e in recorder.of("start", JOB)] == [holder]
    assert runner.status().lanes[0].queued == 0
    # a key the purge freed takes a new message, which runs
    again = runner.dispatch(JOB, {"n": 9}, dedup_key="k0")
    recorder.wait_until(lambda r: any(e.message_id == again for e in r.of("complete", JOB)))


def test_a_waiter_for_a_cap_cancelled_leaves_no_count_behind(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    release = threading.Event()
    runner = make_runner(_held(release, max_running=1), worker_threads=3, **recorder.hooks())
    holder = runner.dispatch(JOB, {"hold": True})
    runner.start()
    recorder.wait_until(lambda r: len(r.of("start", JOB)) == 1)
    waiters = [runner.dispatch(JOB, {"n": n}) for n in range(4)]
    wait_for(lambda: redis_client.llen(keys.cap_wait(prefix, JOB)) == 4, what="four waiting")
    assert runner.cancel(waiters[1]) is True
    # off the waiting list and its count at once, not when the fetch meets it
    assert redis_client.llen(keys.cap_wait(prefix, JOB)) == 3
    assert runner.admin.caps_fullness()[JOB]["cap_waiting"] == 3
    assert runner.job_counts()[JOB]["queued"] == 3
    assert [m.message_id for m in runner.queued(JOB)] == [waiters[0], *waiters[2:]]
    assert runner.cancel(waiters[1]) is False
    release.set()
    recorder.wait_until(lambda r: len(r.of("complete", JOB)) == 4, timeout_s=30)
    runner.drain(timeout_s=30)
    assert [e.message_id for e in recorder.of("start", JOB)] == [holder, waiters[0], *waiters[2:]]
    assert redis_client.hget(keys.cap_waits(prefix), JOB) is None
    assert runner.job_counts()[JOB]["queued"] == 0


@pytest.mark.parametrize("step_bytes", [None, 1], ids=["default steps", "one body a step"])
def test_waiters_of_per_tenant_rate_limits_are_listed_cancelled_and_purged(
    make_runner: RunnerFactory,
    recorder: Recorder,
    redis_client: redis.Redis,
    prefix: str,
    step_bytes: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if step_bytes is not None:  # a purge step of one body: its walk resumes after each
        monkeypatch.setattr(admin, "PURGE_STEP_BYTES", step_bytes)
    tenants = ["a", "b", "c"]
    registry = capped(
        Ledger(), hold_s=0.0, per_tenant=True, rate_limit=RateLimit(1, 60_000, per_tenant=True)
    )
    runner = make_runner(
        registry, worker_threads=4, get_active_tenant_ids=lambda: tenants, **recorder.hooks()
    )
    runner.dispatch(JOB, {})
    runner.dispatch(JOB, {})
    runner.start()
    # one run per tenant, the second round waits a minute in each tenant's group
    recorder.wait_until(
        lambda r: len([e for e in r.of("complete", JOB) if e.meta.tenant_id]) == 3,
        timeout_s=30,
    )
    wait_for(lambda: runner.job_counts()[JOB]["queued"] == 3, what="three waiting")
    queue = runner.registry.jobs[JOB].queue_name(prefix)
    waiting = runner.queued(JOB, state="queued")
    assert sorted(m.tenant_id or "" for m in waiting) == tenants
    # by the same pages without a job filter (every group of the lane)
    assert {m.message_id for m in runner.queued(state="queued")} == {m.message_id for m in waiting}
    # one at a time, each page resuming where the last one stopped, across the groups
    paged: list[str] = []
    after = None
    while page := runner.queued(JOB, state="queued", limit=1, after=after):
        paged += [m.message_id for m in page]
        after = page[-1]
    assert paged == [m.message_id for m in waiting]
    cancelled = waiting[0]
    assert runner.cancel(cancelled.message_id) is True
    group = keys.cap_group(JOB, cancelled.tenant_id)
    assert not redis_client.exists(keys.cap_wait(prefix, group))
    assert redis_client.zscore(keys.cap_waiting(prefix, queue), group) is None
    assert runner.admin.caps_fullness()[JOB]["cap_waiting"] == 2
    assert runner.purge(JOB, state="queued") == 2
    assert runner.queued(JOB) == []
    assert runner.job_counts()[JOB]["queued"] == 0
    assert redis_client.hget(keys.cap_waits(prefix), JOB) is None
    assert redis_client.zcard(keys.cap_waiting(prefix, queue)) == 0
