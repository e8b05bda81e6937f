"""Faults of Redis itself, seen from a running worker: it heals by itself (no restart) and
says what is wrong (``runner.status().problems``, ``kumiko status --check``).

Each test runs its own ``redis-server`` (frozen with SIGSTOP, restarted without persistence,
filled to ``maxmemory``, its clients killed). Waits are on events, with generous timeouts;
no bound here is a timing target (those are in benchmarks/).
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
from starlette.testclient import TestClient

from kumiko_dramatiq import (
    Backoff,
    Feature,
    JobContext,
    JobRunner,
    RedisUnavailableError,
    Registry,
)
from kumiko_dramatiq.broker.seam import consumer_threads, raise_in_thread
from kumiko_dramatiq.dashboard import create_app
from tests.conftest import wait_for
from tests.deployment import ROOT, Server, cli_env, kumiko, start_server

#: generous: the machine is loaded; none of these is a timing target
WAIT_S = 60


class Jobs:
    """A registry whose handlers set events, and what they saw."""

    def __init__(self) -> None:
        self.ran: dict[str, threading.Event] = {
            name: threading.Event() for name in ("plain", "later", "flaky", "keyed")
        }
        self.keyed_runs: list[str] = []
        self.release_keyed = threading.Event()
        self.keyed_started = threading.Event()
        feature = Feature("rec")

        @feature.job("plain")
        def plain(payload: dict[str, Any], ctx: JobContext) -> None:
            self.ran["plain"].set()

        @feature.job("later")
        def later(payload: dict[str, Any], ctx: JobContext) -> None:
            self.ran["later"].set()

        @feature.job("flaky", retries=2, backoff=Backoff("fixed", delay_ms=500))
        def flaky(payload: dict[str, Any], ctx: JobContext) -> None:
            if ctx.attempt == 1:
                raise RuntimeError("the first attempt fails")
            self.ran["flaky"].set()

        @feature.job("keyed")
        def keyed(payload: dict[str, Any], ctx: JobContext) -> None:
            self.keyed_runs.append(ctx.message_id)
            self.keyed_started.set()
            self.release_keyed.wait(WAIT_S)
            self.ran["keyed"].set()

        self.registry = Registry([feature])

    def reset(self) -> None:
        for event in self.ran.values():
            event.clear()

    def wait(self, *names: str) -> None:
        for name in names:
            assert self.ran[name].wait(WAIT_S), f"{name} did not run"


#: for ``kumiko status`` in a subprocess (KUMIKO_APP); no cron job, so no scheduler is needed
REGISTRY = Jobs().registry


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    started = start_server("redis", tmp_path)
    yield started
    started.stop()


def url_of(server: Server) -> str:
    return f"redis://{server.host}:{server.port}/0"


def restart(server: Server) -> Server:
    """Stop ``server`` (no save) and start a new, empty one on the same port."""
    server.stop()
    return start_server("redis", server.directory, port=server.port)


def pid_of(server: Server) -> int:
    return server.process.pid


@pytest.fixture
def jobs() -> Jobs:
    return Jobs()


def runner_on(server: Server, jobs: Jobs, **options: Any) -> JobRunner:
    # a short socket timeout (boot_redis_timeout_ms), so that a frozen Redis makes every
    # command of the worker fail with a timeout, and a short liveness TTL
    settings: dict[str, Any] = {"boot_redis_timeout_ms": 1_000, "heartbeat_timeout_ms": 3_000}
    settings.update(options)
    return JobRunner(
        jobs.registry, redis_url=url_of(server), queue_prefix="rec", worker_threads=4, **settings
    )


def freeze(server: Server, seconds: float) -> None:
    """SIGSTOP the server for ``seconds`` (long enough for every worker command to time out),
    then SIGCONT."""
    os.kill(pid_of(server), signal.SIGSTOP)
    try:
        time.sleep(seconds)  # the fault lasts this long: nothing is waited for here
    finally:
        os.kill(pid_of(server), signal.SIGCONT)


def dispatch_all(runner: JobRunner) -> None:
    runner.dispatch("rec:job:plain", {})
    runner.dispatch("rec:job:later", {}, delay_ms=500)
    runner.dispatch("rec:job:flaky", {})


def test_after_redis_is_frozen_queued_delayed_and_retried_work_runs_without_a_restart(
    server: Server, jobs: Jobs
) -> None:
    with runner_on(server, jobs) as runner:
        runner.start()
        runner.dispatch("rec:job:plain", {})
        jobs.wait("plain")
        jobs.reset()
        # Given delayed work held while Redis freezes (due in the middle of the freeze)
        runner.dispatch("rec:job:later", {}, delay_ms=1_000)
        # When Redis is frozen for a few seconds, then thawed
        freeze(server, 4)
        # Then what was due meanwhile runs, and so does new work of every kind
        jobs.wait("later")
        jobs.reset()
        dispatch_all(runner)
        jobs.wait("plain", "later", "flaky")
        # and the worker says it is healthy again
        wait_for(lambda: runner.status().problems == [], WAIT_S, "no problem left")
        (worker,) = runner.status().workers
        assert worker.healthy


def test_a_redis_restarted_without_persistence_is_a_problem_and_the_worker_resumes(
    server: Server, jobs: Jobs
) -> None:
    with runner_on(server, jobs) as runner:
        runner.start()
        runner.dispatch("rec:job:plain", {})
        jobs.wait("plain")
        jobs.reset()
        assert runner.status().problems == []
        # When Redis restarts empty under the running worker
        server = restart(server)
        try:
            # Then status says the dataset was reset
            wait_for(
                lambda: any("was reset" in p for p in runner.status().problems),
                WAIT_S,
                "the reset is reported",
            )
            # and the worker resumes all its work, without a restart
            dispatch_all(runner)
            jobs.wait("plain", "later", "flaky")
        finally:
            runner.stop()
            server.stop()


def fill(client: redis.Redis) -> None:
    """Write another app's keys until Redis refuses one (OOM)."""
    for i in range(100_000):
        try:
            client.set(f"other-app:{i}", "x" * 1024)
        except redis.exceptions.OutOfMemoryError:
            return
    raise AssertionError("Redis never refused a write")


def test_after_maxmemory_is_reached_and_freed_delayed_work_resumes(
    server: Server, jobs: Jobs
) -> None:
    client = server.client()
    client.config_set("maxmemory-policy", "noeviction")
    with runner_on(server, jobs) as runner:
        runner.start()
        # Given a delayed job, and then a Redis at its maxmemory
        runner.dispatch("rec:job:later", {}, delay_ms=1_000)
        due = time.monotonic() + 1
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 256 * 1024)
        fill(client)
        client.config_set("maxmemory", 1)  # stays full, whatever buffers Redis frees meanwhile
        # When a producer dispatches, Then it gets kumiko's error, not redis-py's
        with pytest.raises(RedisUnavailableError, match="maxmemory"):
            runner.dispatch("rec:job:plain", {})
        # (the delayed job comes due while writes are refused: its move fails)
        wait_for(lambda: time.monotonic() > due + 2, WAIT_S, "the delayed job is past due")
        # When memory is freed, Then the delayed job runs, and new work of every kind too
        client.config_set("maxmemory", 0)
        jobs.wait("later")
        jobs.reset()
        dispatch_all(runner)
        jobs.wait("plain", "later", "flaky")
    client.close()


def test_after_its_connections_are_killed_a_worker_resumes(server: Server, jobs: Jobs) -> None:
    client = server.client()
    with runner_on(server, jobs) as runner:
        runner.start()
        runner.dispatch("rec:job:later", {}, delay_ms=2_000)
        # When every connection but ours is killed
        assert client.client_kill_filter(_type="normal", skipme=True) >= 1
        # Then held and new work runs
        jobs.wait("later")
        jobs.reset()
        dispatch_all(runner)
        jobs.wait("plain", "later", "flaky")
    client.close()


# The SystemExit this test raises in each consumer thread lands wherever the thread is: inside
# redis-py's connect, between creating a socket and keeping it, it leaves a socket that only the
# thread's frames hold (redis-py closes it on OSError, not on SystemExit); it is closed when
# pytest drops those frames, with a ResourceWarning. The fault is the test's, not the worker's.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_a_consumer_thread_that_ends_is_restarted(server: Server, jobs: Jobs) -> None:
    with runner_on(server, jobs) as runner:
        runner.start()
        worker = runner._worker
        assert worker is not None
        # Given every consumer thread of the worker ends (an exception no loop catches)
        threads = consumer_threads(worker)
        for thread in threads.values():
            assert thread.ident is not None
            raise_in_thread(thread.ident, SystemExit)
        wait_for(lambda: not any(t.is_alive() for t in threads.values()), WAIT_S, "they ended")
        # Then the supervisor restarts them, and every kind of work runs
        dispatch_all(runner)
        jobs.wait("plain", "later", "flaky")
        assert all(t.is_alive() for t in consumer_threads(worker).values())


def test_a_dedup_end_that_failed_during_an_outage_is_written_after_it(
    server: Server, jobs: Jobs
) -> None:
    with runner_on(server, jobs) as runner:
        runner.start()
        # Given a keyed job running
        first = runner.dispatch("rec:job:keyed", {}, dedup_key="K")
        assert jobs.keyed_started.wait(WAIT_S)
        # When it ends while Redis is frozen (its dedup key's end is refused)
        os.kill(pid_of(server), signal.SIGSTOP)
        try:
            jobs.release_keyed.set()
            assert jobs.ran["keyed"].wait(WAIT_S)
            time.sleep(2)  # the fault lasts this long: the key's end times out meanwhile
        finally:
            os.kill(pid_of(server), signal.SIGCONT)
        # Then the key is freed once Redis answers (not at its TTL, hours later)
        wait_for(lambda: runner.dedup_keys() == [], WAIT_S, "the dedup key is freed")
        # and a later dispatch with the key runs again
        jobs.ran["keyed"].clear()
        second = runner.dispatch("rec:job:keyed", {}, dedup_key="K")
        assert second != first
        jobs.wait("keyed")
        assert jobs.keyed_runs == [first, second]


def test_status_check_exits_1_on_a_problem_and_0_without(server: Server) -> None:
    env = cli_env(url_of(server), "rec", app="tests.integration.test_redis_recovery:REGISTRY")
    # Given a healthy dataset, Then `kumiko status --check` exits 0
    healthy = kumiko(env, "status", "--check")
    assert healthy.returncode == 0, healthy.stderr
    assert "problems: none" in healthy.stdout
    # When Redis may evict keys, Then it is a problem: exit 1, one line on stderr
    client = server.client()
    client.config_set("maxmemory-policy", "allkeys-lru")
    sick = kumiko(env, "status", "--check")
    assert sick.returncode == 1
    assert "maxmemory-policy is allkeys-lru" in sick.stdout
    assert sick.stderr.strip() == "kumiko status: 1 problem(s)"
    # and without --check the status is read all the same (exit 0)
    assert kumiko(env, "status").returncode == 0
    client.close()


def test_a_worker_starting_on_an_evicting_redis_logs_an_error(
    server: Server, jobs: Jobs, caplog: pytest.LogCaptureFixture
) -> None:
    client = server.client()
    client.config_set("maxmemory-policy", "volatile-lru")
    with runner_on(server, jobs) as runner:
        runner.start()
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert any("maxmemory-policy is volatile-lru" in line for line in errors)
        assert any("volatile-lru" in p for p in runner.status().problems)
    client.close()


def test_the_dashboard_shows_the_problems_on_every_page(server: Server, jobs: Jobs) -> None:
    client = server.client()
    runner = runner_on(server, jobs)
    pages = TestClient(create_app(runner))
    try:
        # Given a healthy dataset, Then no page has a problem banner
        assert "problem" not in pages.get("/jobs").text
        # When Redis may evict keys, Then every page says so
        client.config_set("maxmemory-policy", "allkeys-lru")
        for page in ("/", "/jobs", "/runs", "/locks"):
            html = pages.get(page).text
            assert "1 problem:" in html, page
            assert "maxmemory-policy is allkeys-lru" in html, page
    finally:
        pages.close()
        runner.stop()
        client.close()


def completed(runner: JobRunner, message_id: str) -> bool:
    return any(run.status == "completed" for run in runner.run_record(message_id))


def start_cli_worker(server: Server, **extra: str) -> subprocess.Popen[bytes]:
    env = cli_env(url_of(server), "rec", app="tests.integration.test_redis_recovery:REGISTRY")
    return subprocess.Popen(
        [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "4"],
        cwd=ROOT,
        env={**env, **extra},
        start_new_session=True,
        stderr=subprocess.DEVNULL,
    )


def stop_cli_worker(worker: subprocess.Popen[bytes]) -> None:
    os.killpg(worker.pid, signal.SIGCONT)
    os.killpg(worker.pid, signal.SIGTERM)
    try:
        worker.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()


@pytest.mark.slow
def test_a_live_worker_that_does_not_refresh_its_liveness_is_a_problem(
    server: Server, jobs: Jobs
) -> None:
    # Given a CLI worker whose liveness lives 30 s (refreshed every 10 s)
    worker = start_cli_worker(server, KUMIKO_HEARTBEAT_TIMEOUT_MS="30000")
    producer = runner_on(server, jobs, heartbeat_timeout_ms=30_000)
    try:
        wait_for(lambda: len(producer.status().workers) == 1, WAIT_S, "the worker registers")
        assert producer.status().problems == []
        # When it stops refreshing (frozen), Then status says so before it is presumed dead
        os.killpg(worker.pid, signal.SIGSTOP)
        wait_for(
            lambda: any("has not refreshed its liveness" in p for p in producer.status().problems),
            WAIT_S,
            "the stale worker is reported",
        )
        (stale,) = producer.status().workers
        assert not stale.healthy
        # When it runs again, Then the problem goes away by itself
        os.killpg(worker.pid, signal.SIGCONT)
        wait_for(lambda: producer.status().problems == [], WAIT_S, "no problem left")
    finally:
        producer.stop()
        stop_cli_worker(worker)


def test_a_cli_worker_resumes_every_kind_of_work_after_redis_is_frozen(
    server: Server, jobs: Jobs
) -> None:
    # Given a CLI worker (-p 1 -t 4, its commands time out after 5 s)
    worker = start_cli_worker(server)
    producer = runner_on(server, jobs)
    try:
        first = producer.dispatch("rec:job:plain", {})
        wait_for(lambda: completed(producer, first), WAIT_S, "the worker runs")
        # When Redis is frozen longer than the worker's command timeout, then thawed
        freeze(server, 7)
        # Then a plain job, a delayed one and one retried after a backoff all run
        ids = [
            producer.dispatch("rec:job:plain", {}),
            producer.dispatch("rec:job:later", {}, delay_ms=500),
            producer.dispatch("rec:job:flaky", {}),
        ]
        wait_for(lambda: all(completed(producer, i) for i in ids), WAIT_S, "all three run")
        wait_for(lambda: producer.status().problems == [], WAIT_S, "no problem left")
    finally:
        producer.stop()
        stop_cli_worker(worker)
