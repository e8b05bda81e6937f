"""The "already completed" marker: a message id that completed never runs again; a command
re-sent after a dropped connection writes nothing twice."""

from __future__ import annotations

from typing import Any

import redis
from dramatiq.middleware import Middleware

from kumiko_dramatiq import Feature, JobContext, Registry
from kumiko_dramatiq.ids import redis_message_id
from tests.conftest import Recorder, RunnerFactory, wait_for


def registry(**options: Any) -> Registry:
    feature = Feature("billing")

    @feature.job("send", **options)
    def send(payload: dict[str, Any], ctx: JobContext) -> None:
        if payload.get("fail_first") and ctx.attempt == 1:
            raise RuntimeError("first attempt fails")
        if ctx.attempt < payload.get("succeed_on", 1):
            raise RuntimeError(f"attempt {ctx.attempt} fails")

    return Registry([feature])


class Sent(Middleware):
    """Keeps each message as the broker enqueued it (its redis id, its queue)."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    def after_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        self.messages.append(message)


def resend(runner: Any, prefix: str, message: Any) -> Any:
    """The command ``KumikoBroker.enqueue`` sent for ``message`` (on a lane queue: guard TTL
    0, its "sent" key only read), sent again as redis-py re-sends it once the reply of the
    first send was lost."""
    rid = message.options["redis_message_id"]
    queue = f"dramatiq:{message.queue_name}"
    return runner.broker.lua.guarded_enqueue(
        keys=[f"{queue}.msgs", queue, f"kumiko:{prefix}:sent:{rid}"],
        args=[rid, message.encode(), 0, "1"],
    )


def started(recorder: Recorder) -> list[tuple[str, int]]:
    return [(e.message_id, e.meta.attempt) for e in recorder.of("start")]


def test_a_completed_message_delivered_again_is_acked_without_running(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry(), **recorder.hooks())
    sent = Sent()
    runner.broker.add_middleware(sent)
    runner.start()
    message_id = runner.dispatch("billing:job:send", {"n": 1})
    recorder.wait_until(lambda r: len(r.of("complete")) == 1)
    marker = f"kumiko:{prefix}:done:{message_id}"
    wait_for(lambda: bool(redis_client.exists(marker)), what="the completed marker")
    assert 0 < redis_client.pttl(marker) <= 60_000  # the resend window, not completed_age_s

    # Given the same message (same id) put back on the queue, as a redelivery would,
    # and a fresh message behind it,
    runner.broker.enqueue(sent.messages[0].copy(options={}))
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


def test_an_enqueue_resent_while_its_message_waits_writes_nothing_and_no_marker(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry())
    sent = Sent()
    runner.broker.add_middleware(sent)
    runner.dispatch("billing:job:send", {"n": 1})
    (message,) = sent.messages
    rid = message.options["redis_message_id"]
    # The hot path writes no key of its own: the body is the guard while it waits
    assert not redis_client.exists(f"kumiko:{prefix}:sent:{rid}")

    assert resend(runner, prefix, message) == [0]
    assert redis_client.lrange(f"dramatiq:{prefix}-worker", 0, -1) == [rid.encode()]


def test_an_enqueue_resent_after_a_retry_does_not_run_the_first_attempt_again(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str
) -> None:
    runner = make_runner(registry(retries=1), worker_threads=1, **recorder.hooks())
    sent = Sent()
    runner.broker.add_middleware(sent)
    runner.start()
    message_id = runner.dispatch("billing:job:send", {"fail_first": True})
    recorder.wait_until(lambda r: len(r.of("complete")) == 1)
    # Given the first attempt failed (its body went, its retry ran), when the first write is
    # re-sent, the tombstone its settle left refuses it
    assert resend(runner, prefix, sent.messages[0]) == [0]
    # (and one thread runs the queue in order: a copy would start before the fresh one)
    fresh = runner.dispatch("billing:job:send", {"n": 2})
    recorder.wait_until(lambda r: len(r.of("complete")) == 2)
    assert started(recorder) == [(message_id, 1), (message_id, 2), (fresh, 1)]


def test_an_enqueue_resent_after_a_cancel_does_not_bring_the_message_back(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str
) -> None:
    runner = make_runner(registry(), worker_threads=1, **recorder.hooks())
    sent = Sent()
    runner.broker.add_middleware(sent)
    message_id = runner.dispatch("billing:job:send", {"n": 1})
    assert runner.cancel(message_id)

    assert resend(runner, prefix, sent.messages[0]) == [0]
    runner.start()
    fresh = runner.dispatch("billing:job:send", {"n": 2})
    recorder.wait_until(lambda r: len(r.of("complete")) == 1)
    runner.broker.join(f"{prefix}-worker")
    assert started(recorder) == [(fresh, 1)]


def test_an_enqueue_resent_after_completion_is_dropped_unrun_at_the_fetch(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry(), worker_threads=1, **recorder.hooks())
    sent = Sent()
    runner.broker.add_middleware(sent)
    runner.start()
    message_id = runner.dispatch("billing:job:send", {"n": 1})
    recorder.wait_until(lambda r: len(r.of("complete")) == 1)
    wait_for(lambda: bool(redis_client.exists(f"kumiko:{prefix}:done:{message_id}")))
    # Its body is gone and a completion leaves no tombstone: the copy is written, and the
    # "already completed" marker makes the fetch ack it unrun
    assert resend(runner, prefix, sent.messages[0]) == [1]
    fresh = runner.dispatch("billing:job:send", {"n": 2})
    recorder.wait_until(lambda r: len(r.of("complete")) == 2)
    runner.broker.join(f"{prefix}-worker")
    assert started(recorder) == [(message_id, 1), (fresh, 1)]


def test_only_a_first_write_leaves_a_tombstone_not_the_retries_a_settle_wrote(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry(retries=2), **recorder.hooks())
    runner.start()
    message_id = runner.dispatch("billing:job:send", {"succeed_on": 3})
    recorder.wait_until(lambda r: len(r.of("complete")) == 1)
    assert [e.meta.attempt for e in recorder.of("start")] == [1, 2, 3]
    # the first write's redis id was carried by an enqueue command: its end left the
    # tombstone; the retry of attempt 2 was written by the settle of attempt 1: none
    sent = f"kumiko:{prefix}:sent:"
    assert redis_client.exists(sent + redis_message_id(message_id))
    assert not redis_client.exists(sent + redis_message_id(message_id, 2))
