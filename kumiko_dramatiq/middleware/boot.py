"""``Boot``: boot gates, then boot-once jobs, when a worker process boots.

Runs :meth:`Boot.run` once per start, before the worker consumes anything:

1. every ``boot_gate`` job of the runner's lane (``runtime.lane``), in
   declaration order, in-process and synchronously (see
   :func:`kumiko_dramatiq.boot.run_gate`: ``retries + 1`` attempts, the job's
   backoff slept between them, ``timeout_ms`` per attempt, hooks with
   ``meta.trigger == "gate"``). The first gate that still fails raises
   :class:`~kumiko_dramatiq.errors.BootGateError` (its message includes the
   gate's own error) and nothing after it runs;
2. every ``run_on_boot`` job of the lane: the message built by
   ``build_message(job, {}, trigger="boot", message_id=ids.boot_message_id(job,
   prefix))`` (a per-tenant job's wrapper) goes through
   ``broker.enqueue_atomic`` with the :data:`~kumiko_dramatiq.boot.BOOT_ONCE`
   script: check the marker, enqueue through the id guard, set the marker, in
   one Lua call. So it is enqueued once per dataset (Redis DB + queue prefix)
   however many starts, concurrent or not, and its retries (on the fixed id)
   are the ``Retries`` middleware's like any job's.

``JobRunner.start()`` sets :attr:`Boot.driven_by_runner` and calls
:meth:`run` itself, so a failure raises from ``start()`` before its worker
exists. ``dramatiq kumiko_dramatiq.app`` reaches :meth:`run` through
``after_process_boot`` in every worker process; there a failure logs one
critical line and raises ``SystemExit(3)`` (``emit_after`` swallows only
``Exception``), which ends the process before its worker starts, and
Dramatiq's main process then stops the others and exits non-zero.

Options read: ``boot_gate``, ``run_on_boot``, ``run_in``, ``retries``,
``backoff``, ``timeout_ms``. Message options written: those of
``build_message`` with ``kumiko_trigger="boot"``. Redis keys: for each
boot-once job ``keys.boot_marker(prefix, job)`` (no TTL) and
``keys.enqueue_guard(prefix, boot id)`` (TTL ``retention.completed_age_s``),
plus the lane queue's message hash and list; gates touch none. A lane without
gates or boot-once jobs makes no Redis call. Second in the chain (after
``Lane``); it has no message hooks, so it costs deliveries nothing.
"""

from __future__ import annotations

import logging
from functools import cached_property

import redis
from dramatiq.broker import Broker
from dramatiq.middleware import Middleware
from redis.commands.core import Script

from .. import keys
from ..boot import BOOT_ONCE, boot_gates, boot_once_jobs, describe, run_gate
from ..broker import AtomicStep
from ..errors import RedisUnavailableError
from ..ids import boot_message_id
from ..messages import build_message
from ..registry import JobDefinition
from ..runtime import Runtime
from ..scripts import PRELUDE

logger = logging.getLogger("kumiko_dramatiq")

#: Exit status of a CLI worker process whose boot failed.
BOOT_FAILED_EXIT_STATUS = 3


class Boot(Middleware):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        #: Set by ``JobRunner.start()``, which runs :meth:`run` itself.
        self.driven_by_runner = False

    def after_process_boot(self, broker: Broker) -> None:
        if self.driven_by_runner:
            return
        try:
            self.run(broker)
        except Exception as exc:
            logger.critical("kumiko worker for %s did not start: %s", self.runtime.queue_name, exc)
            raise SystemExit(BOOT_FAILED_EXIT_STATUS) from exc

    def run(self, broker: Broker) -> None:
        """Run the lane's boot gates, then enqueue its boot-once jobs.

        Raises ``BootGateError`` (gates) or ``RedisUnavailableError``.
        """
        for gate in boot_gates(self.runtime.registry, self.runtime.lane):
            run_gate(self.runtime, gate)
        for job in boot_once_jobs(self.runtime.registry, self.runtime.lane):
            self._enqueue_once(job)

    def _enqueue_once(self, job: JobDefinition) -> None:
        runtime = self.runtime
        prefix = runtime.queue_prefix
        message_id = boot_message_id(job.qualified_name, prefix)
        message = build_message(job, {}, queue_prefix=prefix, trigger="boot", message_id=message_id)
        step = AtomicStep(
            self._boot_once_script,
            (keys.boot_marker(prefix, job.qualified_name), keys.enqueue_guard(prefix, message_id)),
            (runtime.retention.completed_age_s * 1000, message_id),
        )
        try:
            _, reply = runtime.broker.enqueue_atomic(message, step)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise RedisUnavailableError(
                describe(runtime.broker.client), f"enqueuing boot job {job.qualified_name}", exc
            ) from exc
        outcome = reply[1]
        if outcome == "enqueued":
            logger.info("boot job %s enqueued as %s", job.qualified_name, message_id)
        elif outcome == "guarded":
            logger.warning(
                "boot job %s: marker was missing but %s was enqueued already; marker restored",
                job.qualified_name,
                message_id,
            )
        else:
            logger.debug("boot job %s was enqueued by an earlier start", job.qualified_name)

    @cached_property
    def _boot_once_script(self) -> Script:
        return self.runtime.broker.client.register_script(PRELUDE + BOOT_ONCE)
