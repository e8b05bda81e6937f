"""OpenTelemetry tracing, recorded by the SDK's in-memory exporter after real runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kumiko_dramatiq import Feature, JobContext, Registry
from kumiko_dramatiq.codec import TRACE
from kumiko_dramatiq.messages import build_message
from tests.conftest import Recorder, RunnerFactory, wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """The SDK, installed once for this process, exporting to memory."""
    memory = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    yield memory
    memory.shutdown()  # later tests' spans are not kept


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> InMemorySpanExporter:
    exporter.clear()
    return exporter


def finished(exporter: InMemorySpanExporter, name: str, count: int) -> list[ReadableSpan]:
    """The finished spans named ``name``, once there are ``count`` of them, by start."""
    found: list[ReadableSpan] = []

    def enough() -> bool:
        found[:] = [span for span in exporter.get_finished_spans() if span.name == name]
        return len(found) >= count

    wait_for(enough, what=f"{count} span(s) {name}")
    return sorted(found, key=lambda span: span.start_time or 0)


def parent_id(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


def span_id(span: ReadableSpan) -> int:
    context = span.get_span_context()
    assert context is not None
    return context.span_id


def python_prints(code: str) -> list[str]:
    """The lines ``code`` prints, run by a fresh Python (its own OpenTelemetry globals) in the
    project's root; it must exit 0."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


tracer = trace.get_tracer("tests")


def test_an_attempt_runs_in_a_span_whose_parent_is_the_dispatching_span(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, spans: InMemorySpanExporter
) -> None:
    # Given a job whose handler opens a span of its own
    feature = Feature(prefix)

    @feature.job("traced")
    def traced(payload: dict[str, Any], ctx: JobContext) -> None:
        with tracer.start_as_current_span("inside"):
            pass

    runner = make_runner(Registry([feature]), **recorder.hooks())
    job = f"{prefix}:job:traced"
    # When it is dispatched inside a span, then runs
    with tracer.start_as_current_span("request") as request:
        message_id = runner.dispatch(job)
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete")) == 1)
    (attempt,) = finished(spans, job, 1)
    (inside,) = finished(spans, "inside", 1)
    # Then the attempt's span is a child of the dispatching span, in its trace
    assert parent_id(attempt) == request.get_span_context().span_id
    assert attempt.context is not None
    assert attempt.context.trace_id == request.get_span_context().trace_id
    assert attempt.kind == trace.SpanKind.CONSUMER
    # with the run's identity
    assert attempt.attributes is not None
    assert dict(attempt.attributes) == {
        "kumiko.job": job,
        "kumiko.message_id": message_id,
        "kumiko.origin_id": message_id,
        "kumiko.attempt": 1,
        "kumiko.max_attempts": 1,
        "kumiko.trigger": "manual",
        "kumiko.lane": "worker",
        "kumiko.status": "completed",
    }
    # and the handler's own span is the attempt's child
    assert parent_id(inside) == span_id(attempt)


def test_each_attempt_of_a_retried_run_is_a_span_under_the_dispatching_span(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, spans: InMemorySpanExporter
) -> None:
    # Given a job that fails its first attempt
    feature = Feature(prefix)
    attempts: list[int] = []

    @feature.job("flaky", retries=1)
    def flaky(payload: dict[str, Any], ctx: JobContext) -> None:
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")

    runner = make_runner(Registry([feature]), **recorder.hooks())
    job = f"{prefix}:job:flaky"
    runner.start()
    # When it is dispatched inside a span
    with tracer.start_as_current_span("request") as request:
        runner.dispatch(job)
    recorder.wait_until(lambda r: len(r.of("complete")) == 1)
    first, second = finished(spans, job, 2)
    # Then both attempts are children of the dispatching span
    assert {parent_id(first), parent_id(second)} == {request.get_span_context().span_id}
    assert first.attributes is not None
    assert second.attributes is not None
    assert (first.attributes["kumiko.attempt"], second.attributes["kumiko.attempt"]) == (1, 2)
    # and the failed one says so, with its exception
    assert first.attributes["kumiko.status"] == "failed"
    assert first.status.status_code == trace.StatusCode.ERROR
    assert [event.name for event in first.events] == ["exception"]
    assert second.attributes["kumiko.status"] == "completed"


def test_fan_out_children_run_under_the_dispatching_span_and_link_to_their_wrapper(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, spans: InMemorySpanExporter
) -> None:
    # Given a per-tenant job and two tenants
    feature = Feature(prefix)

    @feature.job("each", per_tenant=True)
    def each(payload: dict[str, Any], ctx: JobContext) -> None: ...

    runner = make_runner(
        Registry([feature]), get_active_tenant_ids=lambda: ["a", "b"], **recorder.hooks()
    )
    job = f"{prefix}:job:each"
    runner.start()
    # When it is dispatched inside a span
    with tracer.start_as_current_span("request") as request:
        runner.dispatch(job)
    recorder.wait_until(lambda r: len(r.of("complete")) == 3)
    runs = finished(spans, job, 3)
    (wrapper,) = [s for s in runs if s.attributes and s.attributes.get("kumiko.wrapper")]
    children = [s for s in runs if s is not wrapper]
    # Then the wrapper and each child are children of the dispatching span
    request_id = request.get_span_context().span_id
    assert [parent_id(s) for s in runs] == [request_id] * 3
    # and each child links to the wrapper that enqueued it
    for child in children:
        assert [link.context.span_id for link in child.links] == [span_id(wrapper)]
        assert child.attributes is not None
        assert child.attributes["kumiko.trigger"] == "fanout"
    assert sorted(str(c.attributes and c.attributes["kumiko.tenant_id"]) for c in children) == [
        "a",
        "b",
    ]


def test_a_sequential_hand_off_links_to_its_predecessor(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, spans: InMemorySpanExporter
) -> None:
    # Given a sequential job whose first run holds the lock until released
    feature = Feature(prefix)
    release = threading.Event()

    @feature.job("hold", concurrency="sequential")
    def hold(payload: dict[str, Any], ctx: JobContext) -> None:
        assert release.wait(timeout=30)

    runner = make_runner(Registry([feature]), sequential_retry_delay_ms=100, **recorder.hooks())
    job = f"{prefix}:job:hold"
    runner.start()
    runner.dispatch(job)
    recorder.wait_until(lambda r: len(r.of("start")) == 1, what="the first run")
    # When a second dispatch (inside a span) finds the lock held and hands off
    with tracer.start_as_current_span("second request") as request:
        second = runner.dispatch(job)
    handed = [
        s
        for s in finished(spans, job, 1)
        if s.attributes and s.attributes["kumiko.message_id"] == second
    ]
    release.set()
    recorder.wait_until(lambda r: len(r.of("complete")) == 2, what="both runs")
    # Then the delivery that handed off is a span that says so, under the second request
    (handoff,) = handed
    assert handoff.attributes is not None
    assert handoff.attributes["kumiko.status"] == "handed_off"
    assert parent_id(handoff) == request.get_span_context().span_id
    # and every later delivery of that work stays under the request, linked to the one before
    later = [
        s
        for s in finished(spans, job, 3)
        if s.attributes and s.attributes["kumiko.origin_id"] == second and s is not handoff
    ]
    assert later
    for span in later:
        assert parent_id(span) == request.get_span_context().span_id
        assert len(span.links) == 1
    first_link = min(later, key=lambda s: s.start_time or 0).links[0]
    assert first_link.context.span_id == span_id(handoff)


def test_a_dispatch_outside_any_span_carries_no_context_and_runs_in_a_root_span(
    make_runner: RunnerFactory,
    recorder: Recorder,
    redis_client: redis.Redis,
    prefix: str,
    spans: InMemorySpanExporter,
) -> None:
    feature = Feature(prefix)

    @feature.job("plain")
    def plain(payload: dict[str, Any], ctx: JobContext) -> None: ...

    runner = make_runner(Registry([feature]), **recorder.hooks())
    job = f"{prefix}:job:plain"
    runner.dispatch(job)
    (body,) = redis_client.hvals(f"dramatiq:{prefix}-worker.msgs")
    assert TRACE not in json.loads(body)["options"]
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete")) == 1)
    (attempt,) = finished(spans, job, 1)
    assert attempt.parent is None


def test_a_message_with_a_forged_trace_context_is_dead_lettered_at_fetch(
    make_runner: RunnerFactory,
    recorder: Recorder,
    redis_client: redis.Redis,
    prefix: str,
    spans: InMemorySpanExporter,
) -> None:
    # Given a message whose trace context is not what kumiko writes
    feature = Feature(prefix)

    @feature.job("work")
    def work(payload: dict[str, Any], ctx: JobContext) -> None: ...

    registry = Registry([feature])
    runner = make_runner(registry, **recorder.hooks())
    message = build_message(
        registry.jobs[f"{prefix}:job:work"], {}, queue_prefix=prefix, trigger="manual"
    )
    body = message.asdict()
    body["options"] = {**body["options"], TRACE: {"parent": {"traceparent": 7}}}
    queue = f"{prefix}-worker"
    runner.broker.do_enqueue(queue, "forged-1", json.dumps(body).encode())
    good = runner.dispatch(f"{prefix}:job:work")
    # When a worker fetches it
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete")) == 1, what="the good message")
    # Then it never ran and sits in the dead letters
    wait_for(lambda: redis_client.zcard(f"dramatiq:{queue}.XQ") == 1, what="the dead letter")
    assert [e.message_id for e in recorder.of("start")] == [good]


def test_without_opentelemetry_nothing_is_imported_and_messages_are_unchanged(
    redis_url: str, prefix: str
) -> None:
    # Given opentelemetry missing, When a runner dispatches and runs a job
    code = (
        "import json, sys, time\n"
        "sys.modules['opentelemetry'] = None\n"
        "from kumiko_dramatiq import JobRunner\n"
        "from tests.apps.metrics_app import registry\n"
        f"r = JobRunner(registry, redis_url={redis_url!r}, queue_prefix={prefix!r})\n"
        "r.dispatch('metered:job:ok')\n"
        f"(body,) = r.broker.client.hvals('dramatiq:{prefix}-worker.msgs')\n"
        "print(sorted(json.loads(body)['options']))\n"
        "r.start()\n"
        "while not r.runs('metered:job:ok', status='completed'):\n    time.sleep(0.02)\n"
        "r.stop()\n"
        "print(sorted(m for m, v in sys.modules.items() if m.startswith('opentelemetry') and v))\n"
        "print([type(m).__name__ for m in r.broker.middleware])\n"
    )
    options, modules, chain = python_prints(code)
    # Then the message has no trace key, nothing was imported, no Tracing middleware ran
    assert TRACE not in options
    assert modules == "[]"
    assert "Tracing" not in chain


def test_without_a_tracer_provider_a_carried_trace_still_propagates_and_none_is_made_up(
    redis_url: str, prefix: str
) -> None:
    # Given opentelemetry-api with no tracer provider set (a fresh process), a job that
    # dispatches another from its handler, and a middleware noting what those carry
    code = (
        "import json\n"
        "from dramatiq.middleware import Middleware\n"
        "from opentelemetry import trace\n"
        "from kumiko_dramatiq import Feature, JobRunner, Registry\n"
        "feature = Feature('relay')\n"
        "@feature.job('first')\n"
        "def first(payload, ctx):\n"
        "    r.dispatch('relay:job:leaf', {'of': payload['n']})\n"
        "@feature.job('leaf')\n"
        "def leaf(payload, ctx):\n"
        "    pass\n"
        "seen = {}\n"
        "class Note(Middleware):\n"
        "    def before_process_message(self, broker, message):\n"
        "        if message.actor_name == 'relay:job:leaf':\n"
        "            seen[message.args[0]['of']] = message.options.get('kumiko_trace')\n"
        f"r = JobRunner(Registry([feature]), redis_url={redis_url!r}, queue_prefix={prefix!r})\n"
        "r.broker.add_middleware(Note())\n"
        "remote = trace.SpanContext(0x1234, 0x5678, is_remote=True,"
        " trace_flags=trace.TraceFlags(1))\n"
        # When one run is dispatched under a (remote) span and one outside any span
        "with trace.use_span(trace.NonRecordingSpan(remote)):\n"
        "    r.dispatch('relay:job:first', {'n': 'traced'})\n"
        "r.dispatch('relay:job:first', {'n': 'plain'})\n"
        "r.start()\n"
        "r.drain(timeout_s=30)\n"
        "r.stop()\n"
        "print(json.dumps(seen, sort_keys=True))\n"
        "print(isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider))\n"
    )
    seen_line, proxy = python_prints(code)
    seen = json.loads(seen_line)
    # Then no provider was set, the traced run's child carries the same trace on, and the
    # other run's child carries none
    assert proxy == "True"
    assert seen["plain"] is None
    traceparent = seen["traced"]["parent"]["traceparent"]
    assert traceparent.split("-")[1] == f"{0x1234:032x}"
