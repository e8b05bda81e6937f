"""Job options: validated once at declaration, read through typed fields.

``JobOptions`` is the one validated option set of a job (pydantic, frozen,
``extra="forbid"``, strict integers: ``True``, ``2.0`` and ``"3"`` are
rejected). Every validation failure becomes one :class:`JobConfigError` that
names the job, the option and the bad value. Triggers (``Manual``, ``Event``;
``Cron`` lives in :mod:`kumiko_dramatiq.cron`), ``Backoff`` and ``Retention``
are declared here too, with the lanes, and the retry policy as message options
(:func:`build_message_options`, the ONE function every enqueue path attaches) and its
maths (:func:`retry_delay_ms`, :func:`retry_window_ms`), all pure. What a failed attempt
does at run time is :mod:`kumiko_dramatiq.middleware.retries`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kumiko_dramatiq.codec import (
    MAX_CAP_RUNNING,
    MAX_RATE_COUNT,
    BackoffType,
    encode_caps,
    encode_policy,
)
from kumiko_dramatiq.cron import Cron
from kumiko_dramatiq.errors import JobConfigError
from kumiko_dramatiq.limits import MAX_DURATION_MS, MAX_RETRIES, backoff_window_ms, is_strict_int

if TYPE_CHECKING:
    from kumiko_dramatiq.registry import JobDefinition

Lane = Literal["worker", "api"]
LANES: Final[tuple[Lane, ...]] = ("worker", "api")


def lane_queue(queue_prefix: str, lane: str) -> str:
    """The queue of ``lane``: ``f"{queue_prefix}-{lane}"``."""
    return f"{queue_prefix}-{lane}"


#: Base delay of a backoff declared without ``delay_ms``.
DEFAULT_BACKOFF_DELAY_MS = 1_000


@dataclass(frozen=True)
class Manual:
    """Trigger: the job runs only when dispatched (the default)."""


@dataclass(frozen=True)
class Event:
    """Trigger: ``runner.handle_event(name, payload)`` dispatches the job.

    ``dedup_key``, if given, maps the event payload to a dedup key: events
    that arrive while the keyed job is queued collapse into it, and events
    that arrive while it runs coalesce into one follow-up run.
    """

    name: str
    dedup_key: Callable[[dict[str, Any]], str] | None = None


@dataclass(frozen=True)
class Backoff:
    """Delay before retry n (n = 1, 2, ...): fixed = ``delay_ms``; exponential
    = ``delay_ms * 2**(n-1)``; ``delay_ms`` defaults to 1000.

    Validated when a job is declared with it, so the error can name the job.
    """

    type: BackoffType
    delay_ms: int | None = None


@dataclass(frozen=True)
class RateLimit:
    """At most ``count`` attempts of a job start in any window of ``per_ms`` milliseconds,
    across every process and host; per tenant (each tenant its own window) when
    ``per_tenant=True``, for per-tenant jobs. Validated when a job is declared with it, so
    the error can name the job."""

    count: int
    per_ms: int
    per_tenant: bool = False


class Retention:
    """How long kumiko keeps records behind deterministic ids.

    ``completed_age_s``: fan-out child guards, cron tick guards, "already
    completed" markers. ``failed_age_s``: dead-lettered messages.
    """

    __slots__ = ("completed_age_s", "failed_age_s")

    completed_age_s: int
    failed_age_s: int

    def __init__(self, completed_age_s: int = 86_400, failed_age_s: int = 604_800) -> None:
        for field, value in (("completed_age_s", completed_age_s), ("failed_age_s", failed_age_s)):
            if not is_strict_int(value) or value <= 0:
                raise JobConfigError(
                    None, f"retention.{field}", "must be a positive integer", value
                )
        object.__setattr__(self, "completed_age_s", completed_age_s)
        object.__setattr__(self, "failed_age_s", failed_age_s)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Retention is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Retention) and (
            (self.completed_age_s, self.failed_age_s) == (other.completed_age_s, other.failed_age_s)
        )

    def __hash__(self) -> int:
        return hash((self.completed_age_s, self.failed_age_s))

    def __repr__(self) -> str:
        return (
            f"Retention(completed_age_s={self.completed_age_s}, failed_age_s={self.failed_age_s})"
        )


class BackoffPolicy(BaseModel):
    """The normalised backoff of a job: a type and a base delay in ms."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    type: BackoffType
    delay_ms: int = Field(gt=0, le=MAX_DURATION_MS)


class JobOptions(BaseModel):
    """The validated option set of one job. See the option table in docs/jobs.md."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", strict=True, arbitrary_types_allowed=True
    )

    trigger: Manual | Cron | Event = Field(default_factory=Manual)
    retries: int = Field(default=0, ge=0, le=MAX_RETRIES)
    backoff: BackoffPolicy | None = None
    per_tenant: bool = False
    concurrency: Literal["parallel", "sequential"] = "parallel"
    run_on_boot: bool = False
    boot_gate: bool = False
    run_in: Literal["worker", "api"] = "worker"
    timeout_ms: int | None = Field(default=None, gt=0, le=MAX_DURATION_MS)
    max_running: int | None = Field(default=None, ge=1, le=MAX_CAP_RUNNING)
    max_running_per_key: int | None = Field(default=None, ge=1, le=MAX_CAP_RUNNING)
    rate_limit: RateLimit | None = None
    priority: int = Field(default=0, ge=0, le=9)
    keep_result_s: int | None = Field(default=None, gt=0, le=MAX_DURATION_MS // 1000)
    on_complete: str | None = None
    on_success: str | None = None

    @field_validator("rate_limit", mode="before")
    @classmethod
    def _check_rate_limit(cls, value: Any) -> Any:
        if value is None:
            return value
        if not isinstance(value, RateLimit):
            raise _FieldProblem("rate_limit", _PROBLEMS["rate_limit"], value)
        if not is_strict_int(value.count) or value.count < 1:
            raise _FieldProblem("rate_limit.count", "must be a positive integer", value.count)
        if value.count > MAX_RATE_COUNT:
            raise _FieldProblem(
                "rate_limit.count", f"is too large (at most {MAX_RATE_COUNT})", value.count
            )
        if not is_strict_int(value.per_ms) or value.per_ms < 1:
            raise _FieldProblem("rate_limit.per_ms", "must be a positive integer", value.per_ms)
        if value.per_ms > MAX_DURATION_MS:
            raise _FieldProblem(
                "rate_limit.per_ms",
                f"is too large (at most {MAX_DURATION_MS} ms, 366 days)",
                value.per_ms,
            )
        if not isinstance(value.per_tenant, bool):
            raise _FieldProblem("rate_limit.per_tenant", "must be a bool", value.per_tenant)
        return value

    @field_validator("trigger", mode="before")
    @classmethod
    def _check_trigger(cls, value: Any) -> Any:
        if isinstance(value, Event):
            if not isinstance(value.name, str) or not value.name:
                raise _FieldProblem("trigger.name", "must be a non-empty string", value.name)
            if value.dedup_key is not None and not callable(value.dedup_key):
                raise _FieldProblem(
                    "trigger.dedup_key", "must be a callable or None", value.dedup_key
                )
        return value

    @field_validator("backoff", mode="before")
    @classmethod
    def _normalise_backoff(cls, value: Any) -> Any:
        if value is None or isinstance(value, BackoffPolicy):
            return value
        if isinstance(value, str):
            return {"type": value, "delay_ms": DEFAULT_BACKOFF_DELAY_MS}
        if isinstance(value, Backoff):
            delay_ms = DEFAULT_BACKOFF_DELAY_MS if value.delay_ms is None else value.delay_ms
            return {"type": value.type, "delay_ms": delay_ms}
        raise _FieldProblem("backoff", _PROBLEMS["backoff"], value)

    @model_validator(mode="after")
    def _check_combinations(self) -> JobOptions:
        if self.boot_gate and self.concurrency == "sequential":
            raise _FieldProblem(
                "boot_gate",
                'with concurrency="sequential" is not supported: a gate runs in-process on '
                "every worker start, before any lock could be shared",
            )
        capped = [
            name
            for name in ("max_running", "max_running_per_key", "rate_limit")
            if getattr(self, name) is not None
        ]
        if self.boot_gate and capped:
            raise _FieldProblem(
                capped[0],
                "with boot_gate=True is not supported: a gate runs in-process on every worker "
                "start, outside the queue the caps are kept at",
            )
        if self.rate_limit is not None and self.rate_limit.per_tenant and not self.per_tenant:
            raise _FieldProblem(
                "rate_limit.per_tenant",
                "needs per_tenant=True: only a per-tenant job's runs have a tenant",
                True,
            )
        if self.boot_gate and self.keep_result_s is not None:
            raise _FieldProblem(
                "keep_result_s",
                "with boot_gate=True is not supported: a gate runs in-process, its value "
                "goes nowhere",
            )
        for name in ("on_complete", "on_success"):
            if getattr(self, name) is not None and not self.per_tenant:
                raise _FieldProblem(
                    name,
                    "needs per_tenant=True: a plain job's dispatch is one run (use "
                    "runner.dispatch_batch for a callback)",
                    getattr(self, name),
                )
        if self.boot_gate and self.per_tenant:
            raise _FieldProblem(
                "boot_gate", "with per_tenant=True is not supported: a gate runs once, in-process"
            )
        return self

    @property
    def max_attempts(self) -> int:
        return self.retries + 1


def parse_job_options(job_name: str, options: Mapping[str, Any]) -> JobOptions:
    """Validate ``options`` for ``job_name``; raise one :class:`JobConfigError`."""
    try:
        return JobOptions(**options)
    except ValidationError as exc:
        raise _config_error(job_name, exc) from None
    except _FieldProblem as problem:  # raised outside pydantic's wrapping
        raise JobConfigError(job_name, problem.field, problem.problem, problem.value) from None


_PROBLEMS: dict[str, str] = {
    "trigger": "must be Manual(), Cron(expr) or Event(name)",
    "retries": "must be an integer >= 0",
    "backoff": 'must be None, "fixed", "exponential" or Backoff(type, delay_ms=None)',
    "backoff.type": 'must be "fixed" or "exponential"',
    "backoff.delay_ms": "must be a positive integer",
    "per_tenant": "must be a bool",
    "concurrency": 'must be "parallel" or "sequential"',
    "run_on_boot": "must be a bool",
    "boot_gate": "must be a bool",
    "run_in": 'must be "worker" or "api"',
    "timeout_ms": "must be a positive integer or None",
    "max_running": "must be an integer >= 1 or None",
    "max_running_per_key": "must be an integer >= 1 or None",
    "priority": "must be an integer from 0 (runs first) to 9",
    "rate_limit": "must be None or RateLimit(count, per_ms, per_tenant=False)",
    "keep_result_s": "must be a positive integer (seconds, at most 366 days) or None",
    "on_complete": 'must be a qualified job name ("feature:job:name") or None',
    "on_success": 'must be a qualified job name ("feature:job:name") or None',
}


class _FieldProblem(ValueError):
    def __init__(self, field: str, problem: str, value: Any = ...) -> None:
        super().__init__(field, problem)
        self.field = field
        self.problem = problem
        self.value = value


def _config_error(job_name: str, exc: ValidationError) -> JobConfigError:
    error = exc.errors(include_url=False)[0]
    ctx_error = (error.get("ctx") or {}).get("error")
    if isinstance(ctx_error, _FieldProblem):
        return JobConfigError(job_name, ctx_error.field, ctx_error.problem, ctx_error.value)
    loc = [str(part) for part in error["loc"] if not str(part).startswith(("function-", "Manual"))]
    field = ".".join(loc[:2]) if loc[:1] == ["backoff"] else (loc[0] if loc else "options")
    if error["type"] == "extra_forbidden":
        known = ", ".join(JobOptions.model_fields)
        return JobConfigError(job_name, field, f"is not a job option (options: {known})")
    if field == "trigger":
        return JobConfigError(job_name, field, _PROBLEMS["trigger"], error["input"])
    if error["type"] == "less_than_equal":
        limit = (error.get("ctx") or {}).get("le")
        return JobConfigError(job_name, field, f"is too large (at most {limit})", error["input"])
    return JobConfigError(job_name, field, _PROBLEMS.get(field, error["msg"]), error["input"])


def build_message_options(job: JobDefinition) -> dict[str, Any]:
    """The retry/backoff options every enqueue path attaches to a message of ``job`` (and
    its caps, ``max_running`` and ``rate_limit``, for a capped job: the fetch keeps them).

    Pure and deterministic; JSON-native values only.
    """
    options = job.options
    backoff = options.backoff
    policy = encode_policy(
        options.retries,
        None if backoff is None else backoff.type,
        None if backoff is None else backoff.delay_ms,
    )
    rate = options.rate_limit
    per_key = options.max_running_per_key
    if options.max_running is not None or rate is not None or per_key is not None:
        policy.update(
            encode_caps(
                options.max_running,
                None if rate is None else (rate.count, rate.per_ms, rate.per_tenant),
                per_key,
            )
        )
    return policy


def retry_delay_ms(
    backoff: BackoffType | None, base_delay_ms: int | None, retry_number: int
) -> int | None:
    """Delay before retry ``retry_number`` (1-based) under a backoff of type ``backoff`` with
    base delay ``base_delay_ms``; ``None`` (no backoff) means "retry at once"."""
    if backoff is None or base_delay_ms is None:
        return None
    if backoff == "fixed":
        return base_delay_ms
    return int(base_delay_ms * 2 ** (retry_number - 1))


def retry_window_ms(options: JobOptions) -> int:
    """Worst-case time spent waiting out backoffs across all retries of a job."""
    backoff = options.backoff
    if backoff is None:
        return 0
    return backoff_window_ms(options.retries, backoff.type, backoff.delay_ms)
