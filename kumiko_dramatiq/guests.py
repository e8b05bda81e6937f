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

Dispatch is precomputed (:class:`Hooks`): Dramatiq's broker looks up every hook of every
middleware for every signal (16 middleware, about 90 lookups and calls per message, most of
them the base class's no-ops); the table keeps, per signal, the bound hooks a middleware
actually overrides, and is rebuilt when ``broker.middleware`` changes (compared by identity
on each emit, a C-level list comparison).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from dramatiq.broker import Broker
from dramatiq.middleware import Middleware, MiddlewareError

#: A bound hook, with whether it is skipped for a handed-off delivery.
Hook = tuple[Middleware, Callable[..., Any], bool]


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


def _bound(middleware: Middleware, name: str) -> Callable[..., Any] | None:
    """``middleware``'s hook ``name``, or ``None`` when it is the base class's no-op. A
    middleware without the hook at all gets one that fails on call, as Dramatiq's loop would
    (it is logged, or propagates for a ``before_*`` hook raising ``MiddlewareError``)."""
    hook = getattr(middleware, name, None)
    if hook is None:
        return lambda *args, **kwargs: getattr(middleware, name)(*args, **kwargs)
    base = getattr(Middleware, name, None)
    if base is not None and getattr(hook, "__func__", None) is base:
        return None
    return hook  # type: ignore[no-any-return]


class Hooks:
    """The hooks of one middleware list, by signal (``before_ack``, ...), built on first use:
    in the order Dramatiq calls them (``after_*`` reversed), each with whether a handed-off
    delivery skips it (a guest that does not see hand-offs)."""

    def __init__(self, middleware: Sequence[Middleware], chain: Collection[int]) -> None:
        self.middleware = list(middleware)
        self._first_guest = guests_start(self.middleware, chain)
        self._by_signal: dict[str, tuple[Hook, ...]] = {}

    def __call__(self, signal: str) -> tuple[Hook, ...]:
        hooks = self._by_signal.get(signal)
        if hooks is None:
            order = list(enumerate(self.middleware))
            if signal.startswith("after_"):
                order.reverse()
            found = []
            for index, each in order:
                hook = _bound(each, signal)
                if hook is not None:
                    blind = index >= self._first_guest and not sees_handoffs(each)
                    found.append((each, hook, blind))
            hooks = self._by_signal[signal] = tuple(found)
        return hooks


def emit_before(broker: Broker, hooks: Hooks, signal: str, *args: Any, **kwargs: Any) -> None:
    """Dramatiq's ``emit_before`` over ``hooks``; for ``before_process_message``, a delivery
    handed off meanwhile skips the guests that do not see hand-offs."""
    process = signal == "before_process_message"
    for each, hook, blind in hooks(signal):
        if process and blind and handed_off(args[0]):
            continue
        try:
            hook(broker, *args, **kwargs)
        except MiddlewareError:
            raise
        except Exception:
            broker.logger.critical("Unexpected failure in %s of %r.", signal, each, exc_info=True)


def emit_after(broker: Broker, hooks: Hooks, signal: str, *args: Any, **kwargs: Any) -> None:
    """Dramatiq's ``emit_after`` over ``hooks``; the ``after_process_message`` of a
    handed-off delivery goes to kumiko's chain and the guests that see hand-offs."""
    skip_blind = signal == "after_process_message" and handed_off(args[0])
    for each, hook, blind in hooks(signal):
        if skip_blind and blind:
            continue
        try:
            hook(broker, *args, **kwargs)
        except Exception:
            broker.logger.critical("Unexpected failure in %s of %r.", signal, each, exc_info=True)
