"""Boot-once jobs and boot gates, against a real Redis.

Boot-once counting is done by accounting for every boot message: after the
runners stopped (a stop waits for running handlers and puts prefetched
messages back), each boot message ever enqueued either ran (a start hook) or
is still in the lane queue's message hash.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from dramatiq.broker import Broker
from dramatiq.message import Message
from dramatiq.middleware import Middleware

from kumiko_dramatiq import (
    Backoff,
    Feature,
    JobConfigError,
    JobContext,
    Registry,
    build_message_options,
)
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.keys import queue_list, queue_messages
from kumiko_dramatiq.errors import BootGateError
from kumiko_dramatiq.ids import boot_message_id
from kumiko_dramatiq.middleware.boot import reset_boot_marker
from tests.apps import boot_app
from tests.conftest import Recorder, RunnerFactory, wait_for

GATE = "boot:job:check_schema"
BOOT = "boot:job:warm_cache"
NOOP = "boot:job:noop"
ROOT = Path(__file__).resolve().parents[2]


def ok(payload: dict[str, Any], ctx: JobContext) -> None:
    pass


def make_app(
    *,
    gate: Any = None,
    boot: Any = ok,
    gate_options: dict[str, Any] | None = None,
    boot_options: dict[str, Any] | None = None,
) -> Registry:
    """One feature "boot": an optional gate, an optional boot-once job, a plain job."""
    feature = Feature("boot")
    if gate is not None:
        feature.job("check_schema", boot_gate=True, **(gate_options or {}))(gate)
    if boot is not None:
        feature.job("warm_cache", run_on_boot=True, **(boot_options or {}))(boot)
    feature.job("noop")(ok)
    return Registry([feature])


def queued_ids(client: redis.Redis, prefix: str, lane: str = "worker") -> list[str]:
    """Message ids held in the lane queue (main and delay queue) right now."""
    found: list[str] = []
    for queue in (f"{prefix}-{lane}", f"{prefix}-{lane}.DQ"):
        for data in client.hvals(queue_messages(queue)):
            raw = data if isinstance(data, bytes) else data.encode()
            found.append(Message.decode(raw).message_id)
    return found


def boot_messages_seen(recorder: Recorder, client: redis.Redis, prefix: str, job: str) -> int:
    """Distinct first deliveries of ``job``'s boot id that ran, plus those still queued."""
    boot_id = boot_message_id(job, prefix)
    ran = [e for e in recorder.of("start", job) if e.message_id == boot_id and e.meta.attempt == 1]
    return len(ran) + queued_ids(client, prefix).count(boot_id)


def queue_length(client: redis.Redis, prefix: str, lane: str = "worker") -> int:
    return int(client.llen(queue_list(f"{prefix}-{lane}")))


class EnqueueLog(Middleware):
    """Records every message the broker actually enqueued."""

    def __init__(self) -> None:
        self.messages: list[Message[Any]] = []
        self._lock = threading.Lock()

    def after_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        with self._lock:
            self.messages.append(message)


# -- boot-once -------------------------------------------------------------
def test_two_starts_in_a_row_run_the_gate_twice_and_the_boot_job_once(
    make_runner: RunnerFactory, prefix: str, redis_client: redis.Redis, recorder: Recorder
) -> None:
    gate_runs: list[str] = []
    app = make_app(gate=lambda payload, ctx: gate_runs.append(ctx.message_id))

    first = make_runner(app, **recorder.hooks())
    first.start()
    recorder.wait_until(lambda r: len(r.of("complete", BOOT)) == 1, what="the boot job")
    first.stop()
    second = make_runner(app, **recorder.hooks())
    second.start()
    second.stop()

    assert len(gate_runs) == 2
    assert boot_messages_seen(recorder, redis_client, prefix, BOOT) == 1


def test_four_concurrent_starts_enqueue_the_boot_job_once(
    make_runner: RunnerFactory, prefix: str, redis_client: redis.Redis, recorder: Recorder
) -> None:
    app = make_app()
    runners = [make_runner(app, **recorder.hooks()) for _ in range(4)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(runners))

    def start(runner: Any) -> None:
        try:
            barrier.wait()
            runner.start()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(runner,)) for runner in runners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    recorder.wait_until(lambda r: len(r.of("complete", BOOT)) >= 1, what="the boot job")
    for runner in runners:
        runner.stop()

    assert errors == []
    assert boot_messages_seen(recorder, redis_client, prefix, BOOT) == 1


def test_a_start_after_a_crash_between_enqueue_and_marker_does_not_enqueue_again(
    make_runner: RunnerFactory, prefix: str, redis_client: redis.Redis, recorder: Recorder
) -> None:
    app = make_app()
    first = make_runner(app, **recorder.hooks())
    first.start()
    first.stop()
    # Given the state a crash right after the enqueue would leave: the message
    # and its id guard are written, the marker is not.
    marker = keys.boot_marker(prefix, BOOT)
    guard = keys.enqueue_guard(prefix, boot_message_id(BOOT, prefix))
    redis_client.delete(marker)
    assert redis_client.exists(guard)

    # When the next worker starts
    second = make_runner(app, **recorder.hooks())
    second.start()
    second.stop()

    # Then the guard stops a second message and the marker is back
    assert boot_messages_seen(recorder, redis_client, prefix, BOOT) == 1
    assert redis_client.get(marker) == boot_message_id(BOOT, prefix).encode()


def test_the_boot_marker_has_no_ttl_and_the_guard_lives_completed_age(
    make_runner: RunnerFactory, prefix: str, redis_client: redis.Redis
) -> None:
    from kumiko_dramatiq import Retention

    runner = make_runner(make_app(), retention=Retention(completed_age_s=3_600))
    runner.start()
    runner.stop()

    assert redis_client.ttl(keys.boot_marker(prefix, BOOT)) == -1
    guard_ttl_s = redis_client.ttl(keys.enqueue_guard(prefix, boot_message_id(BOOT, prefix)))
    assert 3_500 < guard_ttl_s <= 3_600


def test_the_boot_message_has_the_fixed_id_trigger_boot_and_the_job_options(
    make_runner: RunnerFactory, prefix: str
) -> None:
    app = make_app(boot_options={"retries": 2, "backoff": Backoff("fixed", delay_ms=250)})
    runner = make_runner(app)
    log = EnqueueLog()
    runner.broker.add_middleware(log)
    runner.start()
    runner.stop()

    [message] = log.messages
    assert message.message_id == boot_message_id(BOOT, prefix)
    assert message.actor_name == BOOT
    assert message.queue_name == f"{prefix}-worker"
    assert message.options["kumiko_trigger"] == "boot"
    assert build_message_options(app.jobs[BOOT]).items() <= message.options.items()


def test_a_failing_boot_job_is_retried_on_its_fixed_id(
    make_runner: RunnerFactory, prefix: str, recorder: Recorder
) -> None:
    def flaky(payload: dict[str, Any], ctx: JobContext) -> None:
        if ctx.attempt == 1:
            raise RuntimeError("cache backend still warming up")

    runner = make_runner(
        make_app(boot=flaky, boot_options={"retries": 1, "backoff": Backoff("fixed", 50)}),
        **recorder.hooks(),
    )
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete", BOOT)) == 1, what="the retry")

    boot_id = boot_message_id(BOOT, prefix)
    [failed] = recorder.of("failed", BOOT)
    [completed] = recorder.of("complete", BOOT)
    assert (failed.message_id, failed.meta.attempt) == (boot_id, 1)
    assert (completed.message_id, completed.meta.attempt) == (boot_id, 2)
    assert completed.meta.trigger == "boot"
    assert completed.meta.final_attempt


def test_a_per_tenant_boot_job_enqueues_its_wrapper_with_the_fixed_id(
    make_runner: RunnerFactory, prefix: str, recorder: Recorder
) -> None:
    feature = Feature("boot")
    feature.job("warm_cache", run_on_boot=True, per_tenant=True)(ok)
    runner = make_runner(
        Registry([feature]), get_active_tenant_ids=lambda: ["a", "b"], **recorder.hooks()
    )
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete", BOOT)) == 3, what="wrapper and 2 children")

    wrapper = [e for e in recorder.of("start", BOOT) if e.meta.trigger == "boot"]
    assert [e.message_id for e in wrapper] == [boot_message_id(BOOT, prefix)]
    assert sorted(e.meta.tenant_id or "" for e in recorder.of("complete", BOOT)) == ["", "a", "b"]


def test_boot_jobs_and_gates_of_another_lane_stay_untouched(
    make_runner: RunnerFactory, prefix: str, redis_client: redis.Redis
) -> None:
    gate_runs: list[int] = []
    app = make_app(
        gate=lambda payload, ctx: gate_runs.append(1),
        gate_options={"run_in": "api"},
        boot_options={"run_in": "api"},
    )
    runner = make_runner(app, lane="worker")
    runner.start()
    runner.stop()

    assert gate_runs == []
    assert not redis_client.exists(keys.boot_marker(prefix, BOOT))
    assert queue_length(redis_client, prefix, "api") == 0


def test_reset_boot_marker_makes_the_next_start_enqueue_the_job_again(
    make_runner: RunnerFactory, prefix: str, redis_url: str, recorder: Recorder
) -> None:
    app = make_app()
    first = make_runner(app, **recorder.hooks())
    first.start()
    recorder.wait_until(lambda r: len(r.of("complete", BOOT)) == 1, what="the first run")
    first.stop()

    assert reset_boot_marker(redis_url, prefix, BOOT) is True
    second = make_runner(app, **recorder.hooks())
    second.start()

    recorder.wait_until(lambda r: len(r.of("complete", BOOT)) == 2, what="the run after reset")
    # the history keeps both runs: the run after the reset has an id of its own
    wait_for(lambda: len(second.runs(BOOT, status="completed")) == 2, what="both runs' records")
    runs = second.runs(BOOT, status="completed")
    assert len({r.run_id for r in runs}) == 2
    assert boot_message_id(BOOT, prefix) in {r.message_id for r in runs}


def test_reset_boot_marker_reports_that_there_was_nothing_to_reset(
    prefix: str, redis_client: redis.Redis
) -> None:
    assert reset_boot_marker(redis_client, prefix, BOOT) is False


def test_reset_boot_marker_rejects_a_name_that_is_not_a_qualified_job_name(
    prefix: str, redis_client: redis.Redis
) -> None:
    with pytest.raises(JobConfigError, match="job_name must be a qualified job name"):
        reset_boot_marker(redis_client, prefix, "warm_cache")


# -- gates -----------------------------------------------------------------
def failing_gate(payload: dict[str, Any], ctx: JobContext) -> None:
    raise RuntimeError("schema version 3 required, found 2")


GATE_RETRIES = {"retries": 2, "backoff": Backoff("fixed", delay_ms=10)}


def test_a_gate_that_still_fails_makes_start_raise_with_the_gates_own_error(
    make_runner: RunnerFactory,
) -> None:
    runner = make_runner(make_app(gate=failing_gate, gate_options=GATE_RETRIES))

    with pytest.raises(BootGateError, match=r"after 3 attempt.*schema version 3 required"):
        runner.start()


def test_a_failing_gate_leaves_queued_work_queued_and_consumes_nothing(
    make_runner: RunnerFactory, prefix: str, redis_client: redis.Redis, recorder: Recorder
) -> None:
    app = make_app(gate=failing_gate)
    queued_id = make_runner(app).dispatch(NOOP)
    assert queue_length(redis_client, prefix) == 1

    runner = make_runner(app, **recorder.hooks())
    with pytest.raises(BootGateError):
        runner.start()

    assert queue_length(redis_client, prefix) == 1
    assert queued_ids(redis_client, prefix) == [queued_id]
    assert recorder.of("start", NOOP) == []


def test_a_failing_gate_enqueues_no_boot_job(
    make_runner: RunnerFactory, prefix: str, redis_client: redis.Redis
) -> None:
    runner = make_runner(make_app(gate=failing_gate))
    with pytest.raises(BootGateError):
        runner.start()

    assert not redis_client.exists(keys.boot_marker(prefix, BOOT))
    assert queued_ids(redis_client, prefix) == []


def test_a_failing_gate_reports_each_attempt_to_the_hooks(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    runner = make_runner(make_app(gate=failing_gate, gate_options=GATE_RETRIES), **recorder.hooks())
    with pytest.raises(BootGateError):
        runner.start()

    failed = recorder.of("failed", GATE)
    assert [e.meta.attempt for e in recorder.of("start", GATE)] == [1, 2, 3]
    assert [(e.meta.attempt, e.meta.final_attempt) for e in failed] == [
        (1, False),
        (2, False),
        (3, True),
    ]
    assert {(e.meta.trigger, e.meta.max_attempts) for e in failed} == {("gate", 3)}
    assert len({e.message_id for e in failed}) == 1
    assert all(isinstance(e.exc, RuntimeError) for e in failed)


def test_a_gate_that_passes_on_a_retry_lets_the_worker_consume(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    def flaky_gate(payload: dict[str, Any], ctx: JobContext) -> None:
        if ctx.attempt < 3:
            raise ConnectionError("database not up yet")

    runner = make_runner(make_app(gate=flaky_gate, gate_options=GATE_RETRIES), **recorder.hooks())
    runner.start()
    message_id = runner.dispatch(NOOP)

    recorder.wait_until(lambda r: len(r.of("complete", NOOP)) == 1, what="the queued job")
    assert [e.meta.attempt for e in recorder.of("complete", GATE)] == [3]
    assert recorder.of("complete", NOOP)[0].message_id == message_id


def test_gates_run_in_declaration_order_before_the_boot_job_is_enqueued(
    make_runner: RunnerFactory, prefix: str, redis_client: redis.Redis
) -> None:
    seen: list[tuple[str, bool]] = []
    marker = keys.boot_marker(prefix, "second:job:warm_cache")

    def gate(name: str) -> Any:
        def run(payload: dict[str, Any], ctx: JobContext) -> None:
            seen.append((name, bool(redis_client.exists(marker))))

        return run

    first, second = Feature("first"), Feature("second")
    first.job("b_gate", boot_gate=True)(gate("first:b"))
    first.job("a_gate", boot_gate=True)(gate("first:a"))
    second.job("warm_cache", run_on_boot=True)(ok)
    second.job("gate", boot_gate=True)(gate("second"))
    runner = make_runner(Registry([first, second]))
    runner.start()
    runner.stop()

    assert seen == [("first:b", False), ("first:a", False), ("second", False)]
    assert redis_client.exists(marker)


def test_gates_after_a_failing_gate_do_not_run(make_runner: RunnerFactory) -> None:
    later: list[int] = []
    feature = Feature("boot")
    feature.job("broken", boot_gate=True)(failing_gate)
    feature.job("later", boot_gate=True)(lambda payload, ctx: later.append(1))
    runner = make_runner(Registry([feature]))

    with pytest.raises(BootGateError, match="boot:job:broken"):
        runner.start()
    assert later == []


def test_a_gate_sees_the_runner_context_as_ctx_app(make_runner: RunnerFactory) -> None:
    seen: list[Any] = []
    app_context = {"db": "postgres://example"}
    runner = make_runner(
        make_app(gate=lambda payload, ctx: seen.append((ctx.app, payload, ctx.job_name))),
        context=app_context,
    )
    runner.start()

    assert seen == [(app_context, {}, GATE)]


def test_an_async_gate_runs_and_its_failure_fails_the_start(make_runner: RunnerFactory) -> None:
    async def async_gate(payload: dict[str, Any], ctx: JobContext) -> None:
        raise LookupError(f"feature flag missing (attempt {ctx.attempt})")

    runner = make_runner(make_app(gate=async_gate, gate_options={"retries": 1}))

    with pytest.raises(BootGateError, match=r"LookupError: feature flag missing \(attempt 2\)"):
        runner.start()


def test_an_async_gate_that_passes_lets_the_worker_start(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    async def async_gate(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    runner = make_runner(make_app(gate=async_gate), **recorder.hooks())
    runner.start()

    assert [e.meta.trigger for e in recorder.of("complete", GATE)] == ["gate"]


def test_a_gate_attempt_over_its_timeout_is_interrupted_and_fails(
    make_runner: RunnerFactory,
) -> None:
    interrupted = threading.Event()
    release = threading.Event()

    def slow_gate(payload: dict[str, Any], ctx: JobContext) -> None:
        try:
            while not release.is_set():
                time.sleep(0.01)
        except BaseException:
            interrupted.set()
            raise

    runner = make_runner(make_app(gate=slow_gate, gate_options={"timeout_ms": 200}))
    try:
        with pytest.raises(BootGateError, match="exceeded timeout_ms=200"):
            runner.start()
        assert interrupted.wait(10)
    finally:
        release.set()


def test_boot_gate_with_sequential_concurrency_is_rejected() -> None:
    feature = Feature("boot")
    with pytest.raises(JobConfigError, match="boot_gate with concurrency"):
        feature.job("gate", boot_gate=True, concurrency="sequential")(ok)


# -- the CLI worker and the kumiko command --------------------------------
def subprocess_env(app: str, redis_url: str, prefix: str) -> dict[str, str]:
    return {
        **os.environ,
        "KUMIKO_APP": app,
        "KUMIKO_REDIS_URL": redis_url,
        "KUMIKO_QUEUE_PREFIX": prefix,
        "PYTHONPATH": str(ROOT),
    }


@pytest.fixture
def worker_cli(redis_url: str, prefix: str) -> Iterator[Any]:
    """``worker_cli(app)`` runs ``dramatiq kumiko_dramatiq.app -p 2 -t 1``; killed after."""
    procs: list[subprocess.Popen[str]] = []

    def start(app: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "2", "-t", "1"],
            env=subprocess_env(app, redis_url, prefix),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)


def records(client: redis.Redis, prefix: str, what: str) -> list[str]:
    """The pids that ran ``what`` ("gate" or "boot") in ``tests.apps.boot_app``."""
    return [str(pid) for pid in client.lrange(boot_app.record_key(prefix, what), 0, -1)]


@pytest.mark.slow
def test_the_cli_worker_with_two_processes_runs_the_gate_in_each_and_the_boot_job_once(
    worker_cli: Any, prefix: str, redis_client: redis.Redis
) -> None:
    proc = worker_cli("tests.apps.boot_app:registry")
    wait_for(lambda: len(records(redis_client, prefix, "boot")) >= 1, what="the boot job")
    wait_for(lambda: len(records(redis_client, prefix, "gate")) == 2, what="both gates")

    # A graceful stop lets each process finish its boot and its running job. (SIGTERM goes to
    # the main process only, which forwards it to each worker process: a second SIGTERM, as
    # from os.killpg, makes Dramatiq kill a worker process at once, mid-job.)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)

    assert proc.returncode == 0, stderr
    gates = records(redis_client, prefix, "gate")
    assert len(set(gates)) == 2  # one per worker process
    assert len(records(redis_client, prefix, "boot")) == 1
    assert boot_message_id(boot_app.BOOT, prefix) not in queued_ids(redis_client, prefix)


@pytest.mark.slow
def test_the_cli_worker_exits_non_zero_with_one_clear_line_when_a_gate_fails(
    worker_cli: Any, prefix: str, redis_client: redis.Redis
) -> None:
    proc = worker_cli("tests.apps.boot_app:failing_registry")
    _, stderr = proc.communicate(timeout=60)

    assert proc.returncode == 3
    critical = [line for line in stderr.splitlines() if "did not start" in line]
    assert critical
    assert all(boot_app.FAILING_GATE in line for line in critical)
    assert all(boot_app.GATE_ERROR in line for line in critical)
    assert not redis_client.exists(keys.boot_marker(prefix, boot_app.FAILING_BOOT))


def kumiko(redis_url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("kumiko")), *args],
        env=subprocess_env("tests.apps.boot_app:registry", redis_url, prefix),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def app_env(monkeypatch: pytest.MonkeyPatch, redis_url: str, prefix: str) -> None:
    """Lets the handlers of ``tests.apps.boot_app`` record when run in-process."""
    monkeypatch.setenv("KUMIKO_REDIS_URL", redis_url)
    monkeypatch.setenv("KUMIKO_QUEUE_PREFIX", prefix)


@pytest.mark.usefixtures("app_env")
def test_the_kumiko_reset_boot_command_makes_the_next_start_run_the_job_again(
    make_runner: RunnerFactory, prefix: str, redis_url: str, redis_client: redis.Redis
) -> None:
    first = make_runner(boot_app.registry)
    first.start()
    wait_for(lambda: len(records(redis_client, prefix, "boot")) == 1, what="the first run")
    first.stop()

    result = kumiko(redis_url, prefix, "reset-boot", boot_app.BOOT)
    assert result.returncode == 0, result.stderr
    [line] = result.stdout.splitlines()
    assert line.startswith(f"{boot_app.BOOT}: boot marker deleted")

    second = make_runner(boot_app.registry)
    second.start()
    wait_for(lambda: len(records(redis_client, prefix, "boot")) == 2, what="the run after reset")


@pytest.mark.usefixtures("app_env")
def test_the_kumiko_reset_boot_all_resets_every_boot_job(
    make_runner: RunnerFactory, prefix: str, redis_url: str, redis_client: redis.Redis
) -> None:
    runner = make_runner(boot_app.registry)
    runner.start()
    runner.stop()
    assert redis_client.exists(keys.boot_marker(prefix, boot_app.BOOT))

    result = kumiko(redis_url, prefix, "reset-boot", "--all")

    assert result.returncode == 0, result.stderr
    assert [line.split(":", 3)[:3] for line in result.stdout.splitlines()] == [
        boot_app.BOOT.split(":")
    ]
    assert not redis_client.exists(keys.boot_marker(prefix, boot_app.BOOT))
    assert not redis_client.exists(
        keys.enqueue_guard(prefix, boot_message_id(boot_app.BOOT, prefix))
    )


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["reset-boot", "bootapp:job:nope"], "unknown job 'bootapp:job:nope'"),
        (["reset-boot", boot_app.PLAIN], "is not run_on_boot"),
        (["reset-boot"], "give either JOB_NAME or --all"),
        (["reset-boot", boot_app.BOOT, "--all"], "give either JOB_NAME or --all"),
        (["reset-boot", "--bogus"], "unrecognized arguments"),
    ],
)
def test_the_kumiko_reset_boot_command_rejects_bad_input_with_one_line(
    args: list[str], problem: str, prefix: str, redis_url: str
) -> None:
    result = kumiko(redis_url, prefix, *args)

    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert problem in line
    assert result.stdout == ""
