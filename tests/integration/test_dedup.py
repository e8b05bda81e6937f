"""Dedup keys against a real Redis: collapse while queued, one follow-up while running,
free once the job ends for good (never "fires once, then never again")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kumiko_dramatiq import (
    Backoff,
    Event,
    Feature,
    JobContext,
    PayloadError,
    Registry,
)
from kumiko_dramatiq.broker import keys as kumiko_keys
from kumiko_dramatiq.broker.keys import queue_messages
from kumiko_dramatiq.middleware.dedup import Dedup
from tests.apps import dedup_app
from tests.conftest import Recorder, RunnerFactory, wait_for

ROOT = Path(__file__).resolve().parents[2]
JOB = "dd:job:work"
OTHER = "dd:job:other"


# -- helpers ------------------------------------------------------------------
def registry_of(handler: Callable[..., Any], **options: Any) -> Registry:
    """A registry with ``dd:job:work`` (``handler``, ``options``) and a no-op ``dd:job:other``."""
    feature = Feature("dd")
    feature.job("work", **options)(handler)
    feature.job("other")(noop)
    return Registry([feature])


def noop(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


def fail(payload: dict[str, Any], ctx: JobContext) -> None:
    raise RuntimeError("boom")


def record_key(prefix: str, dedup_key: str, job: str = JOB) -> str:
    return kumiko_keys.dedup(prefix, job, dedup_key)


def record(client: redis.Redis, prefix: str, dedup_key: str, job: str = JOB) -> dict[str, str]:
    raw: dict[bytes, bytes] = client.hgetall(record_key(prefix, dedup_key, job))  # type: ignore[assignment]
    return {k.decode(): v.decode() for k, v in raw.items()}


def stored_messages(client: redis.Redis, prefix: str) -> list[dict[str, Any]]:
    """Every message waiting in the worker lane: its queue and its delay queue."""
    found: list[dict[str, Any]] = []
    for queue in (f"{prefix}-worker", f"{prefix}-worker.DQ"):
        for data in client.hvals(queue_messages(queue)):
            found.append(json.loads(data))
    return found


def key_is_free(client: redis.Redis, prefix: str, dedup_key: str, job: str = JOB) -> bool:
    return not client.exists(record_key(prefix, dedup_key, job))


class Gates:
    """A handler that records its runs and blocks on the gate its payload names."""

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}
        self.runs: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def gate(self, name: str) -> threading.Event:
        with self._lock:
            return self.gates.setdefault(name, threading.Event())

    def __call__(self, payload: dict[str, Any], ctx: JobContext) -> None:
        with self._lock:
            self.runs.append((ctx.message_id, payload))
        name = payload.get("gate")
        if isinstance(name, str):
            self.gate(name).wait(20)

    def release_all(self) -> None:
        with self._lock:
            gates = list(self.gates.values())
        for gate in gates:
            gate.set()


@pytest.fixture
def gates() -> Iterator[Gates]:
    handler = Gates()
    yield handler
    handler.release_all()


# -- while queued ---------------------------------------------------------------
def test_a_burst_of_25_while_queued_gives_one_run(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry_of(noop), **recorder.hooks())

    # Given 25 triggers for one key before any worker runs
    ids = {runner.dispatch(JOB, {"n": n}, dedup_key="k") for n in range(25)}

    # Then they share one id and one message
    assert len(ids) == 1
    assert len(stored_messages(redis_client, prefix)) == 1
    # When a worker starts, one run happens and the key is freed
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete")) == 1, what="the one run")
    wait_for(lambda: key_is_free(redis_client, prefix, "k"), what="the key freed")
    wait_for(lambda: stored_messages(redis_client, prefix) == [], what="the queue drained")
    assert [e.message_id for e in recorder.of("start")] == list(ids)


def test_the_same_key_fires_again_after_each_completion(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    # The regression test for BullMQ's "fires once, then never again".
    runner = make_runner(registry_of(noop), **recorder.hooks())
    runner.start()
    ids: list[str] = []
    for round_number in (1, 2, 3):
        ids.append(runner.dispatch(JOB, {"round": round_number}, dedup_key="k"))
        recorder.wait_until(lambda r: len(r.of("complete")) == len(ids), what=f"run {round_number}")
        wait_for(lambda: key_is_free(redis_client, prefix, "k"), what="the key freed")

    assert len(set(ids)) == 3
    assert [e.message_id for e in recorder.of("complete")] == ids


def test_the_key_fires_again_after_a_final_failure(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry_of(fail, retries=0), **recorder.hooks())
    runner.start()

    first = runner.dispatch(JOB, dedup_key="k")
    recorder.wait_until(lambda r: len(r.of("failed")) == 1, what="the final failure")
    wait_for(lambda: key_is_free(redis_client, prefix, "k"), what="the key freed")
    second = runner.dispatch(JOB, dedup_key="k")
    recorder.wait_until(lambda r: len(r.of("failed")) == 2, what="the second run")

    assert second != first
    assert [e.message_id for e in recorder.of("failed")] == [first, second]
    assert all(e.meta.final_attempt for e in recorder.of("failed"))


@pytest.mark.parametrize("handler", [noop, fail], ids=["completed", "final-failure"])
def test_the_ack_frees_the_key_in_its_own_call(
    make_runner: RunnerFactory,
    recorder: Recorder,
    redis_client: redis.Redis,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    handler: Callable[..., Any],
) -> None:
    # Given a worker whose separate "free the key" script would fail if it were called
    runner = make_runner(registry_of(handler, retries=0), **recorder.hooks())

    def refused(*_: Any) -> None:
        raise AssertionError("Dedup._finish called: the ack should have freed the key")

    monkeypatch.setattr(Dedup, "_finish", refused)
    runner.start()

    # When keyed jobs end for good with no trigger during their runs
    ids = [runner.dispatch(JOB, {"n": n}, dedup_key=f"k{n}") for n in range(3)]
    recorder.wait_until(
        lambda r: len(r.of("complete")) + len(r.of("failed")) == 3, what="the three runs"
    )

    # Then each key is freed by the delivery's ack (lua/settle.lua), index entry and all
    wait_for(
        lambda: all(key_is_free(redis_client, prefix, f"k{n}") for n in range(3)),
        what="the keys freed",
    )
    wait_for(
        lambda: redis_client.zcard(kumiko_keys.dedup_index(prefix, JOB)) == 0,
        what="the index emptied",
    )
    assert runner.dispatch(JOB, {"n": 9}, dedup_key="k0") not in ids


def test_a_dispatch_during_a_retry_backoff_returns_the_same_id(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    options = {"retries": 1, "backoff": Backoff("fixed", delay_ms=60_000)}
    runner = make_runner(registry_of(fail, **options), **recorder.hooks())
    runner.start()

    first = runner.dispatch(JOB, dedup_key="k")
    recorder.wait_until(lambda r: len(r.of("failed")) == 1, what="the first failed attempt")
    # The key goes back to "queued" while the retry waits out its 60 s backoff; the settle
    # that writes the retry (it lands after the hook) leaves the failed attempt's record.
    wait_for(
        lambda: (
            record(redis_client, prefix, "k").get("state") == "queued"
            and [run.status for run in runner.run_record(first)] == ["failed"]
        ),
        what="the key queued again and the retry written",
    )

    again = runner.dispatch(JOB, {"later": True}, dedup_key="k")

    assert again == first
    assert record(redis_client, prefix, "k")["id"] == first
    assert redis_client.pttl(record_key(prefix, "k")) > 0
    assert [m["message_id"] for m in stored_messages(redis_client, prefix)] == [first]


def test_a_delayed_keyed_job_holds_its_key_while_it_waits(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry_of(noop))

    first = runner.dispatch(JOB, dedup_key="k", delay_ms=60_000)
    again = runner.dispatch(JOB, dedup_key="k")

    assert again == first
    assert record(redis_client, prefix, "k") == {"id": first, "state": "queued"}
    assert redis_client.pttl(record_key(prefix, "k")) > 60_000
    assert redis_client.hlen(queue_messages(f"{prefix}-worker.DQ")) == 1


# -- while running ----------------------------------------------------------------
def test_six_triggers_during_a_run_give_exactly_one_follow_up_with_the_latest_payload(
    make_runner: RunnerFactory,
    recorder: Recorder,
    redis_client: redis.Redis,
    prefix: str,
    gates: Gates,
) -> None:
    runner = make_runner(registry_of(gates), **recorder.hooks())
    runner.start()
    first = runner.dispatch(JOB, {"gate": "first"}, dedup_key="k")
    recorder.wait_until(lambda r: len(r.of("start")) == 1, what="the first run")

    # When 6 triggers arrive while it runs
    follow_ups = [runner.dispatch(JOB, {"n": n}, dedup_key="k") for n in range(1, 7)]

    # Then they all get the one follow-up's id, and nothing is enqueued yet
    # (the running message stays stored until it is acked)
    assert len(set(follow_ups)) == 1
    assert follow_ups[0] != first
    assert [m["message_id"] for m in stored_messages(redis_client, prefix)] == [first]
    # When the run ends, the follow-up runs once, with the latest payload
    gates.gate("first").set()
    recorder.wait_until(lambda r: len(r.of("complete")) == 2, what="the follow-up")
    wait_for(lambda: key_is_free(redis_client, prefix, "k"), what="the key freed")
    wait_for(lambda: stored_messages(redis_client, prefix) == [], what="the queue drained")
    assert gates.runs == [(first, {"gate": "first"}), (follow_ups[0], {"n": 6})]
    assert len(recorder.of("start")) == 2


def test_the_record_has_a_ttl_in_every_state(
    make_runner: RunnerFactory,
    recorder: Recorder,
    redis_client: redis.Redis,
    prefix: str,
    gates: Gates,
) -> None:
    runner = make_runner(registry_of(gates), **recorder.hooks())
    key = record_key(prefix, "k")

    first = runner.dispatch(JOB, {"gate": "first"}, dedup_key="k")
    assert record(redis_client, prefix, "k")["state"] == "queued"
    assert redis_client.pttl(key) > 0

    runner.start()
    recorder.wait_until(lambda r: len(r.of("start")) == 1, what="the first run")
    assert record(redis_client, prefix, "k") == {"id": first, "state": "running"}
    assert redis_client.pttl(key) > 0

    follow_up = runner.dispatch(JOB, {"gate": "second"}, dedup_key="k")
    assert record(redis_client, prefix, "k")["fid"] == follow_up
    assert redis_client.pttl(key) > 0

    gates.gate("first").set()
    recorder.wait_until(lambda r: len(r.of("start")) == 2, what="the follow-up run")
    assert record(redis_client, prefix, "k") == {"id": follow_up, "state": "running"}
    assert redis_client.pttl(key) > 0

    gates.gate("second").set()
    wait_for(lambda: key_is_free(redis_client, prefix, "k"), what="the key freed")


# -- keys -----------------------------------------------------------------------
def test_different_keys_are_independent(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry_of(noop), **recorder.hooks())

    a1 = runner.dispatch(JOB, {"k": "a"}, dedup_key="a")
    b1 = runner.dispatch(JOB, {"k": "b"}, dedup_key="b")
    a2 = runner.dispatch(JOB, {"k": "a"}, dedup_key="a")

    assert a1 == a2
    assert a1 != b1
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete")) == 2, what="both keys' runs")
    assert sorted(e.message_id for e in recorder.of("complete")) == sorted([a1, b1])


def test_the_same_key_on_two_jobs_is_two_keys(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry_of(noop))

    work = runner.dispatch(JOB, dedup_key="k")
    other = runner.dispatch(OTHER, dedup_key="k")

    assert work != other
    assert len(stored_messages(redis_client, prefix)) == 2


def test_a_dispatch_without_a_key_writes_no_dedup_record(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry_of(noop))

    ids = {runner.dispatch(JOB) for _ in range(3)}

    assert len(ids) == 3
    assert list(redis_client.scan_iter(match=f"kumiko:{prefix}:dedup:*")) == []
    assert all(
        "kumiko_dedup_key" not in m["options"] for m in stored_messages(redis_client, prefix)
    )


def test_the_keyed_message_carries_its_key_and_the_job_options(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    from kumiko_dramatiq import build_message_options

    registry = registry_of(noop, retries=2, backoff="fixed")
    runner = make_runner(registry)

    message_id = runner.dispatch(JOB, {"x": 1}, dedup_key="k")

    [message] = stored_messages(redis_client, prefix)
    assert message["message_id"] == message_id
    assert message["options"]["kumiko_dedup_key"] == "k"
    assert build_message_options(registry.jobs[JOB]).items() <= message["options"].items()


def test_a_per_tenant_key_covers_the_wrapper(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry_of(noop, per_tenant=True))

    first = runner.dispatch(JOB, dedup_key="k")
    again = runner.dispatch(JOB, dedup_key="k")

    assert again == first
    [wrapper] = stored_messages(redis_client, prefix)
    assert wrapper["message_id"] == first
    assert wrapper["actor_name"] != JOB
    assert JOB in wrapper["actor_name"]
    assert wrapper["options"]["kumiko_dedup_key"] == "k"


def test_a_malformed_keyed_message_frees_its_key_when_dead_lettered(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry_of(noop), **recorder.hooks())
    first = runner.dispatch(JOB, dedup_key="k")
    # Corrupt the queued message: no argument instead of one JSON object.
    messages_key = queue_messages(f"{prefix}-worker")
    [(redis_id, data)] = redis_client.hgetall(messages_key).items()
    broken = json.loads(data)
    broken["args"] = []
    redis_client.hset(messages_key, redis_id, json.dumps(broken))

    runner.start()
    wait_for(lambda: key_is_free(redis_client, prefix, "k"), what="the key freed")
    second = runner.dispatch(JOB, dedup_key="k")
    recorder.wait_until(lambda r: len(r.of("complete")) == 1, what="the next run")

    assert second != first
    assert [e.message_id for e in recorder.of("complete")] == [second]
    assert redis_client.zcard(f"dramatiq:{prefix}-worker.XQ") == 1


# -- events -----------------------------------------------------------------------
def event_registry(key_fn: Callable[[dict[str, Any]], Any]) -> Registry:
    """``ev:job:plain`` (declared first, no key) and ``ev:job:keyed`` on ``project.changed``."""
    feature = Feature("ev")
    feature.job("plain", trigger=Event("project.changed"))(noop)
    feature.job("keyed", trigger=Event("project.changed", dedup_key=key_fn))(noop)
    return Registry([feature])


def test_handle_event_dedups_jobs_whose_event_names_a_key_function(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(event_registry(lambda p: f"preempt:{p['project']}"), **recorder.hooks())

    first = [runner.handle_event("project.changed", {"project": 1}) for _ in range(3)]
    other = runner.handle_event("project.changed", {"project": 2})

    plain_ids = [ids[0] for ids in [*first, other]]
    keyed_ids = [ids[1] for ids in first]
    assert len(set(plain_ids)) == 4  # no key: every event enqueues
    assert len(set(keyed_ids)) == 1  # one key: one job
    assert other[1] not in keyed_ids  # another key: another job
    assert record(redis_client, prefix, "preempt:1", "ev:job:keyed")["id"] == keyed_ids[0]
    assert len(stored_messages(redis_client, prefix)) == 6
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete", "ev:job:keyed")) == 2, what="keyed runs")
    wait_for(lambda: key_is_free(redis_client, prefix, "preempt:1", "ev:job:keyed"))
    assert runner.handle_event("project.changed", {"project": 1})[1] not in keyed_ids


@pytest.mark.parametrize(
    "key_fn",
    [lambda p: "", lambda p: 42, lambda p: None, lambda p: p["missing"]],
    ids=["empty", "not-a-string", "none", "raises"],
)
def test_a_bad_key_from_the_key_function_is_a_payload_error_and_enqueues_nothing(
    make_runner: RunnerFactory,
    redis_client: redis.Redis,
    prefix: str,
    key_fn: Callable[[dict[str, Any]], Any],
) -> None:
    runner = make_runner(event_registry(key_fn))

    with pytest.raises(PayloadError, match=r"ev:job:keyed: trigger\.dedup_key"):
        runner.handle_event("project.changed", {"project": 1})

    assert stored_messages(redis_client, prefix) == []
    assert list(redis_client.scan_iter(match=f"kumiko:{prefix}:dedup:*")) == []


def test_dispatch_rejects_an_empty_key_and_enqueues_nothing(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry_of(noop))

    with pytest.raises(PayloadError, match=JOB):
        runner.dispatch(JOB, dedup_key="")

    assert stored_messages(redis_client, prefix) == []


# -- crash recovery ------------------------------------------------------------------
@pytest.fixture
def spawn_worker(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[Any]:
    """``spawn_worker(**env)``: ``dramatiq kumiko_dramatiq.app`` on ``dedup_app``; killed after."""
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(**extra_env: str) -> subprocess.Popen[bytes]:
        log = (tmp_path / f"worker{len(procs)}.log").open("wb")
        env = {
            **os.environ,
            "KUMIKO_APP": "tests.apps.dedup_app:registry",
            "KUMIKO_REDIS_URL": redis_url,
            "KUMIKO_QUEUE_PREFIX": prefix,
            "PYTHONPATH": str(ROOT),
            **extra_env,
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "2"],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.mark.slow
def test_a_worker_killed_mid_run_does_not_strand_its_key(
    make_runner: RunnerFactory,
    spawn_worker: Any,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    producer = make_runner(dedup_app.registry)
    job = dedup_app.BLOCK_ONCE

    def done_ids() -> list[str]:
        raw = redis_client.lrange(dedup_app.record_key(prefix, "done"), 0, -1)
        return [json.loads(item)["id"] for item in raw]

    # Given a keyed run whose worker is killed while the handler blocks
    first = producer.dispatch(job, {"n": 1}, dedup_key="k")
    doomed = spawn_worker()
    wait_for(
        lambda: redis_client.llen(dedup_app.record_key(prefix, "started")) == 1,
        what="the first run to start",
    )
    assert record(redis_client, prefix, "k", job) == {"id": first, "state": "running"}
    os.killpg(doomed.pid, signal.SIGKILL)
    doomed.wait(timeout=10)

    # A trigger while the run is orphaned still coalesces into one follow-up
    follow_up = producer.dispatch(job, {"n": 2}, dedup_key="k")
    assert follow_up != first

    # When a survivor recovers the dead worker's message
    spawn_worker(KUMIKO_HEARTBEAT_TIMEOUT_MS="2000", KUMIKO_MAINTENANCE_CHANCE="1000000")
    wait_for(lambda: done_ids() == [first, follow_up], timeout_s=30, what="redelivery")
    wait_for(lambda: key_is_free(redis_client, prefix, "k", job), what="the key freed")

    # Then the key fires again
    third = producer.dispatch(job, {"n": 3}, dedup_key="k")
    assert third not in (first, follow_up)
    wait_for(lambda: done_ids() == [first, follow_up, third], what="the next run")


# -- sequential hand-off -----------------------------------------------------------------
def test_a_sequential_hand_off_moves_the_key_to_the_requeued_message(
    make_runner: RunnerFactory,
    recorder: Recorder,
    redis_client: redis.Redis,
    prefix: str,
    gates: Gates,
) -> None:
    runner = make_runner(
        registry_of(gates, concurrency="sequential"),
        sequential_retry_delay_ms=100,
        **recorder.hooks(),
    )
    runner.start()
    # Given key "a" running and holding the job's lock
    runner.dispatch(JOB, {"gate": "a"}, dedup_key="a")
    recorder.wait_until(lambda r: len(r.of("start")) == 1, what="key a running")

    # When key "b" finds the lock held and hands off
    first_b = runner.dispatch(JOB, {"key": "b"}, dedup_key="b")
    wait_for(
        lambda: record(redis_client, prefix, "b").get("id", first_b) != first_b,
        what="key b moved to the requeued message",
    )

    # Then the key follows the requeued message, and a trigger gets its id
    moved = record(redis_client, prefix, "b")
    assert moved["state"] == "queued"
    assert redis_client.pttl(record_key(prefix, "b")) > 0
    assert runner.dispatch(JOB, {"key": "b"}, dedup_key="b") == moved["id"]
    # When the lock frees, the requeued message runs and frees key b
    gates.gate("a").set()
    wait_for(lambda: key_is_free(redis_client, prefix, "b"), what="key b freed")
    assert gates.runs[-1] == (moved["id"], {"key": "b"})
