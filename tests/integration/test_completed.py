"""The "already completed" marker: a message id that completed never runs again."""

from __future__ import annotations

from typing import Any

import redis

from kumiko_dramatiq import Feature, JobContext, Registry
from tests.conftest import Recorder, RunnerFactory, wait_for


def registry(**options: Any) -> Registry:
    feature = Feature("billing")

    @feature.job("send", **options)
    def send(payload: dict[str, Any], ctx: JobContext) -> None:
        if payload.get("fail_first") and ctx.attempt == 1:
            raise RuntimeError("first attempt fails")

    return Registry([feature])


def test_a_completed_message_delivered_again_is_acked_without_running(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry(), **recorder.hooks())
    log: list[Any] = []

    class Capture:
        pass

    from dramatiq.middleware import Middleware

    class Keep(Middleware):
        def after_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
            log.append(message)

    runner.broker.add_middleware(Keep())
    runner.start()
    message_id = runner.dispatch("billing:job:send", {"n": 1})
    recorder.wait_until(lambda r: len(r.of("complete")) == 1)
    marker = f"kumiko:{prefix}:done:{message_id}"
    wait_for(lambda: bool(redis_client.exists(marker)), what="the completed marker")
    assert 0 < redis_client.pttl(marker) <= 60_000  # the resend window, not completed_age_s

    # Given the same message (same id) put back on the queue, as a redelivery would,
    # and a fresh message behind it,
    runner.broker.enqueue(log[0].copy(options={}))
    fresh = runner.dispatch("billing:job:send", {"n": 2})
    # when the fresh one has run, the old id has not run again.
    recorder.wait_until(lambda r: len(r.of("complete")) == 2)
    runner.broker.join(f"{prefix}-worker")
    assert [e.message_id for e in recorder.of("start")] == [message_id, fresh]


def test_a_failed_attempt_leaves_no_marker_so_its_retry_runs(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry(retries=1), **recorder.hooks())
    runner.start()
    message_id = runner.dispatch("billing:job:send", {"fail_first": True})
    recorder.wait_until(lambda r: len(r.of("complete")) == 1)
    assert [e.meta.attempt for e in recorder.of("start")] == [1, 2]
    wait_for(lambda: bool(redis_client.exists(f"kumiko:{prefix}:done:{message_id}")))
