"""``runner.job_state`` and ``kumiko state``: a message's place in its life, on a real Redis.

Synchronises on ``drain``, a gate the handler waits on, and ``run_record``; no sleeps.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kumiko_dramatiq import Feature, JobContext, Registry
from kumiko_dramatiq.ops import cli
from tests.conftest import RunnerFactory, wait_for


def registry_of(gate: threading.Event, started: threading.Event) -> Registry:
    app = Feature("app")

    @app.job("slow")
    def slow(payload: dict[str, Any], ctx: JobContext) -> None:
        started.set()
        gate.wait(30)

    @app.job("broken")
    def broken(payload: dict[str, Any], ctx: JobContext) -> None:
        raise ValueError("no")

    @app.job("quick")
    def quick(payload: dict[str, Any], ctx: JobContext) -> None: ...

    return Registry([app])


def test_a_message_goes_through_its_states(make_runner: RunnerFactory) -> None:
    gate, started = threading.Event(), threading.Event()
    runner = make_runner(registry_of(gate, started), worker_threads=1)

    queued = runner.dispatch("app:job:quick")
    delayed = runner.dispatch("app:job:quick", delay_ms=3_600_000)
    cancelled = runner.dispatch("app:job:quick", delay_ms=3_600_000)
    runner.cancel(cancelled)
    assert runner.job_state(queued) == "queued"
    assert runner.job_state(delayed) == "delayed"
    assert runner.job_state(cancelled) == "cancelled"
    assert runner.job_state("00000000-0000-4000-8000-000000000000") == "unknown"
    runner.pause("app:job:quick")
    assert runner.job_state(queued) == "parked"
    runner.resume("app:job:quick")

    slow = runner.dispatch("app:job:slow")
    broken = runner.dispatch("app:job:broken")
    runner.start()
    assert started.wait(30)
    assert runner.job_state(slow) == "running"
    gate.set()
    wait_for(lambda: runner.job_state(broken) == "dead", what="the broken job to die")
    wait_for(lambda: runner.job_state(slow) == "completed", what="the slow job to complete")
    assert runner.job_state(queued) == "completed"
    assert runner.job_state(delayed) == "delayed"


def test_kumiko_state_prints_it(
    make_runner: RunnerFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    redis_url: str,
    prefix: str,
) -> None:
    runner = make_runner(APP)
    message_id = runner.dispatch("app:job:quick", delay_ms=3_600_000)
    monkeypatch.setenv("KUMIKO_APP", "tests.integration.test_job_state:APP")
    monkeypatch.setenv("KUMIKO_REDIS_URL", redis_url)
    monkeypatch.setenv("KUMIKO_QUEUE_PREFIX", prefix)

    assert cli.main(["state", message_id]) == 0
    assert capsys.readouterr().out.strip() == "delayed"
    assert cli.main(["state", message_id, "--json"]) == 0
    assert '"state": "delayed"' in capsys.readouterr().out


APP = registry_of(threading.Event(), threading.Event())
