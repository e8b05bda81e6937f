"""The Dramatiq actors of a runner: one per job, plus a wrapper per per-tenant job.

An actor body is thin: it reads the delivery's ``Execution`` (opened at fetch by the
broker's message policy, :mod:`kumiko_dramatiq.worker.execution`), builds the
``JobContext`` and calls the handler, or,
for a wrapper, fans out (:mod:`kumiko_dramatiq.worker.fanout`), through the execution's
:class:`~kumiko_dramatiq.worker.interrupts.Interruptible` (so a fence or a stop can interrupt
exactly the handler, never the middleware around it). Retries, locks, hooks and timeouts live
in middleware.

A typed job's body first validates the queued payload against the job's model
(:func:`~kumiko_dramatiq.payloads.load_payload`; the handler receives the instance, a
wrapper fans out its ``model_dump(mode="json")``). A payload that no longer validates
fails the attempt with that ``PayloadError`` (the bad value in it only with
``record_payloads``: the error goes to the run record) and marks it ``no_retry``
(:meth:`~kumiko_dramatiq.worker.execution.Execution.no_retry`): it is dead-lettered at
once, its run record and dead letter carrying the error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from dramatiq import Actor

from kumiko_dramatiq.broker.broker import KumikoBroker
from kumiko_dramatiq.errors import PayloadError
from kumiko_dramatiq.middleware.timeouts import check_elapsed
from kumiko_dramatiq.payloads import STALE_NOTE, load_payload, payload_to_enqueue
from kumiko_dramatiq.registry import JobDefinition
from kumiko_dramatiq.worker.execution import Execution
from kumiko_dramatiq.worker.fanout import fan_out
from kumiko_dramatiq.worker.fencing import LeaseLost
from kumiko_dramatiq.worker.logs import hide_arguments
from kumiko_dramatiq.worker.runtime import Runtime
from kumiko_dramatiq.worker.stops import StopRequested
from kumiko_dramatiq.workflows.results import encode_result


def declare_actors(broker: KumikoBroker, runtime: Runtime) -> None:
    """Declare every job of ``runtime.registry`` on ``broker``."""
    for job in runtime.registry.jobs.values():
        queue = job.queue_name(runtime.queue_prefix)
        time_limit = float("inf") if job.options.timeout_ms is None else job.options.timeout_ms
        actor = Actor(
            _job_body(runtime, job),
            broker=broker,
            actor_name=job.qualified_name,
            queue_name=queue,
            priority=0,
            # a fenced run (LeaseLost) is logged by the fence, a stopped one (StopRequested)
            # by the stop watch, not again as an unhandled error
            options={"time_limit": time_limit, "throws": (LeaseLost, StopRequested)},
        )
        if not runtime.settings.log_payloads:
            hide_arguments(actor.logger)
        if job.options.per_tenant:
            wrapper = Actor(
                _wrapper_body(runtime, job),
                broker=broker,
                actor_name=job.wrapper_actor_name,
                queue_name=queue,
                priority=0,
                options={"time_limit": float("inf"), "throws": (StopRequested,)},
            )
            if not runtime.settings.log_payloads:
                hide_arguments(wrapper.logger)


def _job_body(runtime: Runtime, job: JobDefinition) -> Callable[[dict[str, Any]], None]:
    show_value = runtime.settings.record_payloads
    keeps_result = job.options.keep_result_s is not None
    max_result_bytes = runtime.settings.max_result_bytes

    def run(payload: dict[str, Any]) -> None:
        execution = runtime.current()
        if execution is None or execution.handed_off:
            return
        started = time.monotonic()
        argument = payload
        if job.payload_model is not None:
            with _refusing_stale(execution):
                argument = load_payload(job, payload, note=STALE_NOTE, show_value=show_value)
        context = runtime.context_for(execution)
        with _stoppable(runtime, execution), _reporting(execution):
            value = execution.interruptible.run(
                lambda: runtime.call_handler(job, argument, context)
            )
        check_elapsed(job, started)
        if keeps_result or execution.options.batch is not None:  # a batch child's goes to it
            execution.result = encode_result(job, value, max_bytes=max_result_bytes)

    run.__name__ = run.__qualname__ = job.qualified_name
    return run


def _wrapper_body(runtime: Runtime, job: JobDefinition) -> Callable[[dict[str, Any]], None]:
    show_value = runtime.settings.record_payloads

    def wrapper(payload: dict[str, Any]) -> None:
        execution = runtime.current()
        if execution is None or execution.handed_off:
            return
        if job.payload_model is not None:
            # The children get the model's dump of what validates now: the same model.
            with _refusing_stale(execution):
                payload = payload_to_enqueue(
                    job,
                    load_payload(job, payload, note=STALE_NOTE, show_value=show_value),
                    max_bytes=runtime.settings.max_payload_bytes,
                )
        with _stoppable(runtime, execution):
            execution.interruptible.run(lambda: fan_out(runtime, execution, payload))

    wrapper.__name__ = wrapper.__qualname__ = job.wrapper_actor_name
    return wrapper


@contextmanager
def _refusing_stale(execution: Execution) -> Iterator[None]:
    """A ``PayloadError`` raised inside ends the message: no retry can fix a payload."""
    try:
        yield
    except PayloadError:
        execution.no_retry()
        raise


@contextmanager
def _reporting(execution: Execution) -> Iterator[None]:
    """The handler call inside may report progress; its end drops it
    (:mod:`kumiko_dramatiq.worker.progress`)."""
    try:
        yield
    finally:
        if execution.progress is not None:
            execution.progress.close()


@contextmanager
def _stoppable(runtime: Runtime, execution: Execution) -> Iterator[None]:
    """The handler call inside may be stopped by ``runner.stop_run``
    (:mod:`kumiko_dramatiq.worker.stops`); a stopped attempt is its message's last."""
    runtime.stops.watch(execution)
    try:
        yield
    finally:
        runtime.stops.forget(execution)
        if execution.stopped:
            execution.no_retry()
