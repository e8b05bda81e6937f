"""Retries: a failed attempt runs again on the SAME message id, exactly as its job says.

Everything about retries is here:

- **the policy on the message** (:func:`kumiko_dramatiq.options.build_message_options`): the
  only function that turns a job's ``retries``/``backoff`` into message options. Every
  enqueue path (dispatch, event, cron tick, boot-once, per-tenant wrapper and child,
  sequential hand-off, dedup follow-up) builds its message with
  :func:`kumiko_dramatiq.messages.build_message`, which merges it, so none can forget it. The
  keys and their decoding are :mod:`kumiko_dramatiq.codec`'s;
- **the maths** (:func:`kumiko_dramatiq.options.retry_delay_ms`, ``retry_window_ms``), pure:
  attempts = retries + 1; the delay before retry n (n = 1, 2, ...) is ``delay_ms`` (fixed)
  or ``delay_ms * 2**(n-1)`` (exponential), without jitter or floor; no backoff retries at
  once;
- **the middleware** (:class:`Retries`): after a failed attempt that is not the last, it
  prepares the retry (a copy with ``kumiko_failures`` = attempts spent, ``before_enqueue``
  runs now) and leaves it on the delivery's :class:`~kumiko_dramatiq.broker.Settlement`;
  the final failure is dead-lettered (``message.fail()`` -> ``<queue>.XQ``, kept
  ``Retention.failed_age_s``). A timeout (``TimeLimitExceeded``) is a failed attempt like any
  other; a sequential hand-off spends none, nor does a run fenced because its lease could not
  be renewed (it goes back to its queue, like a run cut short by a crash);
- **the ack-with-retry step** (``lua/settle.lua``, run by the consumer's ack): the ack of
  the failed attempt and the enqueue of its retry are ONE Lua call, so a worker killed before
  it leaves neither (the attempt is redelivered and runs again) and one killed after it leaves
  both: a retry chain never forks and is never lost, at no extra round trip.

Actors kumiko did not declare (plain ``@dramatiq.actor`` functions on a kumiko broker) keep
Dramatiq's retry semantics: :class:`Retries` hands their messages to an embedded Dramatiq
``Retries`` (its defaults: 20 retries, 15 s minimum backoff, jittered exponential delays), and
declares its actor options (``max_retries``, ``min_backoff``, ``max_backoff``, ``retry_when``,
``throws``, ``on_retry_exhausted``). One middleware decides for every message, so none is
retried twice or not at all. A second, Dramatiq ``Retries`` on the same broker would do
both, so :func:`check_no_dramatiq_retries` refuses it on every start path
(``JobRunner.start()`` and ``dramatiq kumiko_dramatiq.app``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import dramatiq
from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Middleware

from kumiko_dramatiq.broker.broker import KumikoBroker
from kumiko_dramatiq.broker.delivery import Delivery
from kumiko_dramatiq.codec import FAILURES
from kumiko_dramatiq.errors import JobConfigError
from kumiko_dramatiq.ids import redis_message_id
from kumiko_dramatiq.options import retry_delay_ms
from kumiko_dramatiq.worker.execution import execution_of

if TYPE_CHECKING:
    from kumiko_dramatiq.registry import Registry

logger = logging.getLogger("kumiko_dramatiq")


def describe_error(exception: BaseException) -> str:
    """``Type: message``, or just ``Type`` when the message is empty."""
    text = str(exception)
    return f"{type(exception).__name__}: {text}" if text else type(exception).__name__


class Retries(Middleware):
    """Retries failed kumiko attempts on their message id; dead-letters the final failure;
    gives every other actor's messages Dramatiq's retry semantics.

    Logs each failed kumiko attempt: retried ones at WARNING (``Type: message``), the final
    one at ERROR with its traceback; the payload only with ``log_payloads``.

    Reads the delivery's decoded options (``kumiko_retries``, ``kumiko_backoff``,
    ``kumiko_backoff_delay_ms``, ``kumiko_failures``); writes ``kumiko_failures`` on the
    retry, and Dramatiq's own ``retries`` (failed attempts so far, Dramatiq's meaning), which
    ``CurrentMessage`` readers and Dramatiq's ``Prometheus`` retry counter go by. Touches no
    kumiko Redis key. Early in the chain (after ``History``), so its ``after_process_message`` runs
    late: after the hooks, the dedup transition and the lock release.

    A message of an actor ``registry`` does not declare goes to :attr:`plain`, Dramatiq's own
    ``Retries`` (``max_retries``, ``min_backoff``, ``max_backoff``, ``retry_when``, ``throws``,
    ``on_retry_exhausted``, ``Retry(delay=...)``, all as on Dramatiq's ``RedisBroker``): it
    enqueues the retry and the original is acked, or fails it on its last retry.
    ``Callbacks`` and ``Pipelines`` sit just before this middleware in the chain, as before
    Dramatiq's ``Retries`` in Dramatiq's default order, so they see its decision.
    """

    def __init__(self, registry: Registry, *, log_payloads: bool = False) -> None:
        self.registry = registry
        self.log_payloads = log_payloads
        #: Dramatiq's ``Retries``, with Dramatiq's defaults, for actors kumiko did not declare
        self.plain = dramatiq.middleware.Retries()

    @property
    def actor_options(self) -> set[str]:
        return set(self.plain.actor_options)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        if self.registry.actor(message.actor_name) is None:
            self.plain.after_process_message(  # type: ignore[no-untyped-call]
                broker, message, result=result, exception=exception
            )
            return
        execution = execution_of(message)
        if exception is None or execution is None or execution.handed_off or execution.fenced:
            return
        if execution.stopped:  # stopped on request: ends cancelled, neither retried nor dead
            return
        meta, options = execution.meta, execution.options
        payload = f" payload={message.args[0]!r}" if self.log_payloads else ""
        if meta.final_attempt:
            logger.error(
                "%s %s failed for good after %d attempt(s), dead-lettered: %s%s",
                execution.job.qualified_name,
                message.message_id,
                meta.attempt,
                describe_error(exception),
                payload,
                exc_info=exception,
                extra=execution.log_fields(),
            )
            message.fail()
            return
        failures = meta.attempt
        delay_ms = retry_delay_ms(options.backoff, options.backoff_delay_ms, failures)
        retry = message.copy(options={FAILURES: failures, DRAMATIQ_RETRIES: failures})
        retry.options.pop("eta", None)
        retry.options.pop("redis_message_id", None)
        assert isinstance(broker, KumikoBroker)
        assert isinstance(message, Delivery)
        prepared = broker.prepare(
            retry, delay_ms, redis_message_id=redis_message_id(message.message_id, failures + 1)
        )
        broker.emit_before("enqueue", prepared, delay_ms)
        message.settlement.retry = (prepared, delay_ms)
        logger.warning(
            "%s %s: attempt %d of %d failed (%s), retrying %s%s",
            execution.job.qualified_name,
            message.message_id,
            meta.attempt,
            meta.max_attempts,
            describe_error(exception),
            "now" if delay_ms is None else f"in {delay_ms} ms",
            payload,
            extra=execution.log_fields(),
        )


#: Dramatiq's message option counting a message's retries (its ``Retries`` writes it).
DRAMATIQ_RETRIES = "retries"


def check_no_dramatiq_retries(middleware: Iterable[Middleware]) -> None:
    """Refuse Dramatiq's own ``Retries`` in a kumiko broker's middleware (``JobConfigError``).

    Kumiko's :class:`Retries` already retries every message, plain actors' with Dramatiq's
    semantics; a second retries middleware would retry kumiko's jobs with Dramatiq's policy
    and plain actors' messages twice. Called on every start path: ``JobRunner.start()`` and
    ``dramatiq kumiko_dramatiq.app``.
    """
    for each in middleware:
        if isinstance(each, dramatiq.middleware.Retries):
            raise JobConfigError(
                None,
                "broker middleware",
                "must not include dramatiq's Retries: kumiko's Retries already retries "
                "kumiko's jobs their way and plain actors Dramatiq's way (set max_retries, "
                "min_backoff, ... on the actor)",
                type(each).__name__,
            )
