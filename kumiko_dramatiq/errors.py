"""The error tree of kumiko_dramatiq.

Every error derives from :class:`KumikoError`. Each class builds its own
one-line message from structured values, so a message always names the job,
the field and the bad value the same way::

    billing:job:send_invoice: backoff.delay_ms must be a positive integer, got 0
"""

from __future__ import annotations

import re
from typing import Any

from dramatiq.middleware import MiddlewareError


class KumikoError(Exception):
    """Base class of every error raised by kumiko_dramatiq."""


class JobConfigError(KumikoError, ValueError):
    """A job, trigger or runner option is invalid.

    Raised at declaration time (``Feature.job``, ``Cron(...)``, ``Registry``)
    or at ``JobRunner`` construction, never later.
    """

    def __init__(self, subject: str | None, field: str, problem: str, value: Any = ...) -> None:
        self.subject = subject
        self.field = field
        self.problem = problem
        self.value = value
        head = f"{subject}: " if subject else ""
        tail = "" if value is ... else f", got {value!r}"
        super().__init__(f"{head}{field} {problem}{tail}")


class UnknownJobError(KumikoError, LookupError):
    """``dispatch`` named a job that no feature of the registry declares."""

    def __init__(self, job_name: str, known: list[str]) -> None:
        self.job_name = job_name
        hint = ", ".join(sorted(known)[:10]) or "none"
        super().__init__(f"unknown job {job_name!r} (known jobs: {hint})")


class PayloadError(KumikoError, ValueError):
    """A payload is not a JSON object of JSON values, or does not validate against its job's
    payload model; nothing was enqueued.

    ``path`` locates the bad value (``payload['items'][3]``, ``payloads[3].amount``);
    ``value`` is left out of the message when not given (a missing field); ``note`` is
    appended in parentheses.
    """

    def __init__(
        self, job_name: str, path: str, problem: str, value: Any = ..., *, note: str | None = None
    ) -> None:
        self.job_name = job_name
        self.path = path
        self.problem = problem
        self.value = value
        self.note = note
        got = "" if value is ... else f", got {_short_repr(value)}"
        tail = "" if note is None else f" ({note})"
        super().__init__(f"{job_name}: {path} {problem}{got}{tail}")


class RedisUnavailableError(KumikoError, ConnectionError):
    """Redis did not answer within the configured bound.

    ``maybe_enqueued``: ``False`` when the request certainly never reached Redis (the
    connection was refused or could not be made, or Redis refused the command); ``True`` when
    it may have been written (a timeout or a dropped connection after it was sent): the
    message then says so, and a dispatch retried with the same ``idempotency_key`` is safe.
    """

    def __init__(
        self,
        redis_url: str,
        action: str,
        cause: BaseException | str | None = None,
        *,
        maybe_enqueued: bool = False,
    ) -> None:
        self.redis_url = redis_url
        self.maybe_enqueued = maybe_enqueued
        reason = "" if cause is None else ": " + " ".join(str(cause).split())
        maybe = " (it may have been enqueued)" if maybe_enqueued else ""
        super().__init__(
            f"Redis at {redact_url(redis_url)} is unavailable while {action}{reason}{maybe}"
        )


class NotRedisError(RedisUnavailableError):
    """What answers at the Redis URL is not Redis: it replied outside the Redis protocol (an
    HTTP server on the port, say)."""

    def __init__(self, redis_url: str, action: str, cause: BaseException) -> None:
        RedisUnavailableError.__init__(self, redis_url, action)
        reply = " ".join(str(cause).split())
        self.args = (
            f"Redis at {redact_url(redis_url)} is unavailable while {action}: what answers "
            f"there does not speak the Redis protocol ({reply:.200}); check the host and port",
        )


class BootGateError(KumikoError, RuntimeError):
    """A boot gate still failed after its attempts; the worker did not start."""

    def __init__(self, job_name: str, attempts: int, cause: BaseException) -> None:
        self.job_name = job_name
        self.attempts = attempts
        self.cause = cause
        super().__init__(
            f"boot gate {job_name} failed after {attempts} attempt(s): "
            f"{type(cause).__name__}: {cause}"
        )


class TenantListError(KumikoError, ValueError):
    """``get_active_tenant_ids`` returned something that is not a list of tenant ids.

    Raised inside a per-tenant wrapper's attempt, before it enqueues any child:
    the attempt fails (and is retried like any failure) with nothing enqueued.
    ``where`` locates the bad value, e.g. ``get_active_tenant_ids()[2]``.
    """

    def __init__(self, job_name: str, where: str, problem: str, value: Any) -> None:
        self.job_name = job_name
        self.where = where
        self.value = value
        super().__init__(f"{job_name}: {where} {problem}, got {_short_repr(value)}")


class SequentialLockError(KumikoError, MiddlewareError):
    """A sequential run could not take its lock, or could not hand off (Redis failed).

    Raised in ``before_process_message``. Being a Dramatiq ``MiddlewareError``,
    it is not swallowed there: the handler never runs without its lock, and the
    attempt counts as failed (retried like any failure, dead-lettered on the
    last), so the message is never lost.
    """

    def __init__(self, job_name: str, action: str, lock_key: str, cause: BaseException) -> None:
        self.job_name = job_name
        self.action = action
        self.lock_key = lock_key
        self.cause = cause
        detail = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        super().__init__(f"{job_name}: {action} (lock {lock_key}) failed: {detail}")


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def redact_url(url: Any) -> Any:
    """``url`` with any password (the user's, and query options named ``*password``, such as
    ``sentinel_password``) replaced by ``***``."""
    if not isinstance(url, str):
        return url
    url = _QUERY_PASSWORD.sub(r"\1***", url)
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest.partition("?")[0]:
        return url
    rest, query_sep, query = rest.partition("?")
    credentials, _, host = rest.rpartition("@")
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}{query_sep}{query}"


_QUERY_PASSWORD = re.compile(r"([?&][A-Za-z_]*password=)[^&#]*")


class AppLoadError(KumikoError):
    """``KUMIKO_APP`` (or a ``KUMIKO_*`` variable) does not name a loadable app."""


class JobTimeoutError(KumikoError, TimeoutError):
    """A run finished over its ``timeout_ms`` without being interrupted (a blocking C call):
    the attempt fails like one that was interrupted."""

    def __init__(self, job_name: str, timeout_ms: int, elapsed_ms: int) -> None:
        self.job_name = job_name
        self.timeout_ms = timeout_ms
        self.elapsed_ms = elapsed_ms
        super().__init__(
            f"{job_name}: ran {elapsed_ms} ms, over its timeout_ms={timeout_ms} (a blocking "
            "call could not be interrupted)"
        )


class RedisAccessError(KumikoError):
    """Redis answers but refuses what kumiko needs: a database that does not exist, a
    password it rejects, or an ACL user without a command or key pattern kumiko uses."""

    def __init__(self, redis_url: str, problem: str) -> None:
        self.redis_url = redis_url
        self.problem = problem
        super().__init__(f"Redis at {redact_url(redis_url)} {problem}")


class NotFoundError(KumikoError, LookupError):
    """An admin action found nothing to act on (a message that is not a dead letter, ...)."""


class DrainTimeoutError(KumikoError, TimeoutError):
    """``JobRunner.drain(timeout_s)`` ran out of time with work still pending in its dataset.

    ``counts`` says how much is pending where (per lane: queued, delayed; running);
    ``pending`` names some of it, each ``"<job> <message id> (<state>)"``.
    """

    def __init__(
        self, queue_prefix: str, timeout_s: float, counts: str, pending: list[str]
    ) -> None:
        self.queue_prefix = queue_prefix
        self.timeout_s = timeout_s
        self.counts = counts
        self.pending = pending
        named = f": {', '.join(pending)}" if pending else ""
        super().__init__(
            f"drain of queue prefix {queue_prefix!r} timed out after {timeout_s:g} s with work "
            f"still pending ({counts}){named}"
        )


class ResultPending(KumikoError):
    """``runner.result(message_id, timeout_s=...)``: the job has not ended within
    ``timeout_s`` (it waits, is delayed, runs, or is being retried). Ask again later."""

    def __init__(self, message_id: str, timeout_s: float, state: str | None = None) -> None:
        self.message_id = message_id
        self.timeout_s = timeout_s
        self.state = state
        where = f" (it is {state})" if state else ""
        super().__init__(f"{message_id} has not ended within {timeout_s:g} s{where}")


class JobFailedError(KumikoError):
    """``runner.result(message_id)``: the job ended without a value. ``status`` is
    ``"dead"`` (retries spent, a poison or invalid message) or ``"cancelled"``;
    ``error_type`` and ``error_message`` are those of its last attempt (``None`` for a
    message cancelled before it started)."""

    def __init__(
        self,
        message_id: str,
        job_name: str,
        status: str,
        error_type: str | None = None,
        error_message: str | None = None,
    ) -> None:
        self.message_id = message_id
        self.job_name = job_name
        self.status = status
        self.error_type = error_type
        self.error_message = error_message
        cause = f": {error_type}: {error_message}" if error_type else ""
        super().__init__(f"{job_name} {message_id} ended {status} without a result{cause}")


class ResultError(KumikoError, ValueError):
    """A handler of a job that keeps its result returned a value that breaks the payload
    rules (not JSON, too large, not the model its return annotation names): the attempt
    fails with this error, retried like any failure. Also raised by ``runner.result`` for a
    kept value that no longer validates against the job's return model."""

    def __init__(self, job_name: str, problem: str) -> None:
        self.job_name = job_name
        self.problem = problem
        super().__init__(f"{job_name}: result {problem}")
