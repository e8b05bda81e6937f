"""Testing your jobs: ``run_job`` (in-process), ``runner.drain()`` and the pytest plugin."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import redis

from kumiko_dramatiq import (
    Backoff,
    Feature,
    JobConfigError,
    JobContext,
    JobRunner,
    PayloadError,
    Registry,
    UnknownJobError,
)
from kumiko_dramatiq.errors import DrainTimeoutError
from kumiko_dramatiq.testing import RunnerFactory, run_job
from tests.conftest import RunnerFactory as MakeRunner

pytest_plugins = ["pytester", "kumiko_dramatiq.pytest_plugin"]

shop = Feature("shop")
seen: list[JobContext] = []


@shop.job("ship", retries=2)
def ship(payload: dict[str, Any], ctx: JobContext) -> str:
    seen.append(ctx)
    payload["touched"] = True
    return f"shipped {payload['order']}"


@shop.job("audit", retries=1)
async def audit(payload: dict[str, Any], ctx: JobContext) -> int:
    await asyncio.sleep(0)
    return int(payload["n"]) * 2


@shop.job("close_books", per_tenant=True)
def close_books(payload: dict[str, Any], ctx: JobContext) -> str | None:
    return ctx.tenant_id


@shop.job("refund")
def refund(payload: dict[str, Any], ctx: JobContext) -> None:
    raise LookupError(f"no order {payload['order']}")


@shop.job("report", run_in="api")
def report(payload: dict[str, Any], ctx: JobContext) -> None: ...


registry = Registry([shop])


# -- run_job ------------------------------------------------------------------------------------
def test_run_job_runs_a_sync_handler_with_the_context_of_a_dispatched_message() -> None:
    # Given a payload the caller keeps, When its job runs in-process
    payload = {"order": 7}
    seen.clear()
    result = run_job(registry, "shop:job:ship", payload, app="the app")
    # Then the handler got a real context of attempt 1 of 3, a copy of the payload, and
    # its return value comes back
    assert result == "shipped 7"
    (ctx,) = seen
    assert (ctx.job_name, ctx.attempt, ctx.meta.max_attempts) == ("shop:job:ship", 1, 3)
    assert (ctx.tenant_id, ctx.trigger, ctx.app, ctx.meta.final_attempt) == (
        None,
        "manual",
        "the app",
        False,
    )
    assert ctx.message_id
    assert payload == {"order": 7}


def test_run_job_at_the_last_attempt_runs_a_final_attempt() -> None:
    seen.clear()
    run_job(registry, "shop:job:ship", {"order": 1}, attempt=3)
    assert (seen[0].attempt, seen[0].meta.final_attempt) == (3, True)


def test_run_job_runs_an_async_handler_to_completion() -> None:
    assert run_job(registry, "shop:job:audit", {"n": 21}) == 42


def test_run_job_runs_an_async_handler_when_called_from_async_code() -> None:
    async def caller() -> Any:
        return run_job(registry, "shop:job:audit", {"n": 5})

    assert asyncio.run(caller()) == 10


def test_run_job_runs_the_child_handler_of_a_per_tenant_job_for_its_tenant() -> None:
    assert run_job(registry, "shop:job:close_books", tenant_id="acme") == "acme"


def test_run_job_of_a_per_tenant_job_without_a_tenant_says_it_needs_one() -> None:
    with pytest.raises(PayloadError, match=r"^shop:job:close_books: tenant_id is required"):
        run_job(registry, "shop:job:close_books")


def test_run_job_refuses_a_tenant_for_a_job_that_is_not_per_tenant() -> None:
    with pytest.raises(PayloadError, match=r"^shop:job:ship: tenant_id must be None"):
        run_job(registry, "shop:job:ship", {"order": 1}, tenant_id="acme")


def test_run_job_refuses_an_attempt_beyond_the_jobs_attempts() -> None:
    with pytest.raises(PayloadError, match=r"attempt must be an integer from 1 to 3.*got 4"):
        run_job(registry, "shop:job:ship", {"order": 1}, attempt=4)


def test_run_job_lets_the_handlers_exception_through() -> None:
    with pytest.raises(LookupError, match="no order 9"):
        run_job(registry, "shop:job:refund", {"order": 9})


@pytest.mark.parametrize(
    "payload",
    [
        ["not", "an", "object"],
        {"x": float("nan")},
        {"x": {1, 2}},
        {"x": 2**64},
        {"x": "\ud800"},
        {1: "integer key"},
    ],
    ids=["list", "nan", "set", "huge-int", "lone-surrogate", "int-key"],
)
def test_run_job_refuses_a_bad_payload_with_the_error_dispatch_raises(
    payload: Any, redis_url: str
) -> None:
    # A runner that never starts opens no connection: dispatch checks before it writes.
    with (
        JobRunner(registry, redis_url=redis_url, queue_prefix="never_used") as runner,
        pytest.raises(PayloadError) as by_dispatch,
    ):
        runner.dispatch("shop:job:ship", payload)
    with pytest.raises(PayloadError) as by_run_job:
        run_job(registry, "shop:job:ship", payload)
    assert str(by_run_job.value) == str(by_dispatch.value)


def test_run_job_applies_the_payload_size_limit_of_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KUMIKO_MAX_PAYLOAD_BYTES", "64")
    with pytest.raises(PayloadError, match="too large once encoded"):
        run_job(registry, "shop:job:ship", {"order": "x" * 100})


def test_run_job_of_an_unknown_job_raises_what_dispatch_raises(redis_url: str) -> None:
    with (
        JobRunner(registry, redis_url=redis_url, queue_prefix="never_used") as runner,
        pytest.raises(UnknownJobError) as by_dispatch,
    ):
        runner.dispatch("shop:job:nope")
    with pytest.raises(UnknownJobError) as by_run_job:
        run_job(registry, "shop:job:nope")
    assert str(by_run_job.value) == str(by_dispatch.value)


def test_run_job_needs_no_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUMIKO_REDIS_URL", "redis://127.0.0.1:1/0")
    assert run_job(registry, "shop:job:ship", {"order": 3}) == "shipped 3"


# -- drain --------------------------------------------------------------------------------------
billing = Feature("billing")


@billing.job("charge", retries=2, backoff=Backoff("fixed", delay_ms=50))
def charge(payload: dict[str, Any], ctx: JobContext) -> None:
    if ctx.attempt < 3:
        raise ConnectionError("card network down")


@billing.job("book")
def book(payload: dict[str, Any], ctx: JobContext) -> None: ...


billing_registry = Registry([billing])


def test_a_dispatch_that_retries_twice_then_completes(kumiko_runner: RunnerFactory) -> None:
    # The end-to-end example of docs/testing.md, as a user writes it (backoffs of 50 ms included).
    runner = kumiko_runner(billing_registry)
    runner.dispatch("billing:job:charge", {"invoice": 7})
    runs = runner.drain()
    assert [(run.attempt, run.status) for run in runs] == [
        (1, "failed"),
        (2, "failed"),
        (3, "completed"),
    ]


def test_drain_returns_each_run_once(make_runner: MakeRunner) -> None:
    runner = make_runner(billing_registry)
    runner.start()
    first = runner.dispatch("billing:job:book")
    assert [run.message_id for run in runner.drain()] == [first]
    second = runner.dispatch("billing:job:book")
    assert [run.message_id for run in runner.drain()] == [second]
    assert runner.drain() == []


def test_drain_waits_for_a_fan_out_and_its_children(make_runner: MakeRunner) -> None:
    runner = make_runner(registry, get_active_tenant_ids=lambda: ["acme", "globex"])
    runner.start()
    runner.dispatch("shop:job:close_books")
    runs = runner.drain()
    assert sorted((run.trigger, run.tenant_id or "", run.status) for run in runs) == [
        ("fanout", "acme", "completed"),
        ("fanout", "globex", "completed"),
        ("manual", "", "completed"),
    ]


def test_drain_times_out_naming_what_is_queued_and_delayed(make_runner: MakeRunner) -> None:
    # Given a runner that consumes nothing, a delayed message and one for the api lane
    runner = make_runner(Registry([shop]))
    delayed = runner.dispatch("shop:job:ship", {"order": 1}, delay_ms=60_000)
    queued = runner.dispatch("shop:job:report")
    # When it drains, Then it gives up after its timeout, naming them
    with pytest.raises(DrainTimeoutError) as raised:
        runner.drain(timeout_s=0.1)
    message = str(raised.value)
    assert "worker lane: 0 queued, 1 delayed; api lane: 1 queued, 0 delayed; 0 running" in message
    assert f"shop:job:ship {delayed} (delayed)" in message
    assert f"shop:job:report {queued} (queued)" in message
    assert "no live worker consumes the worker lane" in message
    assert "no live worker consumes the api lane" in message


def test_drain_times_out_naming_a_running_job_then_returns_it_once_done(
    make_runner: MakeRunner,
) -> None:
    started, release = threading.Event(), threading.Event()
    slow = Feature("slow")

    @slow.job("crunch")
    def crunch(payload: dict[str, Any], ctx: JobContext) -> None:
        started.set()
        release.wait(10)

    runner = make_runner(Registry([slow]))
    runner.start()
    message_id = runner.dispatch("slow:job:crunch")
    assert started.wait(10)
    with pytest.raises(DrainTimeoutError, match=rf"slow:job:crunch {message_id} \(running"):
        runner.drain(timeout_s=0.05)
    release.set()
    assert [(run.message_id, run.status) for run in runner.drain()] == [(message_id, "completed")]


@pytest.mark.parametrize("timeout_s", [-1, float("inf"), True, "5"])
def test_drain_refuses_a_timeout_that_is_not_a_number_of_seconds(
    make_runner: MakeRunner, timeout_s: Any
) -> None:
    runner = make_runner(billing_registry)
    with pytest.raises(JobConfigError, match="timeout_s must be a number of seconds"):
        runner.drain(timeout_s=timeout_s)


# -- the pytest plugin ---------------------------------------------------------------------------
INNER_TEST = """
from pathlib import Path
from kumiko_dramatiq import Feature, Registry

feature = Feature("inner")

@feature.job("greet", retries=1)
def greet(payload, ctx):
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails")

registry = Registry([feature])

def test_greets(kumiko_runner, kumiko_queue_prefix, kumiko_redis_url):
    Path("dataset.txt").write_text(kumiko_redis_url + " " + kumiko_queue_prefix)
    runner = kumiko_runner(registry)
    runner.dispatch("inner:job:greet")
    assert [run.status for run in runner.drain()] == ["failed", "completed"]
"""


def test_the_plugin_runs_each_test_on_a_dataset_of_its_own_and_deletes_it_after(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    monkeypatch.setenv("KUMIKO_TEST_REDIS_URL", redis_url)
    pytester.makepyfile(test_inner=INNER_TEST)
    result = pytester.runpytest("-p", "kumiko_dramatiq.pytest_plugin")
    result.assert_outcomes(passed=1)
    url, prefix = (pytester.path / "dataset.txt").read_text().split()
    assert url == redis_url
    client = redis.Redis.from_url(redis_url)
    try:
        assert list(client.scan_iter(match=f"*{prefix}*", count=1000)) == []
    finally:
        client.close()


def test_the_plugin_starts_a_private_redis_server_when_no_url_is_set(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUMIKO_TEST_REDIS_URL", raising=False)
    pytester.makepyfile(test_inner=INNER_TEST)
    result = pytester.runpytest("-p", "kumiko_dramatiq.pytest_plugin")
    result.assert_outcomes(passed=1)
    url = (pytester.path / "dataset.txt").read_text().split()[0]
    assert url.startswith("unix://")
    assert not Path(url.removeprefix("unix://").split("?")[0]).exists()


def test_the_plugin_without_any_redis_says_what_to_set_and_starts_nothing_unasked(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KUMIKO_TEST_REDIS_URL", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    pytester.makepyfile(
        test_inner="""
        def test_needs_redis(kumiko_queue_prefix):
            pass

        def test_needs_nothing():
            pass
        """
    )
    result = pytester.runpytest("-p", "kumiko_dramatiq.pytest_plugin")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*set KUMIKO_TEST_REDIS_URL*put redis-server on PATH*"])
