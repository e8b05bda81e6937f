"""Bad input, forged messages, poison messages, unclear errors: refused up front, never lost."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from dramatiq.middleware import TimeLimit

from kumiko_dramatiq import (
    Backoff,
    Event,
    Feature,
    JobConfigError,
    JobContext,
    JobRunner,
    PayloadError,
    Registry,
)
from kumiko_dramatiq.errors import JobTimeoutError, RedisAccessError
from kumiko_dramatiq.messages import build_message
from tests.conftest import Recorder, RunnerFactory, wait_for

ROOT = Path(__file__).resolve().parents[2]
SECRET = "SECRET-PAYLOAD-7f3a"


def registry_of(**options: Any) -> Registry:
    feature = Feature("hard")

    @feature.job("work", **options)
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        if payload.get("fail"):
            raise RuntimeError("planned failure")

    forged_key = Event("thing.happened", dedup_key=lambda p: p["key"] + "\udfff")

    @feature.job("keyed", trigger=forged_key)
    def keyed(payload: dict[str, Any], ctx: JobContext) -> None: ...

    return Registry([feature])


def nested_list(levels: int) -> list[Any]:
    outer: list[Any] = []
    inner = outer
    for _ in range(levels - 1):
        inner.append([])
        inner = inner[0]
    return outer


def queued(client: redis.Redis, prefix: str) -> int:
    return int(
        client.hlen(f"dramatiq:{prefix}-worker.msgs")
        + client.hlen(f"dramatiq:{prefix}-worker.DQ.msgs")
    )


# -- bad input at the call -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        ({"n": 2**64}, "must be an integer within"),
        ({"deep": nested_list(10_000)}, "nests deeper than 100 levels"),
        ({"s": "\ud800"}, "must be valid Unicode"),
    ],
)
def test_a_payload_beyond_the_limits_is_one_line_and_nothing_is_enqueued(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str, payload: Any, says: str
) -> None:
    runner = make_runner(registry_of())
    with pytest.raises(PayloadError, match=f"hard:job:work: .*{says}") as caught:
        runner.dispatch("hard:job:work", payload)
    assert "\n" not in str(caught.value)
    assert queued(redis_client, prefix) == 0


def test_a_dedup_key_with_a_lone_surrogate_is_refused(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry_of())
    with pytest.raises(PayloadError, match="hard:job:work: dedup_key must be valid Unicode"):
        runner.dispatch("hard:job:work", {}, dedup_key="k\udc00")
    with pytest.raises(PayloadError, match=r"hard:job:keyed: trigger\.dedup_key must be valid"):
        runner.handle_event("thing.happened", {"key": "k"})
    assert queued(redis_client, prefix) == 0


def test_a_delay_that_would_never_come_due_is_refused(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry_of())
    with pytest.raises(PayloadError, match="hard:job:work: delay_ms is too large"):
        runner.dispatch("hard:job:work", {}, delay_ms=10**30)
    assert queued(redis_client, prefix) == 0


@pytest.mark.parametrize("url", ["http://x", "redis://h:notaport", "redis://h/abc", "redis://"])
def test_a_bad_redis_url_is_refused_at_construction(url: str) -> None:
    with pytest.raises(JobConfigError, match="redis_url"):
        JobRunner(registry_of(), redis_url=url)


# -- forged messages ---------------------------------------------------------------------------


def forged(prefix: str, change: dict[str, Any], options: dict[str, Any]) -> bytes:
    message = build_message(
        registry_of().jobs["hard:job:work"], {"fail": True}, queue_prefix=prefix, trigger="manual"
    )
    body = message.asdict()
    body["options"] = {**body["options"], **options}
    body.update(change)
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("change", "options"),
    [
        ({}, {"kumiko_backoff": "bogus", "kumiko_backoff_delay_ms": 5, "kumiko_retries": 2}),
        ({}, {"kumiko_backoff": "fixed", "kumiko_backoff_delay_ms": None, "kumiko_retries": 2}),
        ({}, {"kumiko_backoff": "fixed", "kumiko_backoff_delay_ms": -5, "kumiko_retries": 2}),
        ({}, {"kumiko_tenant_id": 42}),
        ({}, {"kumiko_trigger": None}),
        ({"actor_name": 17}, {}),
        ({"options": ["not", "an", "object"]}, {}),
        ({"queue_name": "elsewhere"}, {}),
        ({"args": [{"fail": True}, "extra"]}, {}),
        # values no declaration can produce
        ({}, {"kumiko_retries": 10**18}),
        ({}, {"kumiko_backoff": "fixed", "kumiko_backoff_delay_ms": 10**20, "kumiko_retries": 1}),
        ({}, {"kumiko_backoff": "exponential", "kumiko_backoff_delay_ms": 1, "kumiko_retries": 60}),
        ({}, {"kumiko_tenant_id": "acme"}),  # a job that is not per-tenant
        ({}, {"kumiko_caps": {"max_running": 0}}),
        ({}, {"kumiko_caps": {"rate_limit": [1, 10**20, False]}}),
        # arguments outside the payload limits
        ({"args": [{"n": 2**70}]}, {}),
        ({"args": [{"s": "\ud800"}]}, {}),
        ({"args": [{"deep": nested_list(101)}]}, {}),
        ({"args": [{"big": "x" * (3 * 1024 * 1024)}]}, {}),
    ],
)
def test_a_forged_message_is_dead_lettered_at_fetch_and_the_worker_goes_on(
    make_runner: RunnerFactory,
    recorder: Recorder,
    redis_client: redis.Redis,
    prefix: str,
    change: dict[str, Any],
    options: dict[str, Any],
) -> None:
    # Given a forged message on the lane queue, then a good one
    runner = make_runner(registry_of(), **recorder.hooks())
    queue = f"{prefix}-worker"
    runner.broker.do_enqueue(queue, "forged-1", forged(prefix, change, options))
    good = runner.dispatch("hard:job:work", {})
    # When a worker runs
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete")) == 1, what="the good message")
    wait_for(lambda: redis_client.zcard(f"dramatiq:{queue}.XQ") == 1, what="the dead letter")
    # Then the forged one never ran, sits in the dead letters, and nothing is left behind
    assert [e.message_id for e in recorder.of("start")] == [good]
    assert redis_client.zscore(f"dramatiq:{queue}.XQ", "forged-1") is not None
    wait_for(lambda: queued(redis_client, prefix) == 0, what="the good message acked")
    assert redis_client.hlen(f"kumiko:{prefix}:deliveries") == 0
    # and no run record is left "running": one the fetch wrote ended "dead", with the reason
    assert runner.runs(status="running") == []
    for run in runner.runs(status="dead"):
        assert run.error_type == "MalformedMessage"
        assert run.error_message


def per_tenant_registry() -> Registry:
    feature = Feature("hard")

    @feature.job("fan", per_tenant=True)
    def fan(payload: dict[str, Any], ctx: JobContext) -> None: ...

    return Registry([feature])


@pytest.mark.parametrize(
    ("actor", "options"),
    [
        ("hard:job:fan", {}),  # a per-tenant child without its tenant
        ("hard:job:fan:fanout", {"kumiko_tenant_id": "acme"}),  # a wrapper carrying one
    ],
)
def test_a_message_with_a_tenant_where_it_cannot_have_one_or_none_where_it_must_is_dead_lettered(
    make_runner: RunnerFactory,
    recorder: Recorder,
    redis_client: redis.Redis,
    prefix: str,
    actor: str,
    options: dict[str, Any],
) -> None:
    # Given a forged per-tenant child without a tenant (or a wrapper with one), then a good
    # dispatch of the same job
    registry = per_tenant_registry()
    runner = make_runner(registry, get_active_tenant_ids=lambda: ["t1"], **recorder.hooks())
    queue = f"{prefix}-worker"
    body = build_message(registry.jobs["hard:job:fan"], {}, queue_prefix=prefix, trigger="manual")
    raw = body.asdict()
    raw["actor_name"] = actor
    raw["options"] = {**raw["options"], **options}
    runner.broker.do_enqueue(queue, "forged-1", json.dumps(raw).encode())
    runner.dispatch("hard:job:fan", {})
    # When a worker runs
    runner.start()
    wait_for(lambda: redis_client.zscore(f"dramatiq:{queue}.XQ", "forged-1") is not None, what="dl")
    recorder.wait_until(
        lambda r: [e.meta.tenant_id for e in r.of("complete")].count("t1") == 1,
        what="the good fan-out",
    )
    # Then the forged one never ran: every run that started is the good wrapper or its child
    assert sorted(str(e.meta.tenant_id) for e in recorder.of("start")) == ["None", "t1"]


# -- poison messages ---------------------------------------------------------------------------


@pytest.fixture
def supervised_worker(redis_url: str, prefix: str) -> Iterator[list[int]]:
    """A CLI worker for tests.apps.poison_app, restarted whenever it dies (as a supervisor
    would); yields the list of exit codes seen so far."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(
        PYTHONPATH=str(ROOT),
        KUMIKO_APP="tests.apps.poison_app:registry",
        KUMIKO_REDIS_URL=redis_url,
        KUMIKO_QUEUE_PREFIX=prefix,
        KUMIKO_HEARTBEAT_TIMEOUT_MS="1000",
        KUMIKO_MAINTENANCE_CHANCE="1000000",
    )
    command = [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "4"]
    # A worker that takes the poison as it boots dies before saying it booted: without this,
    # Dramatiq's main process waits out its default 30 s for that before it sees the death.
    command += ["--worker-fork-timeout", "100"]
    exits: list[int] = []
    procs: list[subprocess.Popen[bytes]] = []
    lock = threading.Lock()
    stopping = threading.Event()

    def supervise() -> None:
        while True:
            with lock:
                if stopping.is_set():
                    return
                worker = subprocess.Popen(
                    command, cwd=ROOT, env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL
                )
                procs.append(worker)
            exits.append(worker.wait())

    thread = threading.Thread(target=supervise, daemon=True)
    thread.start()
    try:
        yield exits
    finally:
        with lock:
            stopping.set()
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
        thread.join(timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "segfault"])
def test_a_poison_message_is_dead_lettered_after_five_deaths_and_healthy_ones_flow(
    supervised_worker: list[int], redis_client: redis.Redis, redis_url: str, prefix: str, how: str
) -> None:
    from tests.apps.poison_app import registry

    # Given one message that kills its worker on every delivery among 50 healthy ones
    producer = JobRunner(registry, redis_url=redis_url, queue_prefix=prefix)
    healthy = [producer.dispatch("poison:job:healthy", {"n": n}) for n in range(25)]
    poison = producer.dispatch("poison:job:poison", {"how": how})
    healthy += [producer.dispatch("poison:job:healthy", {"n": n}) for n in range(25, 50)]
    producer.stop()
    queue = f"{prefix}-worker"
    # When supervised workers keep restarting
    wait_for(
        lambda: (
            redis_client.zcard(f"dramatiq:{queue}.XQ") == 1
            and set(healthy) <= set(texts(redis_client.lrange(done_key(prefix), 0, -1)))
        ),
        timeout_s=120,
        what="every healthy message done and the poison dead-lettered",
    )
    # Then every healthy message completed, the poison ran exactly 5 times and is dead
    started = texts(redis_client.lrange(started_key(prefix, "poison"), 0, -1))
    assert started == [poison] * 5
    dead = redis_client.hvals(f"dramatiq:{queue}.XQ.msgs")
    assert [json.loads(body)["message_id"] for body in dead] == [poison]
    assert len(supervised_worker) >= 5
    # And its run record says why, as does its dead letter's note
    viewer = JobRunner(registry, redis_url=redis_url, queue_prefix=prefix)
    (run,) = viewer.run_record(poison)
    assert (run.status, run.error_type, run.deliveries) == ("dead", "WorkerDied", 5)
    assert run.error_message == "worker died during 5 deliveries"
    note = viewer.history.dead_note(poison)
    assert note is not None
    assert note["em"] == "worker died during 5 deliveries"
    viewer.stop()


def texts(items: Any) -> list[str]:
    return [item.decode() if isinstance(item, bytes) else str(item) for item in items]


def done_key(prefix: str) -> str:
    return f"kumiko:{prefix}:test:done"


def started_key(prefix: str, job: str) -> str:
    return f"kumiko:{prefix}:test:started:{job}"


# -- logs --------------------------------------------------------------------------------------


def test_logs_name_job_and_attempt_and_never_show_the_payload(
    make_runner: RunnerFactory, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    runner = make_runner(
        registry_of(retries=1, backoff=Backoff("fixed", delay_ms=10)), **recorder.hooks()
    )
    runner.start()
    message_id = runner.dispatch("hard:job:work", {"fail": True, "secret": SECRET})
    recorder.wait_until(lambda r: len(r.of("failed")) == 2, what="both attempts")
    wait_for(lambda: any(r.levelno == logging.ERROR for r in caplog.records), what="dead letter")
    ours = [r for r in caplog.records if message_id in r.getMessage()]
    retried = [r for r in ours if "attempt 1 of 2 failed" in r.getMessage()]
    dead = [r for r in ours if "failed for good" in r.getMessage()]
    assert [r.levelno for r in retried] == [logging.WARNING]
    assert [r.levelno for r in dead] == [logging.ERROR]
    # The records carry the run's identity as structured fields (for a JSON formatter)
    fields = {name: getattr(dead[0], name, None) for name in ("job", "message_id", "attempt")}
    assert fields == {"job": "hard:job:work", "message_id": message_id, "attempt": 2}
    assert getattr(dead[0], "origin_id", None) == message_id
    assert dead[0].exc_info is not None
    assert all(SECRET not in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if "Failed to process message" in r.getMessage()]


def test_log_payloads_opts_in(
    make_runner: RunnerFactory, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    runner = make_runner(registry_of(), log_payloads=True, **recorder.hooks())
    runner.start()
    runner.dispatch("hard:job:work", {"fail": True, "secret": SECRET})
    recorder.wait_until(lambda r: len(r.of("failed")) == 1)
    wait_for(lambda: any(SECRET in r.getMessage() for r in caplog.records), what="the payload")


# -- timeouts ----------------------------------------------------------------------------------


def test_a_run_that_overran_in_a_blocking_call_is_a_failed_attempt(
    make_runner: RunnerFactory, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    feature = Feature("slow")

    @feature.job("sleeper", timeout_ms=300)
    def sleeper(payload: dict[str, Any], ctx: JobContext) -> None:
        time.sleep(1.0)  # a blocking C call: TimeLimit cannot interrupt it

    runner = make_runner(Registry([feature]), timeout_check_ms=100, **recorder.hooks())
    runner.start()
    message_id = runner.dispatch("slow:job:sleeper")
    recorder.wait_until(lambda r: len(r.of("failed")) == 1, what="the failed attempt")
    assert not recorder.of("complete")
    error = recorder.of("failed")[0].exc
    assert type(error).__name__ in {"TimeLimitExceeded", JobTimeoutError.__name__}
    wait_for(
        lambda: any(
            "slow:job:sleeper" in r.getMessage() and message_id in r.getMessage()
            for r in caplog.records
            if "timeout_ms=300" in r.getMessage()
        ),
        what="a time-limit line naming the job and message",
    )


def test_the_interruption_line_comes_from_dramatiqs_time_limit_logger_naming_the_run(
    make_runner: RunnerFactory, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a job whose Python code runs past its timeout_ms
    release = threading.Event()
    feature = Feature("slow")

    @feature.job("looper", timeout_ms=200)
    def looper(payload: dict[str, Any], ctx: JobContext) -> None:
        while not release.wait(0.01):
            pass

    runner = make_runner(Registry([feature]), timeout_check_ms=100, **recorder.hooks())
    runner.start()
    caplog.set_level(logging.WARNING, logger=TimeLimit().logger.name)
    try:
        message_id = runner.dispatch("slow:job:looper")
        recorder.wait_until(lambda r: len(r.of("failed")) == 1, what="the interrupted attempt")
    finally:
        release.set()
    # Then the interruption is logged once, by Dramatiq's own TimeLimit logger (where a
    # logging config that routes Dramatiq's lines finds it), naming the kumiko run
    (line,) = [r for r in caplog.records if "exceeded timeout_ms" in r.getMessage()]
    assert line.name == "dramatiq.middleware.time_limit.TimeLimit"
    assert line.levelno == logging.WARNING
    assert line.getMessage() == (
        f"slow:job:looper {message_id} (attempt 1 of 1) exceeded timeout_ms=200: interrupting it"
    )


# -- unclear errors at start -------------------------------------------------------------------


def cli_env(redis_url: str, prefix: str, app: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(
        PYTHONPATH=str(ROOT), KUMIKO_APP=app, KUMIKO_REDIS_URL=redis_url, KUMIKO_QUEUE_PREFIX=prefix
    )
    return env


COMMANDS = {
    "worker": [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "1"],
    "scheduler": [sys.executable, "-m", "kumiko_dramatiq.scheduler"],
    "kumiko": [sys.executable, "-m", "kumiko_dramatiq.ops.cli", "reset-boot", "--all"],
}


def run(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        COMMANDS[command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def kumiko_lines(stderr: str) -> list[str]:
    prefixes = ("kumiko_dramatiq.app:", "kumiko-scheduler:", "kumiko reset-boot:")
    lines = [line for line in stderr.splitlines() if line.startswith(prefixes)]
    lines += [line for line in stderr.splitlines() if "CRITICAL" in line and "kumiko" in line]
    return lines


@pytest.mark.parametrize("command", ["worker", "scheduler", "kumiko"])
def test_an_app_module_that_raises_on_import_is_one_line(
    command: str, redis_url: str, prefix: str
) -> None:
    done = run(command, cli_env(redis_url, prefix, "tests.apps.broken_app:registry"))
    assert done.returncode == 2, done.stderr
    lines = kumiko_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert "RuntimeError: the settings file is missing" in lines[0]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command", ["worker", "scheduler", "kumiko"])
def test_an_app_module_with_a_syntax_error_is_one_line(
    command: str, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    (tmp_path / "typo_app.py").write_text("registry = (\n")
    env = cli_env(redis_url, prefix, "typo_app:registry")
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"
    done = run(command, env)
    assert done.returncode == 2, done.stderr
    lines = kumiko_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert "SyntaxError" in lines[0]
    assert "typo_app.py" in lines[0]


@pytest.mark.parametrize(("command", "status"), [("worker", 3), ("scheduler", 1), ("kumiko", 1)])
def test_a_database_number_that_does_not_exist_is_one_line(
    command: str, status: int, redis_url: str, prefix: str
) -> None:
    missing_db = redis_url.rsplit("/", 1)[0] + "/999"
    done = run(command, cli_env(missing_db, prefix, "tests.apps.boot_app:registry"))
    assert done.returncode == status, done.stderr
    lines = kumiko_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert "DB index is out of range" in lines[0]


@pytest.fixture
def limited_user(redis_client: redis.Redis) -> Iterator[str]:
    """An ACL user that may do everything but EVALSHA; deleted after the test."""
    name = f"kumiko-test-{uuid.uuid4().hex[:8]}"
    redis_client.acl_setuser(
        name, enabled=True, passwords=["+pw"], commands=["+@all", "-evalsha"], keys=["*"]
    )
    yield name
    redis_client.acl_deluser(name)


@pytest.mark.parametrize(("command", "status"), [("worker", 3), ("scheduler", 1), ("kumiko", 1)])
def test_a_user_without_evalsha_fails_at_start_naming_it(
    command: str, status: int, limited_user: str, redis_url: str, prefix: str
) -> None:
    url = redis_url.replace("redis://", f"redis://{limited_user}:pw@", 1)
    done = run(command, cli_env(url, prefix, "tests.apps.cron_app:registry"))
    assert done.returncode == status, done.stderr
    lines = kumiko_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert "does not let this user run EVALSHA" in lines[0]
    assert ":pw@" not in done.stderr


def test_start_refuses_a_user_without_evalsha_in_one_line(
    limited_user: str, redis_url: str, prefix: str
) -> None:
    url = redis_url.replace("redis://", f"redis://{limited_user}:pw@", 1)
    runner = JobRunner(registry_of(), redis_url=url, queue_prefix=prefix)
    with pytest.raises(RedisAccessError, match="EVALSHA") as caught:
        runner.start()
    assert "\n" not in str(caught.value)
    runner.stop()


@pytest.mark.parametrize("command", ["fcall", "function|load"])
def test_start_refuses_a_user_without_the_function_commands_in_one_line(
    command: str, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # the hot path's scripts run as Redis functions: a user that may not load or call them
    # is told at start, not at its first dispatch
    name = f"kumiko-test-{uuid.uuid4().hex[:8]}"
    redis_client.acl_setuser(
        name, enabled=True, passwords=["+pw"], commands=["+@all", f"-{command}"], keys=["*"]
    )
    try:
        url = redis_url.replace("redis://", f"redis://{name}:pw@", 1)
        runner = JobRunner(registry_of(), redis_url=url, queue_prefix=prefix)
        spelt = command.upper().replace("|", " ")
        with pytest.raises(RedisAccessError, match=f"run {spelt}") as caught:
            runner.start()
        assert "\n" not in str(caught.value)
        runner.stop()
    finally:
        redis_client.acl_deluser(name)
