"""An existing Dramatiq app keeps working on kumiko's broker (the contract's "Dramatiq
compatibility"): plain actors keep Dramatiq's semantics, kumiko's jobs keep kumiko's.

The full comparison with Dramatiq's own test suite is ``python -m tests.compat.run``; these
are the fast checks, one behaviour each.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dramatiq
import prometheus_client
import pytest
import redis
from dramatiq import Worker
from dramatiq.broker import Broker
from dramatiq.message import Message
from dramatiq.middleware import Middleware, Retries, TimeLimit, TimeLimitExceeded
from dramatiq.middleware.prometheus import Prometheus

from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.broker.keys import dead_letters
from kumiko_dramatiq.codec import TRIGGER
from kumiko_dramatiq.errors import AppLoadError
from kumiko_dramatiq.loader import load_runner
from kumiko_dramatiq.middleware.timeouts import DRAMATIQ_TIME_LIMIT_MS
from tests.conftest import Recorder, RunnerFactory, wait_for

ROOT = Path(__file__).resolve().parents[2]
assert prometheus_client  # imported before any Prometheus boot: in-process metric values


@pytest.fixture
def plain_queue(prefix: str, redis_client: redis.Redis) -> Iterator[str]:
    """A queue for plain actors that is not a kumiko lane, cleaned up after the test."""
    name = f"{prefix}_plain"
    yield name
    stale = list(redis_client.scan_iter(match=f"dramatiq:*{name}*", count=1000))
    if stale:
        redis_client.delete(*stale)


@contextmanager
def dramatiq_worker(runner: JobRunner) -> Iterator[Worker]:
    """A Dramatiq worker on the runner's broker, given no queues: it consumes what
    ``dramatiq kumiko_dramatiq.app`` consumes (every declared queue but the other lane)."""
    runner.broker.boot_process()
    worker = Worker(runner.broker, worker_threads=4, worker_timeout=100)
    worker.start()
    try:
        yield worker
    finally:
        worker.stop(timeout=10_000)


class Calls:
    """What plain actors were called with, waited on without sleeping."""

    def __init__(self) -> None:
        self.seen: list[Any] = []
        self._cond = threading.Condition()

    def add(self, value: Any) -> None:
        with self._cond:
            self.seen.append(value)
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[list[Any]], bool], timeout_s: float = 20) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self.seen), timeout_s):
                raise AssertionError(f"timed out; calls so far: {self.seen}")


def failing_job_registry(failures: Calls) -> Registry:
    feature = Feature("compat")

    @feature.job("fails", retries=1)
    def fails(payload: dict[str, Any], ctx: JobContext) -> None:
        failures.add(("job", ctx.attempt))
        raise RuntimeError(f"job attempt {ctx.attempt}")

    return Registry([feature])


def test_plain_actors_keep_dramatiqs_retries_and_jobs_keep_kumikos(
    make_runner: RunnerFactory, plain_queue: str, redis_client: redis.Redis
) -> None:
    # Given a kumiko job with retries=1 and a plain actor with max_retries=2, both always
    # failing, on one kumiko broker
    calls = Calls()
    runner = make_runner(failing_job_registry(calls))
    plain_runs = itertools.count(1)

    @dramatiq.actor(
        broker=runner.broker, queue_name=plain_queue, max_retries=2, min_backoff=10, max_backoff=20
    )
    def plain() -> None:
        calls.add(("plain", next(plain_runs)))
        raise RuntimeError("plain fails")

    # When both run on a worker
    with dramatiq_worker(runner):
        plain.send()
        runner.dispatch("compat:job:fails")
        calls.wait_for(lambda seen: len(seen) == 5)
        wait_for(
            lambda: redis_client.zcard(dead_letters(plain_queue)) == 1,
            what="the plain message dead-lettered",
        )
        runner.drain(timeout_s=20)
    # Then each ran as its own semantics say, no more, no less: the plain actor 1 + 2
    # times (Dramatiq's max_retries), the job 1 + 1 times (kumiko's retries)
    assert sorted(calls.seen) == [("job", 1), ("job", 2), ("plain", 1), ("plain", 2), ("plain", 3)]
    # And each was dead-lettered once, on its own queue, with nothing left to retry
    assert len(runner.dead_letters()) == 1
    assert redis_client.llen(f"dramatiq:{plain_queue}") == 0
    assert redis_client.zcard(f"dramatiq:{plain_queue}.DQ:schedule") == 0


def test_dramatiqs_retry_options_are_accepted_on_plain_actors(make_runner: RunnerFactory) -> None:
    # Given a kumiko broker, When a plain actor declares every option of Dramatiq's Retries
    runner = make_runner(Registry([]))
    options: dict[str, Any] = {
        "max_retries": 3,
        "min_backoff": 10,
        "max_backoff": 100,
        "retry_when": lambda retries, exc: retries < 2,
        "throws": (ValueError,),
        "on_retry_exhausted": "exhausted",
    }
    declared = dramatiq.actor(broker=runner.broker, **options)(lambda: None)
    # Then it is declared with them (Dramatiq raises for an option no middleware defines)
    assert runner.broker.get_actor(declared.actor_name).options == options


def test_a_plain_actor_that_throws_an_expected_error_is_dead_lettered_unretried(
    make_runner: RunnerFactory, plain_queue: str, redis_client: redis.Redis
) -> None:
    calls = Calls()
    runner = make_runner(Registry([]))

    @dramatiq.actor(broker=runner.broker, queue_name=plain_queue, throws=(ValueError,))
    def refuses() -> None:
        calls.add("ran")
        raise ValueError("not retried")

    with dramatiq_worker(runner):
        refuses.send()
        wait_for(lambda: redis_client.zcard(dead_letters(plain_queue)) == 1)
    assert calls.seen == ["ran"]


def test_a_pipeline_of_plain_actors_runs_every_step(
    make_runner: RunnerFactory, plain_queue: str
) -> None:
    calls = Calls()
    runner = make_runner(Registry([]))

    @dramatiq.actor(broker=runner.broker, queue_name=plain_queue)
    def add(x: int, y: int) -> int:
        calls.add(("add", x, y))
        return x + y

    with dramatiq_worker(runner):
        steps = [add.message(1, 2), *(add.message_with_options(args=(n,)) for n in (3, 4))]
        dramatiq.pipeline(steps, broker=runner.broker).run()  # type: ignore[no-untyped-call]
        calls.wait_for(lambda seen: len(seen) == 3)
    # Each step got the previous step's result as its last argument
    assert calls.seen == [("add", 1, 2), ("add", 3, 3), ("add", 4, 6)]


def test_a_worker_given_no_queues_consumes_non_lane_queues_but_not_the_other_lane(
    make_runner: RunnerFactory, prefix: str
) -> None:
    # Given a "worker" lane runner's broker declaring a plain actor's queue "default", the
    # worker lane's and the api lane's queues
    broker = make_runner(Registry([]), lane="worker").broker
    for queue in ("default", f"{prefix}-worker", f"{prefix}-api"):
        broker.declare_queue(queue)
    worker = Worker(broker)
    # When a worker with no queues boots, and queues are declared after it booted
    broker.route_worker(worker)
    broker.declare_queue("reports")
    broker.declare_queue(f"{prefix}-api.DQ")
    # Then it consumes its lane and every plain queue (and their delay queues), never the
    # other lane
    assert worker.consumer_whitelist == {"default", f"{prefix}-worker", "reports"}
    assert broker.consumes("default.DQ")
    assert not broker.consumes(f"{prefix}-api.DQ")


def test_a_worker_given_queues_keeps_them(make_runner: RunnerFactory, prefix: str) -> None:
    broker = make_runner(Registry([]), lane="worker").broker
    worker = Worker(broker, queues={f"{prefix}-worker"})
    broker.route_worker(worker)
    broker.declare_queue("default")
    assert worker.consumer_whitelist == {f"{prefix}-worker"}


def test_plain_actors_get_dramatiqs_ten_minute_limit_and_jobs_their_timeout_ms(
    make_runner: RunnerFactory, plain_queue: str
) -> None:
    calls = Calls()
    feature = Feature("limits")

    @feature.job("unlimited")
    def unlimited(payload: dict[str, Any], ctx: JobContext) -> None:
        calls.add(("job", manager.deadlines[threading.get_ident()] - time.monotonic()))

    runner = make_runner(Registry([feature]), timeout_check_ms=50)
    (timeouts,) = [m for m in runner.broker.middleware if isinstance(m, TimeLimit)]
    manager: Any = timeouts.manager  # Dramatiq's timer: deadlines by thread id

    @dramatiq.actor(broker=runner.broker, queue_name=plain_queue)
    def plain() -> None:
        calls.add(("plain", manager.deadlines[threading.get_ident()] - time.monotonic()))

    @dramatiq.actor(broker=runner.broker, queue_name=plain_queue, time_limit=100, max_retries=0)
    def too_slow() -> None:
        try:
            while True:  # Python code: interrupted by the time limit
                time.sleep(0.01)
        except TimeLimitExceeded:
            calls.add(("too_slow", "interrupted"))
            raise

    with dramatiq_worker(runner):
        plain.send()
        runner.dispatch("limits:job:unlimited")
        too_slow.send()
        calls.wait_for(lambda seen: len(seen) == 3)
    left = dict(calls.seen)
    # A plain actor that sets no time_limit has Dramatiq's default: 10 minutes from its start
    assert DRAMATIQ_TIME_LIMIT_MS / 1000 - 60 < left["plain"] <= DRAMATIQ_TIME_LIMIT_MS / 1000
    # A kumiko job without timeout_ms has none
    assert left["job"] == float("inf")
    # And a plain actor's own time_limit interrupts it
    assert left["too_slow"] == "interrupted"


class HandoffSeen(Middleware):
    """Notes the enqueue of a sequential hand-off (trigger "requeue")."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def after_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        if message.options.get(TRIGGER) == "requeue":
            self.event.set()


class SeesHandoffs(Middleware):
    """A guest that asks to see hand-offs (``sees_handoffs``): counts those it sees."""

    sees_handoffs = True

    def __init__(self) -> None:
        self.handed_off = 0

    def after_process_message(
        self, broker: Broker, message: Any, *, result: Any = None, exception: Any = None
    ) -> None:
        execution = getattr(message, "execution", None)
        if execution is not None and execution.handed_off:
            self.handed_off += 1


def sample(metric: Any, actor: str, suffix: str = "_total") -> float:
    """The value of ``metric`` for ``actor`` (public ``collect()`` API)."""
    for family in metric.collect():
        for each in family.samples:
            if each.name.endswith(suffix) and each.labels.get("actor_name") == actor:
                return float(each.value)
    return 0.0


def test_prometheus_counts_runs_not_handoffs_and_counts_retries(
    make_runner: RunnerFactory, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Dramatiq's Prometheus sets these in after_process_boot: set then delete them through
    # monkeypatch, so that the teardown removes whatever it left (a bare delenv of an unset
    # variable records nothing, and the variables leaked into later tests' subprocesses)
    for name in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    release = threading.Event()
    feature = Feature("prom")

    @feature.job("one_at_a_time", concurrency="sequential")
    def one_at_a_time(payload: dict[str, Any], ctx: JobContext) -> None:
        release.wait(20)

    @feature.job("flaky", retries=1)
    def flaky(payload: dict[str, Any], ctx: JobContext) -> None:
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")

    runner = make_runner(
        Registry([feature]), sequential_retry_delay_ms=50, idle_wait_ms=50, **recorder.hooks()
    )
    runner.start()
    # Given Dramatiq's Prometheus, added after the runner started (it is booted at once)
    prometheus = Prometheus()
    handoffs = HandoffSeen()
    aware = SeesHandoffs()
    for guest in (prometheus, handoffs, aware):
        runner.broker.add_middleware(guest)
    # When a sequential job runs twice, the second run handing off while the first holds
    # the lock, and a job fails once then succeeds on its retry
    runner.dispatch("prom:job:one_at_a_time")
    recorder.wait_until(lambda r: len(r.of("start", "prom:job:one_at_a_time")) == 1)
    runner.dispatch("prom:job:one_at_a_time")
    assert handoffs.event.wait(20), "the second run never handed off"
    release.set()
    runner.dispatch("prom:job:flaky")
    recorder.wait_until(lambda r: len(r.of("complete")) == 3, what="three runs complete")
    runner.drain(timeout_s=20)
    # Then Prometheus counted the runs, not the hand-offs: 2 messages, 2 durations, none
    # in progress
    sequential = "prom:job:one_at_a_time"
    assert sample(prometheus.total_messages, sequential) == 2
    assert sample(prometheus.message_durations, sequential, "_count") == 2
    assert sample(prometheus.inprogress_messages, sequential, "inprogress") == 0
    # And it counted the retry: 2 attempts of which 1 errored and 1 was retried
    assert sample(prometheus.total_messages, "prom:job:flaky") == 2
    assert sample(prometheus.total_errored_messages, "prom:job:flaky") == 1
    assert sample(prometheus.total_retried_messages, "prom:job:flaky") == 1
    # While a guest that asks to see hand-offs saw them
    assert aware.handed_off >= 1


def worker_env(redis_url: str, prefix: str, app: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(
        PYTHONPATH=str(ROOT), KUMIKO_REDIS_URL=redis_url, KUMIKO_QUEUE_PREFIX=prefix, KUMIKO_APP=app
    )
    return env


def test_an_actor_declared_in_the_app_module_binds_to_the_apps_kumiko_broker(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given KUMIKO_APP naming a module that declares a plain @dramatiq.actor at import
    for name, value in worker_env(redis_url, prefix, "tests.apps.compat_app:registry").items():
        if name.startswith("KUMIKO_"):
            monkeypatch.setenv(name, value)
    monkeypatch.delitem(sys.modules, "tests.apps.compat_app", raising=False)
    before = dramatiq.broker.global_broker
    # When the app is loaded
    runner = load_runner()
    try:
        app = sys.modules["tests.apps.compat_app"]
        # Then the actor is bound to the app's kumiko broker, declared on it, and Dramatiq's
        # global broker is as it was
        assert app.record.broker is runner.broker
        assert runner.broker.get_actor("record") is app.record
        assert dramatiq.broker.global_broker is before
    finally:
        runner.stop()
        loaded = sys.modules.pop("tests.apps.compat_app", None)
        if loaded is not None:
            loaded.with_dramatiq_retries.stop()


@pytest.mark.slow
def test_the_cli_worker_consumes_a_plain_actors_queue(
    redis_url: str, prefix: str, plain_queue: str, redis_client: redis.Redis
) -> None:
    # Given `dramatiq kumiko_dramatiq.app` on an app whose module declares a plain actor
    worker = subprocess.Popen(
        [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "2"],
        cwd=ROOT,
        env=worker_env(redis_url, prefix, "tests.apps.compat_app:registry"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # When a message for it is sent to its queue (not a lane)
        with JobRunner(Registry([]), redis_url=redis_url, queue_prefix=prefix) as producer:
            producer.broker.enqueue(
                Message(
                    queue_name=plain_queue,
                    actor_name="record",
                    args=("hello",),
                    kwargs={},
                    options={},
                )
            )
        # Then the worker runs it
        seen = f"kumiko:{prefix}:test:seen"
        wait_for(lambda: redis_client.llen(seen) == 1, timeout_s=60, what="the plain actor ran")
        assert redis_client.lrange(seen, 0, -1) == [b"hello"]
        assert worker.poll() is None
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def test_the_cli_refuses_a_broker_carrying_dramatiqs_retries_like_start_does(
    redis_url: str, prefix: str, make_runner: RunnerFactory
) -> None:
    # Given an app whose runner's broker also carries Dramatiq's own Retries
    done = subprocess.run(
        [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "1"],
        cwd=ROOT,
        env=worker_env(redis_url, prefix, "tests.apps.compat_app:with_dramatiq_retries"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    # Then the CLI worker refuses to start, in one line, as JobRunner.start() refuses
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("kumiko_dramatiq.app:")]
    assert len(ours) == 1, done.stderr
    assert "must not include dramatiq's Retries" in ours[0]
    runner = make_runner(Registry([]))
    runner.broker.add_middleware(Retries())
    with pytest.raises(ValueError, match="must not include dramatiq's Retries"):
        runner.start()


class AckCounter(Middleware):
    """Counts the acks it sees."""

    def __init__(self) -> None:
        self.acks = 0

    def after_ack(self, broker: Broker, message: Any) -> None:
        self.acks += 1


def test_a_middleware_put_into_or_taken_out_of_the_list_is_seen_at_the_next_message(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    # Given a running worker whose middleware list is changed in place (no add_middleware)
    feature = Feature("inplace")

    @feature.job("noop")
    def noop(payload: dict[str, Any], ctx: JobContext) -> None:
        pass

    runner = make_runner(Registry([feature]), **recorder.hooks())
    runner.start()
    runner.dispatch("inplace:job:noop")
    runner.drain(timeout_s=20)
    counter = AckCounter()
    runner.broker.middleware.insert(0, counter)
    # When two messages run with it in the list, then one after it was taken out
    for _ in range(2):
        runner.dispatch("inplace:job:noop")
    runner.drain(timeout_s=20)
    runner.broker.middleware.remove(counter)
    runner.dispatch("inplace:job:noop")
    runner.drain(timeout_s=20)
    # Then it saw exactly the acks of the two messages that ran while it was there
    assert len(recorder.of("complete")) == 4
    assert counter.acks == 2


def load_app(monkeypatch: pytest.MonkeyPatch, redis_url: str, prefix: str, app: str) -> None:
    """Set the ``KUMIKO_*`` variables for ``app`` and forget its modules (fresh import)."""
    for name, value in worker_env(redis_url, prefix, app).items():
        if name.startswith("KUMIKO_"):
            monkeypatch.setenv(name, value)
    for module in ("tests.apps.kept_broker_app", "tests.apps.kept_broker_tasks"):
        monkeypatch.delitem(sys.modules, module, raising=False)


def test_a_reference_to_the_global_broker_kept_at_import_acts_as_the_apps_kumiko_broker(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an app module importing an unchanged module that kept dramatiq.get_broker()
    load_app(monkeypatch, redis_url, prefix, "tests.apps.kept_broker_app:runner")
    # When the app is loaded
    runner = load_runner()
    try:
        kept = sys.modules["tests.apps.kept_broker_tasks"].broker
        # Then what the reference reads and calls is the kumiko broker's
        assert kept.enqueue == runner.broker.enqueue
        assert kept.actors is runner.broker.actors
        assert kept.get_actor("relay").broker is runner.broker
        assert kept.get_declared_queues() == runner.broker.get_declared_queues()
        # And the middleware added through it at import is on the kumiko broker
        assert type(runner.broker.middleware[-1]).__name__ == "Processed"
    finally:
        runner.stop()


def test_a_message_sent_through_a_kept_reference_after_a_failed_load_says_so(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an app whose module imports, but whose attribute does not exist
    load_app(monkeypatch, redis_url, prefix, "tests.apps.kept_broker_app:nothing")
    with pytest.raises(AppLoadError, match="has no attribute 'nothing'"):
        load_runner()
    # When a message is sent through the reference kept at import
    tasks = sys.modules["tests.apps.kept_broker_tasks"]
    with pytest.raises(AppLoadError) as raised:
        tasks.record.send("lost")
    # Then the error says the app did not load (not that it is being imported), in one line
    message = str(raised.value)
    assert "the app is not loaded (it failed to load" in message
    assert "being imported" not in message
    assert "\n" not in message


@pytest.mark.slow
def test_the_cli_worker_runs_a_module_that_kept_the_global_broker_from_its_import(
    redis_url: str, prefix: str, plain_queue: str, redis_client: redis.Redis
) -> None:
    # Given `dramatiq kumiko_dramatiq.app` on a docs-style app.py importing an unchanged
    # module that kept dramatiq.get_broker() at import and added a middleware through it
    worker = subprocess.Popen(
        [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "2"],
        cwd=ROOT,
        env=worker_env(redis_url, prefix, "tests.apps.kept_broker_app:runner"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # When its actor runs, enqueueing through the kept reference and looking an actor
        # up on it
        with JobRunner(Registry([]), redis_url=redis_url, queue_prefix=prefix) as producer:
            producer.broker.enqueue(
                Message(
                    queue_name=plain_queue,
                    actor_name="relay",
                    args=("hi",),
                    kwargs={},
                    options={},
                )
            )
        # Then both messages reach the app's kumiko broker and run, once each
        seen = f"kumiko:{prefix}:test:seen"
        processed = f"kumiko:{prefix}:test:processed"
        wait_for(
            lambda: redis_client.llen(processed) == 3,
            timeout_s=60,
            what="relay and both record messages processed",
        )
        assert sorted(redis_client.lrange(seen, 0, -1)) == [b"hi via enqueue", b"hi via get_actor"]
        # And the middleware added through the reference saw every message
        assert sorted(redis_client.lrange(processed, 0, -1)) == [b"record", b"record", b"relay"]
        assert worker.poll() is None
    finally:
        worker.terminate()
        try:
            _, stderr = worker.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            _, stderr = worker.communicate()
    assert "AppLoadError" not in stderr


def test_the_cli_worker_refuses_an_app_that_sends_a_message_at_import_in_one_line(
    redis_url: str, prefix: str
) -> None:
    # Given an app module that sends a message while it is imported
    done = subprocess.run(
        [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "1"],
        cwd=ROOT,
        env=worker_env(redis_url, prefix, "tests.apps.import_send_app:registry"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    # Then the worker refuses to start, in one line naming the app and the actor
    assert done.returncode == 2, done.stderr
    ours = [line for line in done.stderr.splitlines() if line.startswith("kumiko_dramatiq.app:")]
    assert ours == [
        "kumiko_dramatiq.app: KUMIKO_APP='tests.apps.import_send_app:registry': actor 'ping' "
        "sent a message while the module was being imported, before the app's kumiko broker "
        "exists: send messages once the app is loaded, not at import"
    ], done.stderr
    assert "Traceback" not in done.stderr


def test_a_plain_queue_whose_prefetch_is_full_takes_the_next_message_as_one_finishes(
    make_runner: RunnerFactory, plain_queue: str
) -> None:
    # Given a worker with one thread (a prefetch of 2) that polls rarely (an idle wait of
    # 2 x 3 s): a consumer holding its prefetch that waited for a poll would idle seconds after
    # every two messages (issue 31)
    calls = Calls()
    runner = make_runner(Registry([]))

    @dramatiq.actor(broker=runner.broker, queue_name=plain_queue, max_retries=0)
    def plain(n: int) -> None:
        time.sleep(0.05)  # the work: the consumer finds its prefetch still full when it looks
        calls.add(n)

    runner.broker.boot_process()
    worker = Worker(runner.broker, worker_threads=1, worker_timeout=3_000)
    worker.start()
    try:
        # When twenty messages are sent at once
        for n in range(20):
            plain.send(n)
        # Then each finished one lets the next in: all run long before the idle waits a
        # consumer waiting for a poll would add up (up to 2 x 3 s after every two)
        calls.wait_for(lambda seen: len(seen) == 20, timeout_s=15)
    finally:
        worker.stop(timeout=10_000)
    assert sorted(calls.seen) == list(range(20))
