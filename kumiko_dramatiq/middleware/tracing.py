"""OpenTelemetry tracing: the dispatching span travels in the message; each attempt is a span.

Active when ``opentelemetry-api`` is installed (``pip install 'kumiko_dramatiq[tracing]'``;
an SDK and an exporter are the application's choice, as always with OpenTelemetry). Without
it, :func:`tracing_middleware` returns nothing, no module of it is imported and messages are
exactly as before.

Producer side (``before_enqueue``, on the thread that enqueues)
    A kumiko message without ``kumiko_trace`` gets one (:func:`~kumiko_dramatiq.codec.encode_trace`,
    written with the global propagator, W3C trace context by default):

    - enqueued while a span is active (``dispatch``, ``handle_event``, ``dispatch_many`` under
      the application's span, a job dispatching another): ``parent`` = that span;
    - a per-tenant child or a sequential hand-off (it carries ``kumiko_origin_id``), enqueued
      by the attempt that runs on this thread: ``parent`` = that attempt's own parent (so every
      run of one dispatch shares its trace) and ``link`` = that attempt's span;
    - a retry without a parent: ``link`` = the failed attempt's span.

    A message that carries one keeps it: a retry (a copy of its message) or a delayed message
    moved to its queue. No active span and no attempt: nothing is written.

Worker side (``before_process_message`` .. ``after_process_message``/``after_skip_message``)
    Every delivery of a kumiko message runs in a span named after the job (kind ``CONSUMER``;
    none while no tracer provider is set and the message carries no trace: that span would
    be invalid and propagate nothing, so the attempt skips it)
    whose parent is ``parent`` (none: a root span) and which links to ``link``, made current
    on the worker thread for the handler, the hooks and what they enqueue. Attributes:
    ``kumiko.job``, ``kumiko.message_id``, ``kumiko.origin_id``, ``kumiko.attempt``,
    ``kumiko.max_attempts``, ``kumiko.trigger``, ``kumiko.lane``, ``kumiko.tenant_id`` (when
    set), ``kumiko.wrapper`` (a per-tenant wrapper); at the end ``kumiko.status`` (the run
    record's status, or ``handed_off`` with ``kumiko.handoff_id``) and, for a failed attempt,
    the exception and an ERROR status. (An ``async def`` handler runs on the runner's event
    loop thread, outside this context: spans it starts are not children of the attempt's.)

Place in the chain: right after ``Boot`` (and ``Metrics``), before ``History``: its
before-hook opens the span before ``Sequential`` may hand off and before the hooks run; its
after-hook closes it after every later middleware's after-hook (retries, dedup follow-ups)
and History's status. Reads ``kumiko_trace`` and ``kumiko_origin_id``; writes ``kumiko_trace``;
touches no Redis key.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from dramatiq.broker import Broker, MessageProxy
from dramatiq.message import Message
from dramatiq.middleware import Middleware

from kumiko_dramatiq.broker.delivery import Delivery
from kumiko_dramatiq.codec import ORIGIN_ID, TRACE, TRIGGER, encode_trace
from kumiko_dramatiq.middleware.retries import describe_error
from kumiko_dramatiq.worker.execution import Execution, execution_of
from kumiko_dramatiq.worker.runtime import Runtime

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, SpanContext

#: The instrumentation scope of kumiko's spans.
TRACER_NAME = "kumiko_dramatiq"


@dataclass(frozen=True)
class OpenTelemetry:
    """The parts of ``opentelemetry-api`` kumiko uses."""

    trace: ModuleType
    context: ModuleType
    propagate: ModuleType


def load_opentelemetry() -> OpenTelemetry | None:
    """``opentelemetry-api``'s modules, or ``None`` when it is not installed."""
    try:
        return OpenTelemetry(
            trace=importlib.import_module("opentelemetry.trace"),
            context=importlib.import_module("opentelemetry.context"),
            propagate=importlib.import_module("opentelemetry.propagate"),
        )
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "opentelemetry":
            return None
        raise


def tracing_middleware(runtime: Runtime) -> list[Middleware]:
    """``[Tracing]`` when ``opentelemetry-api`` is installed, else ``[]``."""
    api = load_opentelemetry()
    return [] if api is None else [Tracing(runtime, api)]


@dataclass
class _Attempt:
    """The span of the delivery this worker thread runs."""

    message_id: str
    span: Span
    token: object
    parent: Mapping[str, str] | None


class Tracing(Middleware):
    """Carries the trace context in kumiko's messages and runs each attempt in a span (see
    the module docs)."""

    def __init__(self, runtime: Runtime, api: OpenTelemetry) -> None:
        self.runtime = runtime
        self.api = api
        self.tracer = api.trace.get_tracer(TRACER_NAME)
        self._local = threading.local()

    # -- producer ----------------------------------------------------------------------------
    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        options = message.options
        if TRACE in options or TRIGGER not in options:
            return  # keeps its context (a retry, a move), or not a kumiko message
        attempt: _Attempt | None = getattr(self._local, "attempt", None)
        if attempt is not None and (
            ORIGIN_ID in options or str(message.message_id) == attempt.message_id
        ):
            link = self._carrier(self.api.trace.set_span_in_context(attempt.span))
            options.update(encode_trace(attempt.parent, link))
            return
        if not self.api.trace.get_current_span().get_span_context().is_valid:
            return
        options.update(encode_trace(self._carrier(None), None))

    # -- worker ------------------------------------------------------------------------------
    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        execution = execution_of(message)
        if execution is None:
            return
        carried = execution.options.trace
        if carried is None and self._no_sdk():
            # nothing to carry on and no SDK to record: the span would be invalid, nothing
            # would propagate from it (what the handler enqueues gets no trace either way)
            return
        parent = None if carried is None else carried.parent
        link = None if carried is None else carried.link
        trace = self.api.trace
        context: Context = (
            self.api.propagate.extract(parent) if parent else self.api.context.Context()
        )
        links = []
        if link:
            linked: SpanContext = trace.get_current_span(
                self.api.propagate.extract(link)
            ).get_span_context()
            if linked.is_valid:
                links.append(trace.Link(linked))
        span = self.tracer.start_span(
            execution.job.qualified_name,
            context=context,
            kind=trace.SpanKind.CONSUMER,
            links=links,
            attributes=self._attributes(execution),
        )
        token = self.api.context.attach(trace.set_span_in_context(span, context))
        self._local.attempt = _Attempt(execution.message_id, span, token, parent)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        self._end(message, exception)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self._end(message, None)

    # -- internals ---------------------------------------------------------------------------
    def _end(self, message: MessageProxy, exception: BaseException | None) -> None:
        attempt: _Attempt | None = getattr(self._local, "attempt", None)
        if attempt is None:
            return
        self._local.attempt = None
        span = attempt.span
        try:
            execution = execution_of(message)
            if execution is not None and execution.handed_off:
                span.set_attribute("kumiko.status", "handed_off")
                span.set_attribute("kumiko.handoff_id", str(execution.handoff_id))
            elif execution is not None and execution.fenced:
                span.set_attribute("kumiko.status", "fenced")
            elif isinstance(message, Delivery) and message.settlement.run is not None:
                span.set_attribute("kumiko.status", message.settlement.run.status)
            if exception is not None:
                span.record_exception(exception)
                span.set_status(self.api.trace.Status(
                    self.api.trace.StatusCode.ERROR, describe_error(exception)
                ))  # fmt: skip
            span.end()
        finally:
            self.api.context.detach(attempt.token)

    def _no_sdk(self) -> bool:
        """Whether no tracer provider was set (the API's placeholder is the global one): asked
        per message, so a provider set after the runner was built counts at once."""
        trace = self.api.trace
        return isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)

    def _carrier(self, context: Context | None) -> dict[str, str]:
        carrier: dict[str, str] = {}
        self.api.propagate.inject(carrier, context=context)
        return carrier

    def _attributes(self, execution: Execution) -> dict[str, Any]:
        meta = execution.meta
        attributes: dict[str, Any] = {
            "kumiko.job": execution.job.qualified_name,
            "kumiko.message_id": execution.message_id,
            "kumiko.origin_id": execution.origin_id,
            "kumiko.attempt": meta.attempt,
            "kumiko.max_attempts": meta.max_attempts,
            "kumiko.trigger": meta.trigger,
            "kumiko.lane": self.runtime.lane,
        }
        if meta.tenant_id is not None:
            attributes["kumiko.tenant_id"] = meta.tenant_id
        if execution.is_wrapper:
            attributes["kumiko.wrapper"] = True
        return attributes
