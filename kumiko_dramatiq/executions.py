"""Executions: what a kumiko message must be, and the ``Execution`` of each delivery.

:func:`check_message` is the broker's ``message_check``: at fetch, before Dramatiq's worker
sees a message of one of the runner's actors, it decodes its kumiko options strictly
(:meth:`~kumiko_dramatiq.codec.KumikoOptions.decode`) and checks its shape (exactly one
positional argument, a JSON object; no keyword arguments). Anything kumiko did not write is
dead-lettered by the consumer with a logged reason: never run, never silently acked, never
left to come back. Messages of actors kumiko did not declare pass untouched.

:class:`Executions` opens each delivery's :class:`~kumiko_dramatiq.execution.Execution` from
those decoded options in ``before_process_message``. Touches no Redis key. First of kumiko's
message middleware, so its ``after_*`` runs last, when it closes the execution of the worker
thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NoReturn

from dramatiq.broker import Broker, MessageProxy
from dramatiq.message import Message
from dramatiq.middleware import Middleware, SkipMessage

from .broker import Delivery
from .codec import KumikoOptions, OptionsError
from .execution import Execution
from .registry import Registry
from .runtime import Runtime

logger = logging.getLogger("kumiko_dramatiq")


def check_message(registry: Registry, message: Message[Any]) -> tuple[str | None, object]:
    """Why ``message`` must be dead-lettered (``None``: fine) and its decoded options."""
    if registry.actor(message.actor_name) is None:
        return None, None
    try:
        options = KumikoOptions.decode(message.options)
    except OptionsError as exc:
        return f"{message.actor_name}: unreadable options ({exc})", None
    problem = _shape_problem(message.args, message.kwargs)
    if problem is not None:
        return f"{message.actor_name}: {problem}", None
    return None, options


class KumikoMessages:
    """The broker's :class:`~kumiko_dramatiq.broker.MessagePolicy` for a runner's actors:
    :func:`check_message` at fetch, and ``rejected`` (the dedup key of a message
    dead-lettered there is freed)."""

    def __init__(self, registry: Registry, rejected: Callable[[Message[Any]], None]) -> None:
        self.registry = registry
        self._rejected = rejected

    def check(self, message: Message[Any]) -> tuple[str | None, object]:
        return check_message(self.registry, message)

    def rejected(self, message: Message[Any]) -> None:
        self._rejected(message)


class Executions(Middleware):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        found = self.runtime.registry.actor(message.actor_name)
        if found is None or not isinstance(message, Delivery):
            return
        job, is_wrapper = found
        options = message.decoded
        if not isinstance(options, KumikoOptions):  # not fetched by kumiko's consumer
            problem, options = check_message(self.runtime.registry, message.message)
            if not isinstance(options, KumikoOptions):
                self._reject(message, str(problem))
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


def _shape_problem(args: Any, kwargs: Any) -> str | None:
    if kwargs:
        return f"unexpected keyword arguments {sorted(kwargs)!r}"
    if len(args) != 1 or not isinstance(args[0], dict):
        kinds = ", ".join(type(arg).__name__ for arg in args) if isinstance(args, list) else "?"
        return f"expected one JSON object argument, got ({kinds})"
    return None
