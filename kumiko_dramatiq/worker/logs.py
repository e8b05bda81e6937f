"""What kumiko's runs look like in the logs: no payloads unless the app opts in.

Kumiko logs each attempt's outcome itself (:mod:`kumiko_dramatiq.middleware.retries`): a failed
attempt that is retried at WARNING, a dead letter at ERROR with its traceback, never the
payload unless ``JobRunner(log_payloads=True)``. Dramatiq's worker logs messages by their
``str()``, which shows their arguments (the payload) and logs every failure at ERROR;
:func:`install_log_filter` puts :class:`KumikoRecords` on its worker logger, which names a
kumiko message by job and message id instead and leaves the failure line to kumiko's own;
each kumiko actor's logger gets :class:`HiddenArguments` unless payloads may be logged.
Messages of other actors are logged as Dramatiq logs them.
"""

from __future__ import annotations

import logging
from typing import Any

from dramatiq.broker import MessageProxy
from dramatiq.message import Message

from kumiko_dramatiq.broker.delivery import Delivery
from kumiko_dramatiq.codec import TRIGGER

#: Dramatiq's logger that logs messages by their ``str()``.
DRAMATIQ_WORKER_LOGGER = "dramatiq.worker.WorkerThread"


class _Named:
    """A kumiko message in a log line: ``job(message id)``, no arguments."""

    __slots__ = ("actor_name", "message_id")

    def __init__(self, message: Any) -> None:
        self.actor_name = message.actor_name
        self.message_id = message.message_id

    def __str__(self) -> str:
        return f"{self.actor_name}({self.message_id})"

    __repr__ = __str__


def _is_kumiko(value: Any) -> bool:
    return (
        isinstance(value, MessageProxy | Message)
        and isinstance(value.options, dict)
        and TRIGGER in value.options
    )


class KumikoRecords(logging.Filter):
    """On Dramatiq's worker logger: a kumiko message is shown as ``job(message id)``, and
    Dramatiq's "Failed to process message" line is dropped for it (kumiko logs its own), as
    is its "was skipped" line for a held message the broker's gate refused (dropped unstarted:
    it was never this worker's to run, :mod:`kumiko_dramatiq.broker.holds`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or not any(_is_kumiko(arg) for arg in args):
            return True
        if str(record.msg).startswith("Failed to process message"):
            return False
        if str(record.msg).endswith("was skipped.") and any(
            isinstance(arg, Delivery) and arg.refused for arg in args
        ):
            return False
        record.args = tuple(_Named(arg) if _is_kumiko(arg) else arg for arg in args)
        return True


class HiddenArguments(logging.Filter):
    """On a kumiko actor's own logger: Dramatiq's "Received args=..." line (DEBUG) without
    the arguments, which are the payload."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Received args"):
            record.msg = "Received its payload (hidden; JobRunner(log_payloads=True) shows it)."
            record.args = ()
        return True


def hide_arguments(actor_logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    """Put :class:`HiddenArguments` on a kumiko actor's logger, once."""
    target = actor_logger
    if isinstance(target, logging.LoggerAdapter):
        target = target.logger
    if not any(isinstance(f, HiddenArguments) for f in target.filters):
        target.addFilter(HiddenArguments())


def install_log_filter() -> None:
    """Put :class:`KumikoRecords` on Dramatiq's worker logger, once per process."""
    worker_logger = logging.getLogger(DRAMATIQ_WORKER_LOGGER)
    if not any(isinstance(f, KumikoRecords) for f in worker_logger.filters):
        worker_logger.addFilter(KumikoRecords())
