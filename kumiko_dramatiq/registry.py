"""Declaring jobs: ``Feature``, ``JobDefinition`` and ``Registry``.

A job is declared inside a feature::

    billing = Feature("billing")

    @billing.job("send_invoice", retries=3, backoff="exponential")
    def send_invoice(payload: dict, ctx: JobContext) -> None: ...

    registry = Registry([billing])
    registry.jobs["billing:job:send_invoice"]   # -> JobDefinition

Options are validated when the decorator runs (``JobConfigError`` naming the
job, the option and the bad value); ``Registry`` checks what spans features
(duplicate qualified names).

A handler whose payload parameter is annotated with a pydantic ``BaseModel``
subclass makes its job typed (``JobDefinition.payload_model``): see
:mod:`kumiko_dramatiq.payloads` for the rules. An annotation that does not
resolve when the decorator runs (a model defined below its handler) is
resolved again by ``Registry``, which also checks that a typed cron, boot-once
or boot-gate job's model accepts ``{}``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from kumiko_dramatiq.errors import JobConfigError
from kumiko_dramatiq.limits import MAX_DURATION_MS
from kumiko_dramatiq.options import (
    Event,
    JobOptions,
    lane_queue,
    parse_job_options,
    retry_window_ms,
)
from kumiko_dramatiq.payloads import (
    UnresolvedHint,
    check_empty_payload,
    payload_model_of,
    result_model_of,
    settle_payload_model,
)

if TYPE_CHECKING:
    from kumiko_dramatiq.context import JobContext

_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
#: What a qualified job name looks like (:func:`qualified_name`).
QUALIFIED_NAME_RE = re.compile(rf"{_NAME_RE.pattern}:job:{_NAME_RE.pattern}")

#: A per-tenant job's wrapper actor is named ``qualified_name + WRAPPER_SUFFIX``.
WRAPPER_SUFFIX = ":fanout"

#: A handler: ``(payload, ctx)``; the payload is a dict, or the job's payload model.
Handler = Callable[[Any, "JobContext"], Any]
H = TypeVar("H", bound=Callable[..., Any])


def qualified_name(feature: str, job: str) -> str:
    """``f"{feature}:job:{job}"``: the job's actor name and registry key."""
    return f"{feature}:job:{job}"


@dataclass(frozen=True)
class JobDefinition:
    """One declared job: its names, its handler and its validated options.

    ``payload_model`` is the pydantic model its handler's payload parameter is annotated
    with (a typed job), or ``None`` (untyped: the handler receives the dict).
    ``payload_hint_problem`` says why that annotation did not resolve (then the job is
    untyped), or is ``None``.
    """

    feature: str
    name: str
    handler: Handler
    options: JobOptions
    qualified_name: str = field(init=False)
    is_async: bool = field(init=False)
    payload_model: type[BaseModel] | None = field(init=False, default=None, compare=False)
    payload_hint_problem: str | None = field(init=False, default=None, compare=False)
    #: The model the handler's return annotation names, or ``None`` (plain JSON results).
    result_model: type[BaseModel] | None = field(init=False, default=None, compare=False)
    #: Whether the model is plain (:func:`kumiko_dramatiq.payloads.is_plain_model`; set by
    #: ``Registry``, until then not): its dumps are not re-validated at dispatch and a worker
    #: validates the decoded payload in Python mode.
    payload_model_plain: bool = field(init=False, default=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "qualified_name", qualified_name(self.feature, self.name))
        object.__setattr__(self, "is_async", inspect.iscoroutinefunction(self.handler))
        self.resolve_payload_model()

    def resolve_payload_model(self, scope: Mapping[str, Any] | None = None) -> None:
        """(Re)read the payload model from the handler's annotation
        (:func:`kumiko_dramatiq.payloads.payload_model_of`; ``scope``: more names it may
        use)."""
        try:
            model, problem = payload_model_of(self.handler, scope), None
        except UnresolvedHint as exc:
            model, problem = None, str(exc)
        object.__setattr__(self, "payload_model", model)
        object.__setattr__(self, "payload_hint_problem", problem)
        object.__setattr__(self, "result_model", result_model_of(self.handler, scope))

    def set_payload_model_plain(self, plain: bool) -> None:
        """Set :attr:`payload_model_plain` (``Registry``, once the model is complete)."""
        object.__setattr__(self, "payload_model_plain", plain)

    @property
    def event_name(self) -> str | None:
        trigger = self.options.trigger
        return trigger.name if isinstance(trigger, Event) else None

    @property
    def is_capped(self) -> bool:
        """Whether the job has a cap: ``max_running``, ``max_running_per_key`` or
        ``rate_limit``."""
        options = self.options
        return (
            options.max_running is not None
            or options.max_running_per_key is not None
            or options.rate_limit is not None
        )

    @property
    def has_callbacks(self) -> bool:
        """Whether each dispatch of this (per-tenant) job is a batch of its tenant children
        with a callback: ``on_complete`` or ``on_success``."""
        return self.options.on_complete is not None or self.options.on_success is not None

    @property
    def wrapper_actor_name(self) -> str:
        """Actor name of a per-tenant job's fan-out wrapper (contains the qualified name)."""
        return self.qualified_name + WRAPPER_SUFFIX

    def queue_name(self, queue_prefix: str) -> str:
        """The job's lane queue: ``f"{queue_prefix}-{run_in}"``."""
        return lane_queue(queue_prefix, self.options.run_in)


class Feature:
    """A named group of jobs. ``feature.job(name, **options)`` declares one."""

    def __init__(self, name: str) -> None:
        _check_name(None, "feature name", name)
        self.name = name
        self._jobs: dict[str, JobDefinition] = {}

    @property
    def jobs(self) -> Mapping[str, JobDefinition]:
        """The feature's jobs by qualified name, in declaration order."""
        return MappingProxyType(self._jobs)

    def job(self, name: str, **options: Any) -> Callable[[H], H]:
        """Register the decorated handler as job ``name``; return it unchanged.

        Raises :class:`JobConfigError` at once for a bad name or option, and
        when the decorated object is not callable or the name is taken.
        """
        _check_name(f"{self.name}:job:{name}" if isinstance(name, str) else None, "job name", name)
        qualified = qualified_name(self.name, name)
        job_options = parse_job_options(qualified, options)
        window_ms = retry_window_ms(job_options)
        if window_ms > MAX_DURATION_MS:
            raise JobConfigError(
                qualified,
                "retries/backoff",
                f"give a retry window of {window_ms} ms, too large (at most {MAX_DURATION_MS} "
                "ms, 366 days)",
            )

        def register(handler: H) -> H:
            if not callable(handler):
                raise JobConfigError(qualified, "handler", "must be callable", handler)
            if qualified in self._jobs:
                raise JobConfigError(qualified, "name", "is declared twice in this feature")
            definition = JobDefinition(self.name, name, handler, job_options)
            if definition.payload_hint_problem is not None:
                # declared inside a function (a test): its local names may hold the model
                caller = inspect.currentframe()
                caller = None if caller is None else caller.f_back
                if caller is not None and caller.f_locals is not caller.f_globals:
                    definition.resolve_payload_model(caller.f_locals)
                del caller
            model = definition.payload_model
            if model is not None and model.__pydantic_complete__:
                check_empty_payload(definition)  # at once; Registry checks the rest
            self._jobs[qualified] = definition
            return handler

        return register

    def __repr__(self) -> str:
        return f"Feature({self.name!r}, jobs={list(self._jobs)})"


class Registry:
    """All jobs of an app, validated together. ``registry.jobs[qualified]``."""

    def __init__(self, features: Iterable[Feature]) -> None:
        jobs: dict[str, JobDefinition] = {}
        self.features: tuple[Feature, ...] = tuple(features)
        for feature in self.features:
            if not isinstance(feature, Feature):
                raise JobConfigError(
                    None, "Registry(features)", "must hold Feature objects", feature
                )
            for qualified, job in feature.jobs.items():
                if qualified in jobs:
                    raise JobConfigError(qualified, "name", "is declared by two features")
                settle_payload_model(job)
                jobs[qualified] = job
        self.jobs: Mapping[str, JobDefinition] = MappingProxyType(jobs)
        for job in jobs.values():
            for option in ("on_complete", "on_success"):
                callback = getattr(job.options, option)
                if callback is not None and callback not in jobs:
                    raise JobConfigError(
                        job.qualified_name, option, "names no declared job", callback
                    )
        events: dict[str, list[JobDefinition]] = {}
        for job in jobs.values():
            if job.event_name is not None:
                events.setdefault(job.event_name, []).append(job)
        self._events = {name: tuple(defs) for name, defs in events.items()}
        actors: dict[str, tuple[JobDefinition, bool]] = {}
        for job in jobs.values():
            actors[job.qualified_name] = (job, False)
            if job.options.per_tenant:
                actors[job.wrapper_actor_name] = (job, True)
        self._actors = actors

    def actor(self, actor_name: Any) -> tuple[JobDefinition, bool] | None:
        """``(job, is the per-tenant wrapper)`` of a kumiko actor name, else ``None``."""
        return self._actors.get(actor_name) if isinstance(actor_name, str) else None

    def jobs_for_event(self, event_name: str) -> tuple[JobDefinition, ...]:
        """Jobs whose trigger is ``Event(event_name)``, in declaration order."""
        return self._events.get(event_name, ())

    def __repr__(self) -> str:
        return f"Registry({list(self.jobs)})"


def _check_name(subject: str | None, what: str, value: Any) -> None:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise JobConfigError(subject, what, "must match [A-Za-z][A-Za-z0-9_-]*", value)
