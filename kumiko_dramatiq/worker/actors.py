"""The Dramatiq actors of a runner: one per job, plus a wrapper per per-tenant job.

An actor body is thin: it reads the delivery's ``Execution`` (opened at fetch by the
broker's message policy, :mod:`kumiko_dramatiq.worker.execution`), builds the
``JobContext`` and calls the handler, or,
for a wrapper, fans out (:mod:`kumiko_dramatiq.worker.fanout`), through the execution's
:class:`~kumiko_dramatiq.worker.interrupts.Interruptible` (so a fence or a stop can interrupt
exactly the handler, never the middleware around it). Retries, locks, hooks and timeouts live
in middleware.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dramatiq import Actor

from kumiko_dramatiq.broker.broker import KumikoBroker
from kumiko_dramatiq.middleware.timeouts import check_elapsed
from kumiko_dramatiq.registry import JobDefinition
from kumiko_dramatiq.worker.fanout import fan_out
from kumiko_dramatiq.worker.fencing import LeaseLost
from kumiko_dramatiq.worker.logs import hide_arguments
from kumiko_dramatiq.worker.runtime import Runtime


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
            # a fenced run (LeaseLost) is logged by the fence, not again as an unhandled error
            options={"time_limit": time_limit, "throws": (LeaseLost,)},
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
                options={"time_limit": float("inf")},
            )
            if not runtime.settings.log_payloads:
                hide_arguments(wrapper.logger)


def _job_body(runtime: Runtime, job: JobDefinition) -> Callable[[dict[str, Any]], None]:
    def run(payload: dict[str, Any]) -> None:
        execution = runtime.current()
        if execution is None or execution.handed_off:
            return
        started = time.monotonic()
        context = runtime.context_for(execution)
        execution.interruptible.run(lambda: runtime.call_handler(job, payload, context))
        check_elapsed(job, started)

    run.__name__ = run.__qualname__ = job.qualified_name
    return run


def _wrapper_body(runtime: Runtime, job: JobDefinition) -> Callable[[dict[str, Any]], None]:
    def wrapper(payload: dict[str, Any]) -> None:
        execution = runtime.current()
        if execution is None or execution.handed_off:
            return
        execution.interruptible.run(lambda: fan_out(runtime, execution, payload))

    wrapper.__name__ = wrapper.__qualname__ = job.wrapper_actor_name
    return wrapper
