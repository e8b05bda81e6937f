"""Per-tenant fan-out against a real Redis, through JobRunner and its broker.

A per-tenant dispatch runs a wrapper (hooks: the job's name, ``tenant_id``
None) that enqueues one child per active tenant (hooks: ``tenant_id`` set,
``trigger="fanout"``). Tests wait on hooks and on drained queues, then count
what ran: "exactly once" is checked after nothing is left to run.
"""

from __future__ import annotations

import itertools
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime
from typing import Any

import pytest
import redis
from dramatiq.broker import Broker
from dramatiq.common import dq_name
from dramatiq.message import Message
from dramatiq.middleware import Middleware, MiddlewareError

from kumiko_dramatiq import (
    Backoff,
    Feature,
    JobConfigError,
    JobContext,
    JobRunner,
    Registry,
    Retention,
    build_message_options,
)
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.delivery import Delivery
from kumiko_dramatiq.broker.keys import queue_messages
from kumiko_dramatiq.codec import KumikoOptions
from kumiko_dramatiq.errors import KumikoError, TenantListError
from kumiko_dramatiq.ids import child_message_id
from kumiko_dramatiq.messages import build_message
from kumiko_dramatiq.worker import fanout as fanout_module
from kumiko_dramatiq.worker.execution import Execution
from kumiko_dramatiq.worker.fanout import fan_out
from tests.conftest import HookEvent, Recorder, RunnerFactory, wait_for

JOB = "reports:job:nightly"
UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"

Handler = Callable[[dict[str, Any], JobContext], None]


def _noop(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


def per_tenant_registry(handler: Handler = _noop, **options: Any) -> Registry:
    feature = Feature("reports")
    feature.job("nightly", per_tenant=True, **options)(handler)
    return Registry([feature])


def tenants(count: int) -> list[str]:
    """``count`` tenant ids unique to this test run."""
    run = uuid.uuid4().hex[:8]
    return [f"tenant-{run}-{index}" for index in range(count)]


def drained(client: redis.Redis, prefix: str) -> bool:
    """Nothing of the worker lane is queued, delayed or unacked (one atomic snapshot).

    A retry, a delayed message coming due and a fan-out all write their new
    messages before the message that caused them is acked, so an empty
    snapshot means nothing is left to run.
    """
    queue = f"{prefix}-worker"
    pipe = client.pipeline(transaction=True)
    pipe.hlen(queue_messages(queue))
    pipe.hlen(queue_messages(dq_name(queue)))
    return bool(pipe.execute() == [0, 0])


def wait_drained(client: redis.Redis, prefix: str) -> None:
    wait_for(lambda: drained(client, prefix), what="the worker queue to drain")


def wrapper_events(recorder: Recorder, kind: str) -> list[HookEvent]:
    return [e for e in recorder.of(kind, JOB) if e.meta.tenant_id is None]


def child_events(recorder: Recorder, kind: str) -> list[HookEvent]:
    return [e for e in recorder.of(kind, JOB) if e.meta.tenant_id is not None]


def runs_per_tenant(recorder: Recorder) -> Counter[str | None]:
    return Counter(e.meta.tenant_id for e in child_events(recorder, "start"))


class ChildEnqueueRefused(MiddlewareError):
    """Raised by a test middleware's ``before_enqueue`` (a ``MiddlewareError``
    is the one kind ``emit_before`` does not swallow)."""


class RefuseChildOnce(Middleware):
    """Refuses the enqueue of one tenant's child, the first time only, and
    counts the children actually enqueued (before the refusal and in all)."""

    def __init__(self, tenant_id: str) -> None:
        self.tenant_id = tenant_id
        self.children_enqueued = 0
        self.children_enqueued_before_refusal: int | None = None

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        tenant = message.options.get("kumiko_tenant_id")
        if tenant == self.tenant_id and self.children_enqueued_before_refusal is None:
            self.children_enqueued_before_refusal = self.children_enqueued
            raise ChildEnqueueRefused(f"refusing the child of {self.tenant_id}")

    def after_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        if message.options.get("kumiko_tenant_id") is not None:
            self.children_enqueued += 1


class CaptureEnqueued(Middleware):
    """Keeps every message the broker actually enqueued."""

    def __init__(self) -> None:
        self.messages: list[Message[Any]] = []

    def after_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        self.messages.append(message)


# -- children ---------------------------------------------------------------


def test_each_tenant_runs_its_child_with_its_tenant_id_and_the_wrapper_payload(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a per-tenant job and three active tenants
    ids = tenants(3)
    seen: list[tuple[str | None, dict[str, Any], str]] = []

    def handler(payload: dict[str, Any], ctx: JobContext) -> None:
        seen.append((ctx.tenant_id, payload, ctx.trigger))

    runner = make_runner(
        per_tenant_registry(handler), get_active_tenant_ids=lambda: ids, **recorder.hooks()
    )
    runner.start()
    # When it is dispatched
    wrapper_id = runner.dispatch(JOB, {"day": "2024-05-01"})
    recorder.wait_until(lambda r: len(child_events(r, "complete")) == 3, what="3 children")
    wait_drained(redis_client, prefix)
    # Then each tenant ran once, with the wrapper's payload, as a "fanout" child
    assert sorted(seen) == sorted((t, {"day": "2024-05-01"}, "fanout") for t in ids)
    assert {e.message_id: e.meta.tenant_id for e in child_events(recorder, "complete")} == {
        child_message_id(wrapper_id, t): t for t in ids
    }
    # And the wrapper's own hooks name the job, with no tenant
    [wrapper_done] = wrapper_events(recorder, "complete")
    assert wrapper_done.message_id == wrapper_id
    assert wrapper_done.job_name == JOB


def test_each_child_retries_on_its_own_message_id(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a per-tenant job with one retry whose first attempt always fails
    ids = tenants(3)

    def handler(payload: dict[str, Any], ctx: JobContext) -> None:
        if ctx.attempt == 1:
            raise RuntimeError(f"first attempt of {ctx.tenant_id} fails")

    runner = make_runner(
        per_tenant_registry(handler, retries=1),
        get_active_tenant_ids=lambda: ids,
        **recorder.hooks(),
    )
    runner.start()
    wrapper_id = runner.dispatch(JOB)
    recorder.wait_until(lambda r: len(child_events(r, "complete")) == 3, what="3 children")
    wait_drained(redis_client, prefix)
    # Then every child failed attempt 1 and completed attempt 2, on its own id
    expected = {child_message_id(wrapper_id, t): t for t in ids}
    failed = child_events(recorder, "failed")
    completed = child_events(recorder, "complete")
    assert {(e.message_id, e.meta.tenant_id, e.meta.attempt) for e in failed} == {
        (m, t, 1) for m, t in expected.items()
    }
    assert {(e.message_id, e.meta.tenant_id, e.meta.attempt) for e in completed} == {
        (m, t, 2) for m, t in expected.items()
    }
    assert all(e.meta.trigger == "fanout" and e.meta.max_attempts == 2 for e in completed)
    # And the wrapper itself ran once: the children's retries are their own
    assert [e.meta.attempt for e in wrapper_events(recorder, "start")] == [1]


def test_children_are_enqueued_through_the_broker_with_the_job_options(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a per-tenant job with retries and backoff, and a middleware that
    # sees every message the broker enqueues
    ids = tenants(2)
    registry = per_tenant_registry(retries=2, backoff=Backoff("fixed", 50))
    runner = make_runner(registry, get_active_tenant_ids=lambda: ids, **recorder.hooks())
    capture = CaptureEnqueued()
    runner.broker.add_middleware(capture)
    runner.start()
    wrapper_id = runner.dispatch(JOB, {"n": 1})
    recorder.wait_until(lambda r: len(child_events(r, "complete")) == 2, what="2 children")
    wait_drained(redis_client, prefix)
    # Then every child passed after_enqueue with the job's retry options, its
    # tenant, the "fanout" trigger and the wrapper's payload, on the job's actor
    children = [m for m in capture.messages if m.options.get("kumiko_tenant_id") is not None]
    assert sorted(m.options["kumiko_tenant_id"] for m in children) == sorted(ids)
    for child in children:
        assert build_message_options(registry.jobs[JOB]).items() <= child.options.items()
        assert child.options["kumiko_trigger"] == "fanout"
        assert child.args == ({"n": 1},)
        assert child.actor_name == JOB
        assert child.message_id == child_message_id(wrapper_id, child.options["kumiko_tenant_id"])
    # And so did the wrapper, on the wrapper actor
    [wrapper] = [m for m in capture.messages if m.message_id == wrapper_id]
    assert build_message_options(registry.jobs[JOB]).items() <= wrapper.options.items()
    assert wrapper.actor_name == JOB + ":fanout"


def test_children_do_not_inherit_the_wrapper_dedup_key_but_inherit_its_cron_tick(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a wrapper on its second attempt, holding a dedup key and a cron
    # tick (producer only: the wrapper body runs here, no worker)
    ids = tenants(2)
    registry = per_tenant_registry(retries=1)
    runner = make_runner(registry, get_active_tenant_ids=lambda: ids)
    tick = "2024-05-01T02:00:00+00:00"
    wrapper = build_message(
        registry.jobs[JOB],
        {"n": 1},
        queue_prefix=prefix,
        trigger="cron",
        failures=1,
        dedup_key="nightly",
        scheduled_at=datetime.fromisoformat(tick),
    )
    # When it fans out
    fan_out(runner.runtime, _execution(registry, wrapper), {"n": 1})
    # Then its children carry the tick, but neither the key (a key covers the
    # wrapper only) nor the wrapper's spent attempt
    children = _queued(redis_client, prefix)
    assert sorted(c.options["kumiko_tenant_id"] for c in children) == sorted(ids)
    for child in children:
        assert child.options["kumiko_scheduled_at"] == tick
        assert child.options["kumiko_trigger"] == "fanout"
        assert "kumiko_dedup_key" not in child.options
        assert "kumiko_failures" not in child.options


# -- running again with the same wrapper id ---------------------------------


def test_wrapper_retried_after_a_resolver_failure_fans_out_exactly_once(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a resolver that fails on its first call
    ids = tenants(4)
    calls = itertools.count()

    def resolver() -> list[str]:
        if next(calls) == 0:
            raise ConnectionError("tenant directory is down")
        return ids

    runner = make_runner(
        per_tenant_registry(retries=1), get_active_tenant_ids=resolver, **recorder.hooks()
    )
    runner.start()
    wrapper_id = runner.dispatch(JOB)
    recorder.wait_until(lambda r: len(child_events(r, "complete")) == 4, what="4 children")
    wait_drained(redis_client, prefix)
    # Then the wrapper failed attempt 1, completed attempt 2 on the same id,
    # and every tenant ran exactly once
    [failed] = wrapper_events(recorder, "failed")
    assert (failed.message_id, failed.meta.attempt) == (wrapper_id, 1)
    assert isinstance(failed.exc, ConnectionError)
    [done] = wrapper_events(recorder, "complete")
    assert (done.message_id, done.meta.attempt) == (wrapper_id, 2)
    assert runs_per_tenant(recorder) == Counter(ids)


def test_wrapper_failing_after_half_its_children_runs_every_tenant_once_after_its_retry(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    # Given more tenants than one batch, and a broker middleware that refuses
    # one child of the second batch the first time: the first attempt enqueues
    # the whole first batch, then fails
    batch = fanout_module.CHILD_BATCH_SIZE
    ids = tenants(batch + 100)
    refuse = RefuseChildOnce(ids[batch + 50])
    runner = make_runner(
        per_tenant_registry(retries=1), get_active_tenant_ids=lambda: ids, **recorder.hooks()
    )
    runner.broker.add_middleware(refuse)
    runner.start()
    wrapper_id = runner.dispatch(JOB)
    recorder.wait_until(lambda r: len(child_events(r, "complete")) == len(ids), what="every child")
    wait_drained(redis_client, prefix)
    # Then the wrapper's first attempt enqueued one full batch, then failed on
    # the refusal; its retry completed
    assert refuse.children_enqueued_before_refusal == batch
    [failed] = wrapper_events(recorder, "failed")
    assert (failed.message_id, failed.meta.attempt) == (wrapper_id, 1)
    assert isinstance(failed.exc, ChildEnqueueRefused)
    [done] = wrapper_events(recorder, "complete")
    assert (done.message_id, done.meta.attempt) == (wrapper_id, 2)
    # And every child was enqueued once and every tenant ran exactly once
    assert refuse.children_enqueued == len(ids)
    assert runs_per_tenant(recorder) == Counter(ids)


def test_the_same_wrapper_message_delivered_twice_fans_out_once(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    # Given one wrapper message enqueued, and the written copy enqueued again (a second
    # delivery of the same id, as a redelivery makes: it carries its redis id, so it is
    # written as a new copy, not recognised as a re-sent write)
    ids = tenants(5)
    registry = per_tenant_registry()
    runner = make_runner(registry, get_active_tenant_ids=lambda: ids, **recorder.hooks())
    wrapper = build_message(registry.jobs[JOB], {}, queue_prefix=prefix, trigger="manual")
    written = runner.broker.enqueue(wrapper)
    runner.broker.enqueue(written)
    # When a worker runs both deliveries
    runner.start()
    recorder.wait_until(lambda r: len(wrapper_events(r, "complete")) == 2, what="2 wrappers")
    wait_drained(redis_client, prefix)
    # Then each tenant ran once, as the child of that wrapper id
    assert runs_per_tenant(recorder) == Counter(ids)
    assert {e.message_id for e in child_events(recorder, "start")} == {
        child_message_id(wrapper.message_id, t) for t in ids
    }


def test_a_new_dispatch_fans_out_again(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a per-tenant job dispatched twice
    ids = tenants(3)
    runner = make_runner(
        per_tenant_registry(), get_active_tenant_ids=lambda: ids, **recorder.hooks()
    )
    runner.start()
    first = runner.dispatch(JOB)
    second = runner.dispatch(JOB)
    recorder.wait_until(lambda r: len(child_events(r, "complete")) == 6, what="6 children")
    wait_drained(redis_client, prefix)
    # Then each tenant ran once per dispatch, under each wrapper's own child ids
    assert runs_per_tenant(recorder) == Counter(ids * 2)
    assert {e.message_id for e in child_events(recorder, "start")} == {
        child_message_id(w, t) for w in (first, second) for t in ids
    }


# -- batches and guards -----------------------------------------------------


def test_fan_out_enqueues_many_tenants_in_batches_with_guards_living_completed_age(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a producer-only runner (no worker) and more than two batches of tenants
    ids = tenants(2 * fanout_module.CHILD_BATCH_SIZE + 7)
    registry = per_tenant_registry()
    runner = make_runner(
        registry, get_active_tenant_ids=lambda: ids, retention=Retention(completed_age_s=3_600)
    )
    wrapper = build_message(registry.jobs[JOB], {}, queue_prefix=prefix, trigger="manual")
    # When the wrapper's body runs twice
    fan_out(runner.runtime, _execution(registry, wrapper), {})
    fan_out(runner.runtime, _execution(registry, wrapper), {})
    # Then the queue holds exactly one child per tenant
    child_ids = [child.message_id for child in _queued(redis_client, prefix)]
    assert sorted(child_ids) == sorted(child_message_id(wrapper.message_id, t) for t in ids)
    # And each child's guard expires after completed_age_s
    ttl_ms = redis_client.pttl(keys.enqueue_guard(prefix, child_ids[0]))
    assert 3_500_000 < ttl_ms <= 3_600_000


def _execution(registry: Registry, wrapper: Message[Any]) -> Execution:
    """The Execution the worker would open for a delivery of ``wrapper``."""
    job = registry.jobs[JOB]
    delivery = Delivery(wrapper, fetched_from=wrapper.queue_name, redis_message_id="r1")
    return Execution(job, delivery, KumikoOptions.decode(wrapper.options), True)


def _queued(client: redis.Redis, prefix: str) -> list[Message[Any]]:
    """Every message waiting in the worker lane's queue."""
    raw = client.hvals(queue_messages(f"{prefix}-worker"))
    return [Message.decode(item if isinstance(item, bytes) else item.encode()) for item in raw]


# -- resolver output --------------------------------------------------------


def test_an_async_resolver_is_awaited(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    ids = tenants(3)

    async def resolver() -> list[str]:
        return ids

    runner = make_runner(per_tenant_registry(), get_active_tenant_ids=resolver, **recorder.hooks())
    runner.start()
    runner.dispatch(JOB)
    recorder.wait_until(lambda r: len(child_events(r, "complete")) == 3, what="3 children")
    wait_drained(redis_client, prefix)
    assert runs_per_tenant(recorder) == Counter(ids)


def test_an_async_generator_resolver_is_collected(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    ids = tenants(3)

    async def resolver() -> AsyncIterator[str]:
        for tenant in ids:
            yield tenant

    runner = make_runner(per_tenant_registry(), get_active_tenant_ids=resolver, **recorder.hooks())
    runner.start()
    runner.dispatch(JOB)
    recorder.wait_until(lambda r: len(child_events(r, "complete")) == 3, what="3 children")
    wait_drained(redis_client, prefix)
    assert runs_per_tenant(recorder) == Counter(ids)


def test_a_generator_resolver_fans_out_to_what_it_yields(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    ids = tenants(3)

    def resolver() -> Iterator[str]:
        yield from ids

    runner = make_runner(per_tenant_registry(), get_active_tenant_ids=resolver, **recorder.hooks())
    runner.start()
    runner.dispatch(JOB)
    recorder.wait_until(lambda r: len(child_events(r, "complete")) == 3, what="3 children")
    wait_drained(redis_client, prefix)
    assert runs_per_tenant(recorder) == Counter(ids)


def test_duplicate_tenant_ids_collapse_into_one_child(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    a, b = tenants(2)
    runner = make_runner(
        per_tenant_registry(), get_active_tenant_ids=lambda: [a, b, a, a, b], **recorder.hooks()
    )
    runner.start()
    runner.dispatch(JOB)
    recorder.wait_until(lambda r: len(wrapper_events(r, "complete")) == 1, what="the wrapper")
    wait_drained(redis_client, prefix)
    assert runs_per_tenant(recorder) == Counter([a, b])


def test_no_active_tenants_completes_the_wrapper_without_children(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(
        per_tenant_registry(), get_active_tenant_ids=lambda: [], **recorder.hooks()
    )
    runner.start()
    runner.dispatch(JOB)
    recorder.wait_until(lambda r: len(wrapper_events(r, "complete")) == 1, what="the wrapper")
    wait_drained(redis_client, prefix)
    assert child_events(recorder, "start") == []


@pytest.mark.parametrize(
    ("resolved", "bad_value"),
    [
        pytest.param(None, None, id="none"),
        pytest.param("tenant-a", "tenant-a", id="a-string"),
        pytest.param(42, 42, id="an-int"),
        pytest.param([""], "", id="an-empty-id"),
        pytest.param([1], 1, id="an-int-id"),
        pytest.param(["tenant-a", None], None, id="a-none-id-after-a-good-one"),
    ],
)
def test_bad_resolver_output_fails_the_wrapper_attempt_and_enqueues_nothing(
    make_runner: RunnerFactory,
    recorder: Recorder,
    redis_client: redis.Redis,
    prefix: str,
    resolved: Any,
    bad_value: Any,
) -> None:
    # Given a resolver returning bad output and a job without retries
    runner = make_runner(
        per_tenant_registry(), get_active_tenant_ids=lambda: resolved, **recorder.hooks()
    )
    runner.start()
    wrapper_id = runner.dispatch(JOB)
    recorder.wait_until(lambda r: len(wrapper_events(r, "failed")) == 1, what="the wrapper")
    wait_drained(redis_client, prefix)
    # Then the wrapper attempt failed with an error naming the job and the bad value
    [failed] = wrapper_events(recorder, "failed")
    assert failed.message_id == wrapper_id
    assert isinstance(failed.exc, TenantListError)
    assert isinstance(failed.exc, KumikoError)
    assert JOB in str(failed.exc)
    assert repr(bad_value) in str(failed.exc)
    # And no child was enqueued, not even for the good id before the bad one
    assert child_events(recorder, "start") == []
    assert list(redis_client.scan_iter(match=keys.enqueue_guard(prefix, "*"))) == []


# -- the retention invariant --------------------------------------------------


def _registry_with_window(retries: int, delay_ms: int, backoff: str = "fixed") -> Registry:
    return per_tenant_registry(retries=retries, backoff=Backoff(backoff, delay_ms))  # type: ignore[arg-type]


def test_runner_rejects_a_retry_window_equal_to_completed_age_before_connecting() -> None:
    # fixed: 3 retries * 20 s = 60 s, not below 60 s; the unreachable Redis
    # proves the check needs no connection
    with pytest.raises(JobConfigError, match="retry window") as caught:
        JobRunner(
            _registry_with_window(3, 20_000),
            redis_url=UNREACHABLE_REDIS,
            retention=Retention(completed_age_s=60),
        )
    assert JOB in str(caught.value)


def test_runner_rejects_an_exponential_retry_window_above_completed_age() -> None:
    # exponential: 1 s * (2**6 - 1) = 63 s > 60 s
    with pytest.raises(JobConfigError, match="retry window"):
        JobRunner(
            _registry_with_window(6, 1_000, "exponential"),
            redis_url=UNREACHABLE_REDIS,
            retention=Retention(completed_age_s=60),
        )


def test_runner_accepts_a_retry_window_below_completed_age() -> None:
    # exponential: 1 s * (2**5 - 1) = 31 s; fixed 59.999 s: both below 60 s
    for registry in (
        _registry_with_window(5, 1_000, "exponential"),
        _registry_with_window(1, 59_999),
    ):
        runner = JobRunner(
            registry, redis_url=UNREACHABLE_REDIS, retention=Retention(completed_age_s=60)
        )
        runner.stop()


def test_retry_window_limit_applies_to_per_tenant_jobs_only() -> None:
    feature = Feature("reports")
    feature.job("plain", retries=3, backoff=Backoff("fixed", 20_000))(_noop)
    runner = JobRunner(
        Registry([feature]), redis_url=UNREACHABLE_REDIS, retention=Retention(completed_age_s=60)
    )
    runner.stop()
