"""``Executions``: opens the :class:`~kumiko_dramatiq.execution.Execution` of each delivery.

``before_process_message`` decodes the kumiko options of a message of one of the runner's
actors strictly (:meth:`~kumiko_dramatiq.codec.KumikoOptions.decode`) and checks its shape (a
kumiko message carries exactly one positional argument, a JSON object). A malformed message
is dead-lettered with a logged reason and never reaches the handler; the worker goes on.
Messages of actors kumiko did not declare pass through untouched. Touches no Redis key.
First of kumiko's message middleware, so its ``after_*`` runs last, when it closes the
execution of the worker thread.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Middleware, SkipMessage

from .broker import Delivery
from .codec import KumikoOptions, OptionsError
from .execution import Execution
from .runtime import Runtime

logger = logging.getLogger("kumiko_dramatiq")


class Executions(Middleware):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        found = self.runtime.registry.actor(message.actor_name)
        if found is None or not isinstance(message, Delivery):
            return
        job, is_wrapper = found
        try:
            options = KumikoOptions.decode(message.options)
        except OptionsError as exc:
            self._reject(message, f"unreadable options ({exc})")
        problem = _shape_problem(message)
        if problem is not None:
            self._reject(message, problem)
        execution = Execution(job, message, options, is_wrapper)
        message.execution = execution
        self.runtime.enter(execution)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        self.runtime.enter(None)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self.runtime.enter(None)

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
