"""The state one runner shares with its middleware and actors.

A :class:`Runtime` belongs to exactly one broker (one ``JobRunner``); there
is no module-level state, so runners with different prefixes coexist in one
process. The middleware that opens a delivery (:class:`~.middleware.execution.Executions`)
stores an :class:`Execution` in a thread-local; the other middleware and the
actor body read it from there (a worker thread runs one message at a time).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dramatiq.broker import MessageProxy

from .context import JobContext, JobMeta
from .loop import EventLoopThread
from .messages import meta_from_options, wrapper_actor_name
from .options import Retention
from .registry import JobDefinition, Registry

if TYPE_CHECKING:
    from .broker import KumikoBroker

logger = logging.getLogger("kumiko_dramatiq")

StartHook = Callable[[str, str, JobMeta], Any]
FailedHook = Callable[[str, str, JobMeta, BaseException], Any]
TenantResolver = Callable[[], Any]


@dataclass
class Execution:
    """One delivery of one kumiko message on a worker thread."""

    job: JobDefinition
    message: MessageProxy
    meta: JobMeta
    is_wrapper: bool
    #: A sequential run found its lock held and handed off to a new message:
    #: the actor body does nothing, no hook runs and no attempt is spent.
    handed_off: bool = False
    #: Per-middleware scratch space (lock tokens and the like).
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def message_id(self) -> str:
        return str(self.message.message_id)


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
        queue_prefix: str,
        lane: str,
        app: Any,
        hooks: HookSet,
        retention: Retention,
        get_active_tenant_ids: TenantResolver | None,
        sequential_retry_delay_ms: int,
    ) -> None:
        self.registry = registry
        self.queue_prefix = queue_prefix
        self.lane = lane
        self.app = app
        self.hooks = hooks
        self.retention = retention
        self.get_active_tenant_ids = get_active_tenant_ids
        self.sequential_retry_delay_ms = sequential_retry_delay_ms
        self.loop = EventLoopThread(queue_prefix)
        self._local = threading.local()
        self.broker: KumikoBroker
        self._actors: dict[str, tuple[JobDefinition, bool]] = {}
        for job in registry.jobs.values():
            self._actors[job.qualified_name] = (job, False)
            if job.options.per_tenant:
                self._actors[wrapper_actor_name(job)] = (job, True)

    def attach(self, broker: KumikoBroker) -> None:
        """Bind the runtime to the broker it serves (once, at construction)."""
        self.broker = broker

    @property
    def queue_name(self) -> str:
        """The queue this runner consumes."""
        return f"{self.queue_prefix}-{self.lane}"

    # -- executions -----------------------------------------------------
    def begin(self, message: MessageProxy) -> Execution | None:
        """Open the execution of ``message``; ``None`` for a foreign actor."""
        found = self._actors.get(message.actor_name)
        if found is None:
            return None
        job, is_wrapper = found
        execution = Execution(job, message, meta_from_options(message.options), is_wrapper)
        self._local.execution = execution
        return execution

    def current(self) -> Execution | None:
        return getattr(self._local, "execution", None)

    def end(self) -> None:
        self._local.execution = None

    # -- calling user code ----------------------------------------------
    def call_handler(self, job: JobDefinition, payload: dict[str, Any], ctx: JobContext) -> Any:
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
        return JobContext(
            job_name=execution.job.qualified_name,
            message_id=execution.message_id,
            meta=execution.meta,
            app=self.app,
        )


async def _await(awaitable: Any) -> Any:
    return await awaitable
