"""``Executions``: opens and closes the :class:`~kumiko_dramatiq.runtime.Execution` of a delivery.

``before_process_message`` reads the kumiko options of the message
(``kumiko_failures``, ``kumiko_retries``, ``kumiko_trigger``,
``kumiko_tenant_id``...) into a ``JobMeta`` and checks the message's shape: a
kumiko message carries exactly one positional argument, a JSON object. A
malformed message (wrong arguments, unreadable options) is dead-lettered with
a logged reason and never reaches the handler; the worker goes on. Messages
of actors kumiko did not declare pass through untouched. Touches no Redis
key. First of kumiko's message middleware, so its ``after_*`` runs last.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Middleware, SkipMessage

from ..runtime import Runtime

logger = logging.getLogger("kumiko_dramatiq")


class Executions(Middleware):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        try:
            execution = self.runtime.begin(message)
        except Exception as exc:  # unreadable kumiko options
            self._reject(message, f"unreadable options ({type(exc).__name__}: {exc})")
        if execution is None:
            return
        problem = _shape_problem(message)
        if problem is not None:
            self.runtime.end()
            self._reject(message, problem)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        execution = self.runtime.current()
        if exception is None and execution is not None and not execution.handed_off:
            # Read by the broker's consumer: the ack also marks the id completed.
            message.kumiko_completed = True  # type: ignore[attr-defined]
        self.runtime.end()

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self.runtime.end()

    @staticmethod
    def _reject(message: MessageProxy, reason: str) -> NoReturn:
        logger.error(
            "dead-lettering malformed message %s for %s: %s",
            message.message_id,
            message.actor_name,
            reason,
        )
        message.fail()
        raise SkipMessage(reason)


def _shape_problem(message: MessageProxy) -> str | None:
    args, kwargs = message.args, message.kwargs
    if kwargs:
        return f"unexpected keyword arguments {sorted(kwargs)!r}"
    if len(args) != 1 or not isinstance(args[0], dict):
        return f"expected one JSON object argument, got {args!r:.80}"
    return None
