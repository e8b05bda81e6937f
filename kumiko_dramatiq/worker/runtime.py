"""The state one runner shares with its middleware and actors.

A :class:`Runtime` belongs to exactly one broker (one ``JobRunner``); there is no
module-level state, so runners with different prefixes coexist in one process. Middleware
reads a delivery's state from the delivery itself
(:func:`~kumiko_dramatiq.worker.execution.execution_of`); the actor body, which Dramatiq
calls with the payload only, finds the execution of its thread through
:meth:`Runtime.current`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kumiko_dramatiq.broker.broker import KumikoBroker
from kumiko_dramatiq.broker.delivery import Delivery
from kumiko_dramatiq.context import JobContext, JobMeta
from kumiko_dramatiq.registry import JobDefinition, Registry
from kumiko_dramatiq.settings import Settings
from kumiko_dramatiq.worker.execution import Execution, execution_of
from kumiko_dramatiq.worker.fencing import Fence, HoldLost
from kumiko_dramatiq.worker.loop import EventLoopThread
from kumiko_dramatiq.worker.progress import ProgressReport, ProgressWriter
from kumiko_dramatiq.worker.stops import StopWatch
from kumiko_dramatiq.worker.supervision import Deferred
from kumiko_dramatiq.workflows.batches import Batches, BatchHandle

logger = logging.getLogger("kumiko_dramatiq")

StartHook = Callable[[str, str, JobMeta], Any]
FailedHook = Callable[[str, str, JobMeta, BaseException], Any]
TenantResolver = Callable[[], Any]


@dataclass
class HookSet:
    """The runner's hook callbacks (any may be ``None``)."""

    on_job_start: StartHook | None = None
    on_job_complete: StartHook | None = None
    on_job_failed: FailedHook | None = None


class Runtime:
    """Everything a runner's middleware and actors need, owned by one runner."""

    def __init__(
        self,
        *,
        registry: Registry,
        settings: Settings,
        app: Any,
        hooks: HookSet,
        get_active_tenant_ids: TenantResolver | None,
    ) -> None:
        self.registry = registry
        self.settings = settings
        self.app = app
        self.hooks = hooks
        self.get_active_tenant_ids = get_active_tenant_ids
        self.loop = EventLoopThread(settings.queue_prefix)
        #: the watchdog of the runs that hold leases (its thread starts on first use)
        self.fence = Fence(settings.queue_prefix)
        #: bookkeeping writes Redis did not take, retried until they land (its thread
        #: starts on first use)
        self.deferred = Deferred(settings.queue_prefix)
        self.broker: KumikoBroker
        #: brings ``stop_run`` requests to the runs (its thread starts on first use)
        self.stops: StopWatch
        #: writes the runs' ``ctx.progress`` (its thread starts on first use)
        self.progress: ProgressWriter

    def attach(self, broker: KumikoBroker) -> None:
        """Bind the runtime to the broker it serves (once, at construction)."""
        self.broker = broker
        self.stops = StopWatch(broker.client, self.settings.queue_prefix)
        self.progress = ProgressWriter(
            broker.client, self.settings.queue_prefix, broker.worker_identity
        )
        broker.holds.enforce = self._enforce_hold

    def _enforce_hold(self, delivery: Delivery, end_at: float | None) -> None:
        """Interrupt a run started from a hold that must not go on
        (:data:`~kumiko_dramatiq.broker.holds.Enforce`): at once, and through the fence when
        its process must end at ``end_at`` if the run cannot be interrupted."""
        execution = execution_of(delivery)
        if execution is None:
            return
        if end_at is None:
            execution.interruptible.interrupt(HoldLost)
            return
        self.fence.guard(
            f"hold:{delivery.redis_message_id}",
            execution.interruptible,
            interrupt_at=time.monotonic(),
            end_at=end_at,
            what=f"{execution.job.qualified_name} {execution.message_id} (started from a hold)",
            exception=HoldLost,
        )

    @property
    def queue_prefix(self) -> str:
        return self.settings.queue_prefix

    @property
    def lane(self) -> str:
        return self.settings.lane

    @property
    def queue_name(self) -> str:
        """The queue this runner consumes."""
        return self.settings.queue_name

    def current(self) -> Execution | None:
        """The execution the calling worker thread runs now, if any."""
        return execution_of(self.broker.current())

    def call_handler(self, job: JobDefinition, payload: Any, ctx: JobContext) -> Any:
        """Run ``job``'s handler with ``payload`` (the dict, or a typed job's model instance)."""
        if job.is_async:
            return self.loop.run(job.handler(payload, ctx))
        return job.handler(payload, ctx)

    def resolve_tenants(self) -> Iterable[Any]:
        resolver = self.get_active_tenant_ids
        if resolver is None:
            raise RuntimeError("get_active_tenant_ids is not set")
        result = resolver()
        if hasattr(result, "__await__"):
            result = self.loop.run(_await(result))
        return result  # type: ignore[no-any-return]

    def call_hook(self, name: str, *args: Any) -> None:
        """Call hook ``name`` if set; a failing hook is logged, never raised."""
        hook = getattr(self.hooks, name)
        if hook is None:
            return
        try:
            hook(*args)
        except Exception:
            logger.exception("hook %s raised for job %s (message %s)", name, args[0], args[1])

    def context_for(self, execution: Execution) -> JobContext:
        options = execution.options
        batch_id = options.batch or options.batch_callback
        batch = previous = None
        if batch_id is not None:
            batch = BatchHandle(self.batches, batch_id, execution.origin_id)
            if options.batch is not None and "." in options.batch:  # a chain step's child
                step = options.batch
                previous = functools.partial(self.batches.previous_result, step)
        return JobContext(
            job_name=execution.job.qualified_name,
            message_id=execution.message_id,
            meta=execution.meta,
            app=self.app,
            stop_event=execution.stop,
            _progress=self._progress_of(execution),
            batch=batch,
            previous_reader=previous,
        )

    def _progress_of(self, execution: Execution) -> ProgressReport:
        """A new progress report for ``execution``'s handler call, kept on it (the actor
        body closes it)."""
        execution.progress = self.progress.open(execution.message_id, execution.meta.attempt)
        return execution.progress

    @functools.cached_property
    def batches(self) -> Batches:
        """The batch and chain records (``ctx.batch``, ``ctx.previous_result``)."""
        return Batches(self.broker, self.registry, self.settings)


async def _await(awaitable: Any) -> Any:
    return await awaitable
