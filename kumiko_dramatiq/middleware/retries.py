"""``Retries``: retry a failed attempt on the SAME message id, exactly as the job says.

Reads ``kumiko_retries``, ``kumiko_backoff``, ``kumiko_backoff_delay_ms``
(written by :func:`~kumiko_dramatiq.build_message_options`) and
``kumiko_failures``; writes ``kumiko_failures`` on the retry. Attempts =
retries + 1. The delay before retry n is fixed ``delay_ms`` or exponential
``delay_ms * 2**(n-1)``, without jitter or floor; no backoff retries at once
(straight onto the queue, not the delay queue). A final failure is
dead-lettered (``<queue>.XQ``, kept ``Retention.failed_age_s``). A timeout
(``TimeLimitExceeded``) is a failed attempt like any other. A sequential
hand-off spends no attempt. Touches no kumiko Redis key.

The retry is prepared here (``before_enqueue`` runs now) and written by the
consumer's ack of the failed attempt, in the same Lua call
(:meth:`~kumiko_dramatiq.broker.KumikoBroker.ack_and_retry`): a worker killed
before the ack leaves neither an ack nor a retry (the attempt is redelivered
and runs again), one killed after it leaves both, so a retry chain never
forks and is never lost. No extra round trip: the ack happens anyway.
Replaces Dramatiq's own
``Retries``, which a kumiko broker must not carry (``JobRunner.start``
refuses it).
"""

from __future__ import annotations

import logging
from typing import Any

from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Middleware

from ..options import retry_delay_ms
from ..runtime import Runtime

logger = logging.getLogger("kumiko_dramatiq")


class Retries(Middleware):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        execution = self.runtime.current()
        if exception is None or execution is None or execution.handed_off:
            return
        meta = execution.meta
        if meta.final_attempt:
            logger.warning(
                "%s %s failed for good after %d attempt(s): %s",
                execution.job.qualified_name,
                message.message_id,
                meta.attempt,
                describe(exception),
            )
            message.fail()
            return
        failures = meta.attempt
        delay_ms = retry_delay_ms(message.options, failures)
        retry = message.copy(options={"kumiko_failures": failures})
        retry.options.pop("eta", None)
        prepared = self.runtime.broker.prepare(retry, delay_ms)
        broker.emit_before("enqueue", prepared, delay_ms)
        # The consumer's ack writes it, in the same Lua call as the ack
        # (KumikoBroker.ack_and_retry): a crash can neither lose nor fork it.
        message.kumiko_retry = (prepared, delay_ms)  # type: ignore[attr-defined]
        logger.info(
            "%s %s: attempt %d of %d failed (%s), retrying %s",
            execution.job.qualified_name,
            message.message_id,
            meta.attempt,
            meta.max_attempts,
            describe(exception),
            "now" if delay_ms is None else f"in {delay_ms} ms",
        )


def describe(exception: BaseException) -> str:
    """``Type: message``, or just ``Type`` when the message is empty."""
    text = str(exception)
    return f"{type(exception).__name__}: {text}" if text else type(exception).__name__
