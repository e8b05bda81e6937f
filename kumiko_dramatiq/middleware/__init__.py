"""The middleware chain of a kumiko broker: :func:`build_middleware`, one module each.

Each middleware keeps one guarantee and says in its module docstring what it reads, writes
and touches in Redis, and where it sits in the chain. Decisions are pure functions beside
them; the Redis writes ride on the Lua calls the broker makes anyway (fetch, settle).
"""

from __future__ import annotations

from dramatiq.middleware import (
    AgeLimit,
    Callbacks,
    Middleware,
    Pipelines,
    ShutdownNotifications,
)

from kumiko_dramatiq.middleware.boot import Boot
from kumiko_dramatiq.middleware.caps import Caps
from kumiko_dramatiq.middleware.dedup import Dedup
from kumiko_dramatiq.middleware.history import History
from kumiko_dramatiq.middleware.hooks import Hooks
from kumiko_dramatiq.middleware.metrics import metrics_middleware
from kumiko_dramatiq.middleware.presence import Presence
from kumiko_dramatiq.middleware.retries import Retries
from kumiko_dramatiq.middleware.sequential import Sequential
from kumiko_dramatiq.middleware.timeouts import time_limit
from kumiko_dramatiq.middleware.tracing import tracing_middleware
from kumiko_dramatiq.worker.runtime import Runtime


def build_middleware(runtime: Runtime, dedup: Dedup, presence: Presence) -> list[Middleware]:
    """The one middleware chain of a kumiko broker, in ``before_*`` order (``after_*`` hooks
    run in reverse). It holds Dramatiq's default middleware (AgeLimit, TimeLimit,
    ShutdownNotifications, Callbacks, Pipelines, Retries), so a plain ``@dramatiq.actor`` on
    a kumiko broker behaves as on Dramatiq's ``RedisBroker``; none of them changes a kumiko
    job (kumiko's actors and messages carry none of their options, but ``time_limit``)::

        AgeLimit    Dramatiq's: skips a message older than its actor's max_age (first, as in
                    Dramatiq's order, so add_middleware(m, before=AgeLimit) puts m first)
        Boot        boot gates and boot-once jobs on process boot
        Metrics     only with metrics_port: counts runs, hand-offs, ... (.metrics)
        Tracing     only with opentelemetry-api installed: a span per attempt (.tracing)
        History     the end record of each attempt and the "already completed" marker of a
                    completed run, for the ack to write
        Callbacks   Dramatiq's: on_success / on_failure (after: once Retries decided)
        Pipelines   Dramatiq's: the next step of a pipeline, unless the message failed
        Retries     kumiko's jobs: retried on the same message id (after: runs late); any
                    other actor: Dramatiq's Retries and its options (.retries)
        Caps        the slot leases of max_running jobs (renewed and fenced while they run)
        Sequential  the lease of sequential jobs (before: acquire or hand off; after: release)
        Dedup       the life of dedup keys
        Hooks       on_job_start / on_job_complete / on_job_failed
        ShutdownNotifications  Dramatiq's: interrupts actors with notify_shutdown on shutdown
        TimeLimit   Dramatiq's, last of the message hooks: its clock covers the handler;
                    timeout_ms for kumiko's jobs, Dramatiq's 10 minutes by default for any
                    other actor; its interruptions name the kumiko run (.timeouts)
        Presence    registers the worker process as alive while it runs

    No middleware opens a delivery's state: the broker's message policy does at fetch
    (:mod:`kumiko_dramatiq.worker.execution`), and the broker keeps which delivery each
    worker thread runs and which queues a worker consumes (its lane and every non-lane
    queue: :mod:`kumiko_dramatiq.broker.broker`).

    Middleware added later (``runner.broker.add_middleware``) come after the chain; they
    never see a sequential hand-off (see :mod:`kumiko_dramatiq.broker.seam`).
    """
    return [
        AgeLimit(),
        Boot(runtime),
        *metrics_middleware(runtime),
        *tracing_middleware(runtime),
        History(runtime.settings),
        Callbacks(),
        Pipelines(),
        Retries(runtime.registry, log_payloads=runtime.settings.log_payloads),
        Caps(runtime),
        Sequential(runtime),
        dedup,
        Hooks(runtime),
        ShutdownNotifications(),
        time_limit(runtime),
        presence,
    ]
