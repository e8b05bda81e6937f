"""``Hooks``: calls ``on_job_start``, ``on_job_complete`` and ``on_job_failed``.

Called in the worker for every attempt (per-tenant wrappers too, under the job's qualified
name with ``tenant_id=None``); ``on_job_failed`` on every failed attempt, timeouts included,
with ``meta.final_attempt``. A sequential hand-off calls none of them; a run fenced because its
lease could not be renewed calls ``on_job_start`` only (it spent no attempt and runs again, like a
run cut short by a crash). A hook that raises is
logged and ignored. Placed just before ``TimeLimit``: ``on_job_start`` runs after the lock is
taken, and the after-hooks run before the lock is released and the retry is prepared, so
hooks of one message id never interleave. Touches no Redis key.
"""

from __future__ import annotations

from typing import Any

from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Middleware

from kumiko_dramatiq.worker.execution import execution_of
from kumiko_dramatiq.worker.runtime import Runtime


class Hooks(Middleware):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        execution = execution_of(message)
        if execution is None or execution.handed_off:
            return
        self.runtime.call_hook(
            "on_job_start", execution.job.qualified_name, execution.message_id, execution.meta
        )

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        execution = execution_of(message)
        if execution is None or execution.handed_off or execution.fenced or execution.stopped:
            return  # a stopped run neither completed nor failed
        name, message_id, meta = execution.job.qualified_name, execution.message_id, execution.meta
        if exception is None:
            self.runtime.call_hook("on_job_complete", name, message_id, meta)
        else:
            self.runtime.call_hook("on_job_failed", name, message_id, meta, exception)
