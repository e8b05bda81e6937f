"""``dramatiq kumiko_dramatiq.app``: the example app in a real worker subprocess."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from examples.billing.app import registry
from kumiko_dramatiq import JobRunner

ROOT = Path(__file__).resolve().parents[2]


def worker_env(redis_url: str, prefix: str, app: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(PYTHONPATH=str(ROOT), KUMIKO_REDIS_URL=redis_url, KUMIKO_QUEUE_PREFIX=prefix)
    if app is not None:
        env["KUMIKO_APP"] = app
    return env


@pytest.mark.slow
def test_the_cli_worker_runs_the_example_app_with_retries(redis_url: str, prefix: str) -> None:
    worker = subprocess.Popen(
        [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "2"],
        cwd=ROOT,
        env=worker_env(redis_url, prefix, "examples.billing.app:registry"),
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert worker.stderr is not None
        for line in worker.stderr:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    try:
        with JobRunner(registry, redis_url=redis_url, queue_prefix=prefix) as producer:
            message_id = producer.dispatch(
                "billing:job:send_invoice",
                {"invoice": "INV-7", "email": "a@example.com", "gateway_failures": 1},
            )
            producer.handle_event("invoice.paid", {"invoice": "INV-7", "amount": 9.5})
        wanted = {
            f"{message_id}: attempt 1 of 4 failed",
            "invoice INV-7 sent to a@example.com (attempt 2)",
            "payment of 9.5 recorded for INV-7",
        }
        deadline = time.monotonic() + 60
        while wanted and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert worker.poll() is None, "the worker exited"
                continue
            wanted = {w for w in wanted if w not in line}
        assert not wanted, f"never logged: {wanted}"
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        assert worker.stderr is not None
        worker.stderr.close()


@pytest.mark.parametrize(
    ("app", "says"),
    [
        (None, "KUMIKO_APP is not set"),
        ("examples.billing.app", "must look like 'package.module:attribute'"),
        ("examples.nope:registry", "cannot import module 'examples.nope'"),
        ("examples.billing.app:nothing", "has no attribute 'nothing'"),
        ("examples.billing.app:log", "is a Logger, not a Registry or a JobRunner"),
    ],
)
def test_a_bad_kumiko_app_is_a_one_line_error(
    app: str | None, says: str, redis_url: str, prefix: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "1"],
        cwd=ROOT,
        env=worker_env(redis_url, prefix, app),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("kumiko_dramatiq.app:")]
    assert len(ours) == 1, done.stderr
    assert says in ours[0]
    assert "Traceback" not in done.stderr


def test_a_variable_that_disagrees_with_a_runner_app_stops_the_worker_naming_both(
    redis_url: str,
) -> None:
    # Given a JobRunner app with its own queue prefix and lock TTL, and a variable that
    # sets another lock TTL
    env = worker_env(redis_url, "runnerapp", "tests.apps.runner_app:runner")
    env["KUMIKO_LOCK_TTL_MS"] = "600"
    # When a worker starts
    done = subprocess.run(
        [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # Then it refuses in one line naming the variable and the runner's own value
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("kumiko_dramatiq.app:")]
    assert len(ours) == 1, done.stderr
    assert "KUMIKO_LOCK_TTL_MS=600 disagrees with the JobRunner's lock_ttl_ms=5000" in ours[0]
