"""Results: ``keep_result_s``, ``runner.result`` and ``kumiko result``, on a real Redis.

Waits synchronise on ``result(timeout_s=...)`` itself (woken by the settle's announcement)
or on ``drain``, never on sleeps; the time bounds are generous (no tight timing in tests).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis
from pydantic import BaseModel

from kumiko_dramatiq import (
    Feature,
    JobConfigError,
    JobContext,
    JobFailedError,
    JobRunner,
    NotFoundError,
    Registry,
    ResultError,
    ResultPending,
)
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.ops import cli
from tests.conftest import RunnerFactory


class Receipt(BaseModel):
    invoice: str
    total_cents: int


def registry_of(gate: threading.Event | None = None) -> Registry:
    reports = Feature("reports")

    @reports.job("render", keep_result_s=600)
    def render(payload: dict[str, Any], ctx: JobContext) -> Receipt:
        if gate is not None:
            gate.wait(30)
        return Receipt(invoice=payload["invoice"], total_cents=payload.get("total", 0))

    @reports.job("plain", keep_result_s=600)
    def plain(payload: dict[str, Any], ctx: JobContext) -> Any:
        return {"echo": payload, "attempt": ctx.attempt}

    @reports.job("flaky", keep_result_s=600, retries=1)
    def flaky(payload: dict[str, Any], ctx: JobContext) -> int:
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")
        return 42

    @reports.job("broken", keep_result_s=600)
    def broken(payload: dict[str, Any], ctx: JobContext) -> None:
        raise ValueError("no such invoice")

    @reports.job("not_json", keep_result_s=600)
    def not_json(payload: dict[str, Any], ctx: JobContext) -> Any:
        return {"when": object()}

    @reports.job("forgetful")
    def forgetful(payload: dict[str, Any], ctx: JobContext) -> int:
        return 7

    @reports.job("later", keep_result_s=600)
    def later(payload: dict[str, Any], ctx: JobContext) -> int:
        return 1

    return Registry([reports])


def waiting(
    runner: JobRunner, message_id: str, *, timeout_s: float
) -> tuple[threading.Thread, list[BaseException]]:
    """A started thread waiting in ``runner.result``, and what it raised (once it ended)."""
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            runner.result(message_id, timeout_s=timeout_s)
        except BaseException as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    return waiter, raised


def test_a_model_result_comes_back_as_an_instance_once_the_job_ends(
    make_runner: RunnerFactory,
) -> None:
    # Given a worker whose render job waits on a gate
    gate = threading.Event()
    runner = make_runner(registry_of(gate))
    runner.start()
    message_id = runner.dispatch("reports:job:render", {"invoice": "INV-1", "total": 1250})

    # When the job has not ended, a look without waiting says so
    with pytest.raises(ResultPending, match=message_id):
        runner.result(message_id)

    # Then a waiter blocked in result() gets the instance once the gate opens
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(runner.result(message_id, timeout_s=30)))
    waiter.start()
    gate.set()
    waiter.join(40)
    assert got == [Receipt(invoice="INV-1", total_cents=1250)]
    assert isinstance(got[0], Receipt)
    # And a second read gives it again (kept for keep_result_s)
    assert runner.result(message_id) == Receipt(invoice="INV-1", total_cents=1250)


def test_a_plain_json_result_and_a_retried_job_s_final_value(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry_of())
    runner.start()
    plain = runner.dispatch("reports:job:plain", {"n": [1, 2]})
    flaky = runner.dispatch("reports:job:flaky", {})

    assert runner.result(plain, timeout_s=30) == {"echo": {"n": [1, 2]}, "attempt": 1}
    # the retry keeps the message id: its completed attempt's value is the result
    assert runner.result(flaky, timeout_s=30) == 42


def test_a_dead_job_raises_job_failed_with_its_last_error(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry_of())
    runner.start()
    message_id = runner.dispatch("reports:job:broken", {})

    with pytest.raises(JobFailedError) as failed:
        runner.result(message_id, timeout_s=30)
    assert failed.value.status == "dead"
    assert failed.value.error_type == "ValueError"
    assert failed.value.error_message == "no such invoice"


def test_a_value_that_is_not_json_fails_the_attempt_with_result_error(
    make_runner: RunnerFactory,
) -> None:
    runner = make_runner(registry_of())
    runner.start()
    message_id = runner.dispatch("reports:job:not_json", {})

    with pytest.raises(JobFailedError) as failed:
        runner.result(message_id, timeout_s=30)
    assert failed.value.error_type == "ResultError"
    assert "reports:job:not_json" in (failed.value.error_message or "")
    assert "when" in (failed.value.error_message or "")


def test_not_found_tells_unknown_ids_and_jobs_that_keep_no_result(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry_of())
    runner.start()
    forgetful = runner.dispatch("reports:job:forgetful", {})
    runner.drain(timeout_s=30)

    with pytest.raises(NotFoundError, match="keeps no result"):
        runner.result(forgetful)
    with pytest.raises(NotFoundError, match="no such message"):
        runner.result("0" * 8 + "-0000-4000-8000-" + "0" * 12)
    # nothing is kept for a job without keep_result_s
    assert not redis_client.exists(keys.result(prefix, forgetful))

    # And a result past its TTL is told apart
    kept = runner.dispatch("reports:job:later", {})
    assert runner.result(kept, timeout_s=30) == 1
    redis_client.delete(keys.result(prefix, kept))
    with pytest.raises(NotFoundError, match="past its TTL"):
        runner.result(kept)


def test_a_cancelled_message_wakes_its_waiter_with_job_failed(
    make_runner: RunnerFactory,
) -> None:
    # Given a message delayed for an hour, and a waiter
    runner = make_runner(registry_of())
    message_id = runner.dispatch("reports:job:later", {}, delay_ms=3_600_000)
    waiter, raised = waiting(runner, message_id, timeout_s=60)
    # When it is cancelled
    assert runner.cancel(message_id)
    waiter.join(40)
    # Then the waiter learns it ended cancelled
    assert len(raised) == 1
    assert isinstance(raised[0], JobFailedError)
    assert raised[0].status == "cancelled"


def test_the_result_is_kept_for_keep_result_s(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry_of())
    runner.start()
    message_id = runner.dispatch("reports:job:plain", {})
    runner.result(message_id, timeout_s=30)
    ttl_ms = redis_client.pttl(keys.result(prefix, message_id))
    assert 0 < ttl_ms <= 600_000


def test_the_kumiko_result_command_prints_the_value(
    make_runner: RunnerFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    redis_url: str,
    prefix: str,
) -> None:
    runner = make_runner(registry_of())
    runner.start()
    message_id = runner.dispatch("reports:job:plain", {"a": 1})
    runner.result(message_id, timeout_s=30)
    monkeypatch.setenv("KUMIKO_APP", "tests.integration.test_results:APP")
    monkeypatch.setenv("KUMIKO_REDIS_URL", redis_url)
    monkeypatch.setenv("KUMIKO_QUEUE_PREFIX", prefix)

    assert cli.main(["result", message_id, "--wait", "5"]) == 0
    assert capsys.readouterr().out.strip() == '{"echo": {"a": 1}, "attempt": 1}'
    with pytest.raises(SystemExit) as exited:
        cli.main(["result", "0" * 8 + "-0000-4000-8000-" + "0" * 12])
    assert exited.value.code == 1
    assert "no such message" in capsys.readouterr().err


def test_keep_result_s_must_be_a_positive_integer() -> None:
    feature = Feature("f")
    for bad in (0, -1, 1.5, True, "60"):
        with pytest.raises(JobConfigError, match="keep_result_s must be a positive integer"):
            feature.job("j", keep_result_s=bad)


def test_a_result_that_breaks_the_model_is_a_result_error() -> None:
    from kumiko_dramatiq.workflows.results import encode_result

    job = registry_of().jobs["reports:job:render"]
    with pytest.raises(ResultError, match="must be a Receipt: total_cents"):
        encode_result(job, {"invoice": "x", "total_cents": "many"}, max_bytes=1000)
    with pytest.raises(ResultError, match="KUMIKO_MAX_RESULT_BYTES"):
        encode_result(registry_of().jobs["reports:job:plain"], "x" * 2000, max_bytes=1000)


def test_a_purge_wakes_the_waiters_of_what_it_removed(make_runner: RunnerFactory) -> None:
    # Given a delayed message and a waiter (the purge announces every result, not an id)
    runner = make_runner(registry_of())
    message_id = runner.dispatch("reports:job:later", {}, delay_ms=3_600_000)
    waiter, raised = waiting(runner, message_id, timeout_s=50)
    # When the job's delayed messages are purged
    assert runner.purge("reports:job:later", state="delayed") == 1
    waiter.join(40)
    # Then the waiter learns at once that no such message is left (well before its 50 s)
    assert not waiter.is_alive()
    assert len(raised) == 1
    assert isinstance(raised[0], NotFoundError)


def test_a_sequential_hand_off_keeps_its_result_under_the_dispatched_id(
    make_runner: RunnerFactory,
) -> None:
    # Given a sequential job whose first run holds the lock until a gate opens
    gate = threading.Event()
    feature = Feature("seq")

    @feature.job("step", concurrency="sequential", keep_result_s=600)
    def step(payload: dict[str, Any], ctx: JobContext) -> str:
        if payload.get("block"):
            gate.wait(30)
        return f"done {payload['n']}"

    runner = make_runner(Registry([feature]), sequential_retry_delay_ms=50)
    runner.start()
    first = runner.dispatch("seq:job:step", {"n": 1, "block": True})
    second = runner.dispatch("seq:job:step", {"n": 2})  # finds the lock held: handed off

    # When the lock frees, the hand-off runs (a message id of its own)
    gate.set()

    # Then both values are read by the ids dispatch returned
    assert runner.result(first, timeout_s=30) == "done 1"
    assert runner.result(second, timeout_s=30) == "done 2"


APP = registry_of()
