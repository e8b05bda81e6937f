"""Guests: the middleware added to a kumiko broker after it was built, and what they see.

A kumiko broker is built with kumiko's chain (:func:`kumiko_dramatiq.runner.build_middleware`,
Dramatiq's default middleware among it). Middleware added later, such as Dramatiq's
``Prometheus``, ``Results`` or ``CurrentMessage`` or an app's own, are *guests*:
``add_middleware`` appends them after the chain, as Dramatiq appends to its defaults. Two
rules, applied by :class:`~kumiko_dramatiq.broker.KumikoBroker`:

- **a guest never sees a sequential hand-off.** A delivery whose run ``Sequential`` handed
  off to a new message (kumiko's ``Execution.handed_off``, decided in its
  ``before_process_message``) is not a processed message: it runs no handler and spends no
  attempt. So the guests get neither its ``before_process_message`` nor its
  ``after_process_message``; Dramatiq's ``Prometheus`` would otherwise count every
  hand-off as a processed message of about 0 ms (a ``SkipMessage`` would not help: it counts
  skipped messages as processed too). The message the work was handed off to is processed,
  and seen, like any other. Kumiko's chain sees every delivery. A middleware placed inside
  the chain (``add_middleware(m, before=...)`` or ``after=`` a member of the chain, or
  inserted into ``broker.middleware``) counts as part of it and sees every delivery too;
  :func:`guests_start` is where the chain ends. A guest that knows about hand-offs and wants
  them (it reads ``Execution.handoff_id``, say) sets the class attribute
  ``sees_handoffs = True``.
- **a middleware added after the process booted is booted at once** (its
  ``after_process_boot``), as if it had been there at boot: Dramatiq's ``Prometheus`` sets
  itself up there (added after ``JobRunner.start()`` it would fail on every message) and
  ``TimeLimit`` starts its timer thread there.

Everything else (enqueues, acks, nacks, worker hooks) every middleware sees, as on Dramatiq's
own brokers. The hook loops keep Dramatiq's error handling: a ``MiddlewareError`` raised by
a ``before_*`` hook propagates, any other exception is logged at CRITICAL and the loop goes
on.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Middleware, MiddlewareError


def guests_start(middleware: Sequence[Middleware], chain: Collection[int]) -> int:
    """The index of the first guest in ``middleware``: the first one after the last member
    of kumiko's chain (``chain`` holds their ``id()``)."""
    start = 0
    for index, each in enumerate(middleware):
        if id(each) in chain:
            start = index + 1
    return start


def handed_off(message: object) -> bool:
    """Whether ``message`` is a delivery whose run was handed off (``Execution.handed_off``)."""
    execution = getattr(message, "execution", None)
    return getattr(execution, "handed_off", False) is True


def sees_handoffs(middleware: Middleware) -> bool:
    """Whether a guest asked to see hand-offs (class attribute ``sees_handoffs = True``)."""
    return getattr(middleware, "sees_handoffs", False) is True


def emit_before_process(broker: Broker, chain: Collection[int], message: MessageProxy) -> None:
    """``before_process_message`` of every middleware in order, skipping the guests of a
    delivery that was handed off meanwhile (but those that see hand-offs)."""
    middleware = list(broker.middleware)
    first_guest = guests_start(middleware, chain)
    for index, each in enumerate(middleware):
        if index >= first_guest and handed_off(message) and not sees_handoffs(each):
            continue
        try:
            each.before_process_message(broker, message)
        except MiddlewareError:
            raise
        except Exception:
            broker.logger.critical(
                "Unexpected failure in before_process_message of %r.", each, exc_info=True
            )


def emit_after_handoff(
    broker: Broker, chain: Collection[int], message: MessageProxy, **kwargs: Any
) -> None:
    """``after_process_message`` of a handed-off delivery, in reverse order, to kumiko's
    chain and the guests that see hand-offs."""
    middleware = list(broker.middleware)
    first_guest = guests_start(middleware, chain)
    for index in reversed(range(len(middleware))):
        each = middleware[index]
        if index >= first_guest and not sees_handoffs(each):
            continue
        try:
            each.after_process_message(broker, message, **kwargs)
        except Exception:
            broker.logger.critical(
                "Unexpected failure in after_process_message of %r.", each, exc_info=True
            )
