"""Prometheus metrics, scraped from a real endpoint after real runs.

Every runner of this process writes to one multiprocess directory (its process group's), so
each test names its jobs after its own queue prefix and reads the counts of its own jobs;
the counts without a job label are compared with a scrape taken before the runs.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from kumiko_dramatiq import Feature, JobConfigError, JobContext, JobRunner, Registry
from kumiko_dramatiq.messages import build_message
from kumiko_dramatiq.middleware.metrics import Metrics, exported_names
from tests.apps import metrics_app
from tests.conftest import Recorder, RunnerFactory, wait_for

ROOT = Path(__file__).resolve().parents[2]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# -- helpers ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def restore_multiproc_dir() -> Iterator[None]:
    """The first runner with metrics sets PROMETHEUS_MULTIPROC_DIR in this process; later
    test modules (and their subprocesses) get the environment as it was."""
    before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    yield
    if before is None:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    else:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = before


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def port() -> int:
    return free_port()


def scrape(port: int) -> Samples:
    """Every sample of ``http://127.0.0.1:{port}/metrics`` (empty when nothing answers)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, have), v in samples.items() if n == name and wanted <= have)


def eventually(port: int, name: str, expected: float, **labels: str) -> Samples:
    """Scrape until ``value(name, labels) == expected``; return that scrape."""
    found: list[Samples] = [{}]

    def reached() -> bool:
        found[0] = scrape(port)
        return value(found[0], name, **labels) == expected

    wait_for(reached, what=f"{name}{labels} == {expected}")
    return found[0]


def cli_env(redis_url: str, prefix: str, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(
        PYTHONPATH=str(ROOT),
        KUMIKO_APP="tests.apps.metrics_app:registry",
        KUMIKO_REDIS_URL=redis_url,
        KUMIKO_QUEUE_PREFIX=prefix,
        KUMIKO_METRICS_PORT=str(port),
        **extra,
    )
    return env


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Subprocesses a test starts; terminated (then killed) after it."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in started:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def blocking_registry(name: str, release: threading.Event, **options: Any) -> Registry:
    """Job ``{name}:job:hold`` waits for ``release``."""
    feature = Feature(name)

    @feature.job("hold", **options)
    def hold(payload: dict[str, Any], ctx: JobContext) -> None:
        assert release.wait(timeout=30)

    return Registry([feature])


# -- runs, by status ------------------------------------------------------------------------------
def test_attempts_are_counted_by_status_trigger_and_lane_with_their_durations(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, port: int
) -> None:
    # Given a job that completes, one that fails once then completes, one that always fails
    feature = Feature(prefix)
    failures: list[int] = []

    @feature.job("ok")
    def ok(payload: dict[str, Any], ctx: JobContext) -> None: ...

    @feature.job("flaky", retries=1)
    def flaky(payload: dict[str, Any], ctx: JobContext) -> None:
        if not failures:
            failures.append(1)
            raise RuntimeError("first attempt fails")

    @feature.job("broken")
    def broken(payload: dict[str, Any], ctx: JobContext) -> None:
        raise RuntimeError("always fails")

    runner = make_runner(Registry([feature]), metrics_port=port, **recorder.hooks())
    runner.start()
    before = eventually(port, "kumiko_redis_up", 1)
    # When each is dispatched once and has ended
    for job in ("ok", "flaky", "broken"):
        runner.dispatch(f"{prefix}:job:{job}")
    recorder.wait_until(lambda r: len(r.of("complete")) == 2 and len(r.of("failed")) == 2)
    for job, attempts in (("ok", 1), ("flaky", 2), ("broken", 1)):
        eventually(port, "kumiko_run_duration_seconds_count", attempts, job=f"{prefix}:job:{job}")
    samples = eventually(port, "kumiko_queue_messages", 1, lane="worker", state="dead")
    # Then every attempt is counted with the status its run record got
    runs = {
        (labels["job"].split(":")[-1], labels["status"]): count
        for (name, pairs), count in samples.items()
        if name == "kumiko_runs_total" and (labels := dict(pairs))["job"].startswith(prefix)
    }
    assert runs == {("ok", "completed"): 1, ("flaky", "failed"): 1, ("flaky", "completed"): 1,
                    ("broken", "dead"): 1}  # fmt: skip
    assert value(samples, "kumiko_runs_total", job=f"{prefix}:job:ok", trigger="manual") == 1
    # with a duration each, and the dead one as a dead letter
    for job, attempts in (("ok", 1), ("flaky", 2), ("broken", 1)):
        name = f"{prefix}:job:{job}"
        assert value(samples, "kumiko_run_duration_seconds_count", job=name) == attempts
        assert value(samples, "kumiko_run_duration_seconds_bucket", job=name, le="+Inf") == attempts
    dead_before = value(before, "kumiko_dead_letters_total", lane="worker", reason="failed")
    dead_after = value(samples, "kumiko_dead_letters_total", lane="worker", reason="failed")
    assert dead_after - dead_before == 1
    assert value(samples, "kumiko_workers", lane="worker") >= 1
    assert value(samples, "kumiko_run_history_records", status="dead") == 1
    assert value(samples, "kumiko_run_history_records", status="completed") == 2
    # and every kumiko sample served is one the catalogue (which the examples use) names
    assert {name for name, _ in samples if name.startswith("kumiko_")} <= exported_names()


def test_a_sequential_hand_off_and_its_lock_wait_are_counted(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, port: int
) -> None:
    # Given a sequential job whose first run holds the lock until released
    release = threading.Event()
    registry = blocking_registry(prefix, release, concurrency="sequential")
    runner = make_runner(
        registry, metrics_port=port, sequential_retry_delay_ms=100, **recorder.hooks()
    )
    job = f"{prefix}:job:hold"
    runner.start()
    runner.dispatch(job)
    recorder.wait_until(lambda r: len(r.of("start")) == 1, what="the first run")
    # When a second run finds the lock held, hands off, and the first one ends
    runner.dispatch(job)
    eventually(port, "kumiko_handoffs_total", 1, job=job)
    release.set()
    recorder.wait_until(lambda r: len(r.of("complete")) == 2, what="both runs")
    samples = eventually(port, "kumiko_runs_total", 2, job=job, status="completed")
    # Then the hand-off is no attempt, and each re-check after a hand-off waited the delay
    handoffs = value(samples, "kumiko_handoffs_total", job=job)
    assert handoffs >= 1
    assert value(samples, "kumiko_runs_total", job=job, trigger="manual") == 1
    assert value(samples, "kumiko_runs_total", job=job, trigger="requeue") == 1
    samples = eventually(port, "kumiko_lock_wait_seconds_count", handoffs, job=job)
    assert value(samples, "kumiko_lock_wait_seconds_sum", job=job) >= 0.1 * handoffs


def test_fan_out_children_are_counted_for_their_job(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, port: int
) -> None:
    # Given a per-tenant job and three tenants
    feature = Feature(prefix)

    @feature.job("each", per_tenant=True)
    def each(payload: dict[str, Any], ctx: JobContext) -> None: ...

    runner = make_runner(
        Registry([feature]),
        metrics_port=port,
        get_active_tenant_ids=lambda: ["a", "b", "c"],
        **recorder.hooks(),
    )
    job = f"{prefix}:job:each"
    runner.start()
    # When it is dispatched once
    runner.dispatch(job)
    recorder.wait_until(lambda r: len(r.of("complete")) == 4, what="the wrapper and 3 children")
    # Then its wrapper enqueued three children, which ran as fan-out runs
    samples = eventually(port, "kumiko_runs_total", 3, job=job, trigger="fanout")
    assert value(samples, "kumiko_fanout_children_total", job=job) == 3
    assert value(samples, "kumiko_runs_total", job=job, trigger="manual") == 1


def test_dedup_outcomes_are_counted(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, port: int
) -> None:
    # Given a job that runs until released
    release = threading.Event()
    runner = make_runner(blocking_registry(prefix, release), metrics_port=port, **recorder.hooks())
    job = f"{prefix}:job:hold"
    runner.start()
    # When a key is dispatched, then twice more while its run runs
    first = runner.dispatch(job, dedup_key="k")
    recorder.wait_until(lambda r: len(r.of("start")) == 1, what="the first run")
    follow_up = runner.dispatch(job, dedup_key="k")
    assert runner.dispatch(job, dedup_key="k") == follow_up != first
    release.set()
    recorder.wait_until(lambda r: len(r.of("complete")) == 2, what="the run and its follow-up")
    # Then the first enqueued, the second made the follow-up, the third joined it
    samples = eventually(port, "kumiko_dedup_total", 3, job=job)
    assert value(samples, "kumiko_dedup_total", job=job, outcome="enqueued") == 1
    assert value(samples, "kumiko_dedup_total", job=job, outcome="follow_up") == 1
    assert value(samples, "kumiko_dedup_total", job=job, outcome="deduplicated") == 1


def test_dispatch_many_counts_the_outcome_of_each_keyed_payload(
    make_runner: RunnerFactory, prefix: str, port: int
) -> None:
    # Given a worker serving metrics (on the idle api lane)
    feature = Feature(prefix)

    @feature.job("later")
    def later(payload: dict[str, Any], ctx: JobContext) -> None: ...

    runner = make_runner(Registry([feature]), lane="api", metrics_port=port)
    runner.start()
    job = f"{prefix}:job:later"
    # When a batch names key "a" twice and key "b" once
    runner.dispatch_many(job, [{}, {}, {}], dedup_keys=["a", "a", "b"])
    # Then two were enqueued and one joined the first
    samples = eventually(port, "kumiko_dedup_total", 3, job=job)
    assert value(samples, "kumiko_dedup_total", job=job, outcome="enqueued") == 2
    assert value(samples, "kumiko_dedup_total", job=job, outcome="deduplicated") == 1


# -- scrape-time gauges ------------------------------------------------------------------------
def test_queue_depths_by_lane_and_state_are_read_at_scrape_time(
    make_runner: RunnerFactory, prefix: str, port: int
) -> None:
    # Given an api-lane worker serving metrics, and worker-lane messages nobody consumes
    feature = Feature(prefix)

    @feature.job("later")
    def later(payload: dict[str, Any], ctx: JobContext) -> None: ...

    registry = Registry([feature])
    server = make_runner(registry, lane="api", metrics_port=port)
    server.start()
    producer = make_runner(registry, metrics_port=None)
    # When three are queued and one is delayed
    for n in range(3):
        producer.dispatch(f"{prefix}:job:later", {"n": n})
    producer.dispatch(f"{prefix}:job:later", delay_ms=600_000)
    # Then a scrape reads them from Redis
    samples = eventually(port, "kumiko_queue_messages", 3, lane="worker", state="queued")
    assert value(samples, "kumiko_queue_messages", lane="worker", state="delayed") == 1
    assert value(samples, "kumiko_queue_messages", lane="worker", state="running") == 0
    assert value(samples, "kumiko_queue_messages", lane="api", state="queued") == 0
    assert value(samples, "kumiko_redis_up") == 1


# -- dead letters at fetch -------------------------------------------------------------------------
def test_a_malformed_message_dead_lettered_at_fetch_is_counted(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, port: int
) -> None:
    # Given a message whose kumiko options do not decode (a forged trace context)
    feature = Feature(prefix)

    @feature.job("work")
    def work(payload: dict[str, Any], ctx: JobContext) -> None: ...

    registry = Registry([feature])
    runner = make_runner(registry, metrics_port=port, **recorder.hooks())
    message = build_message(
        registry.jobs[f"{prefix}:job:work"], {}, queue_prefix=prefix, trigger="manual"
    )
    body = message.asdict()
    body["options"] = {**body["options"], "kumiko_trace": "not an object"}
    runner.start()
    before = eventually(port, "kumiko_redis_up", 1)
    # When a worker fetches it (and a good one after it)
    runner.broker.do_enqueue(f"{prefix}-worker", "forged-1", json.dumps(body).encode())
    good = runner.dispatch(f"{prefix}:job:work")
    recorder.wait_until(lambda r: len(r.of("complete")) == 1, what="the good message")
    # Then it never ran, and is counted as a malformed dead letter
    samples = eventually(port, "kumiko_queue_messages", 1, lane="worker", state="dead")
    counted = value(samples, "kumiko_dead_letters_total", lane="worker", reason="malformed")
    assert (
        counted - value(before, "kumiko_dead_letters_total", lane="worker", reason="malformed") == 1
    )
    assert [e.message_id for e in recorder.of("start")] == [good]


@pytest.mark.slow
def test_a_poison_message_is_counted_as_a_worker_died_dead_letter(
    redis_url: str,
    redis_client: redis.Redis,
    prefix: str,
    port: int,
    processes: list[subprocess.Popen[bytes]],
) -> None:
    # Given a message that kills its worker, and one death allowed per message
    producer = JobRunner(metrics_app.registry, redis_url=redis_url, queue_prefix=prefix)
    producer.dispatch("metered:job:poison")
    producer.stop()
    env = cli_env(
        redis_url,
        prefix,
        port,
        KUMIKO_MAX_DELIVERIES="1",
        KUMIKO_HEARTBEAT_TIMEOUT_MS="500",
        KUMIKO_MAINTENANCE_CHANCE="1000000",
    )
    command = [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "1"]
    command += ["--worker-fork-timeout", "100"]  # its worker may die before saying it booted
    # When a worker dies running it, and a new worker starts
    first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # fmt: skip
    processes.append(first)
    assert first.wait(timeout=60) != 0
    processes.append(
        subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    )
    # Then the new worker dead-letters it at fetch and counts it as a poison message
    samples = eventually(port, "kumiko_dead_letters_total", 1, reason="worker_died")
    assert value(samples, "kumiko_queue_messages", lane="worker", state="dead") == 1
    assert redis_client.zcard(f"dramatiq:{prefix}-worker.XQ") == 1


# -- processes -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_worker_processes_share_one_port_and_one_merged_view(
    redis_url: str, prefix: str, port: int, processes: list[subprocess.Popen[bytes]]
) -> None:
    # Given two messages that can only end once each runs in its own process
    producer = JobRunner(metrics_app.registry, redis_url=redis_url, queue_prefix=prefix)
    for _ in range(2):
        producer.dispatch("metered:job:meet", {"processes": 2})
    # When `dramatiq -p 2` (one thread each) runs them with a metrics port
    command = [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "2", "-t", "1"]
    processes.append(
        subprocess.Popen(
            command,
            cwd=ROOT,
            env=cli_env(redis_url, prefix, port),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    )
    wait_for(
        lambda: len(producer.runs("metered:job:meet", status="completed")) == 2,
        timeout_s=60,
        what="both runs recorded",
    )
    workers = {run.worker for run in producer.runs("metered:job:meet")}
    producer.stop()
    assert len(workers) == 2
    # Then the one port shows both processes' runs, summed, and both workers
    samples = eventually(port, "kumiko_runs_total", 2, job="metered:job:meet", status="completed")
    assert value(samples, "kumiko_workers", lane="worker") == 2


def test_a_dead_process_stays_counted_once_and_leaves_the_live_gauges(
    make_runner: RunnerFactory, redis_url: str, prefix: str, port: int
) -> None:
    # Given this process serving the port for its process group (on the idle api lane)
    server = make_runner(metrics_app.registry, lane="api", metrics_port=port)
    server.start()
    job = "metered:job:ok"
    baseline = eventually(port, "kumiko_redis_up", 1)
    counted = value(baseline, "kumiko_runs_total", job=job, status="completed")
    workers = value(baseline, "kumiko_workers", lane="worker")
    spawn = multiprocessing.get_context("spawn")
    for restart in (1, 2):
        # When a child process of the group runs one job and dies without stopping
        server.dispatch(job)
        child = spawn.Process(
            target=metrics_app.run_one_and_die,
            args=(redis_url, prefix, port, restart),
            daemon=True,
        )
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
        # Then its run stays counted exactly once, and its worker no longer counts as running
        samples = eventually(port, "kumiko_runs_total", counted + restart, job=job)
        assert value(samples, "kumiko_workers", lane="worker") == workers


@pytest.mark.slow
def test_the_scheduler_serves_its_cron_lag(
    redis_url: str, prefix: str, port: int, processes: list[subprocess.Popen[bytes]]
) -> None:
    # Given `kumiko-scheduler` with a metrics port and a cron job every second
    processes.append(
        subprocess.Popen(
            [sys.executable, "-m", "kumiko_dramatiq.scheduler"],
            cwd=ROOT,
            env=cli_env(redis_url, prefix, port),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    )
    # When it has enqueued a tick
    found: list[Samples] = [{}]

    def ticked() -> bool:
        found[0] = scrape(port)
        return any(name == "kumiko_cron_lag_seconds" for name, _ in found[0])

    wait_for(ticked, timeout_s=30, what="a cron lag sample")
    # Then it serves the lag of that tick and counts itself as a scheduler
    lag = value(found[0], "kumiko_cron_lag_seconds", job="metered:job:tick")
    assert 0 <= lag < 60
    assert value(found[0], "kumiko_schedulers") == 1
    assert value(found[0], "kumiko_queue_messages", lane="worker", state="queued") >= 1


# -- the extra -------------------------------------------------------------------------------------
BLOCKED = "import sys\nsys.modules['prometheus_client'] = None\n"


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_metrics_port_without_prometheus_client_is_a_one_line_error() -> None:
    # Given prometheus_client missing, When a runner is given a metrics port
    done = run_python(
        BLOCKED
        + "from kumiko_dramatiq import JobConfigError, JobRunner\n"
        + "from tests.apps.metrics_app import registry\n"
        + "try:\n    JobRunner(registry, metrics_port=9999)\n"
        + "except JobConfigError as exc:\n    print(exc)\n"
    )
    # Then construction fails with one line naming the setting and the extra
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    assert line.startswith("metrics_port is set (9999)")
    assert "pip install 'kumiko_dramatiq[metrics]'" in line


def test_without_a_metrics_port_prometheus_client_is_never_imported(
    redis_url: str, prefix: str
) -> None:
    # Given a runner without a metrics port, When it runs a job
    done = run_python(
        "import sys, time\n"
        + "from kumiko_dramatiq import JobRunner\n"
        + "from tests.apps.metrics_app import registry\n"
        + f"r = JobRunner(registry, redis_url={redis_url!r}, queue_prefix={prefix!r})\n"
        + "r.start()\nr.dispatch('metered:job:ok')\n"
        + "while not r.runs('metered:job:ok', status='completed'):\n    time.sleep(0.02)\n"
        + "r.stop()\n"
        + "print(sorted(m for m in sys.modules if m.startswith('prometheus_client')))\n"
        + "print([type(m).__name__ for m in r.broker.middleware])\n"
    )
    # Then nothing of prometheus_client was imported and no Metrics middleware is in the chain
    assert done.returncode == 0, done.stderr
    modules, chain = done.stdout.splitlines()
    assert modules == "[]"
    assert Metrics.__name__ not in chain


def test_a_bad_metrics_port_is_refused_at_construction() -> None:
    with pytest.raises(JobConfigError, match="metrics_port must be a port number"):
        JobRunner(metrics_app.registry, metrics_port=70_000)
