"""Typed payloads: a pydantic model as a job's payload, validated at every edge.

**Which jobs are typed.** A job is typed when its handler's payload parameter (the first
positional one) is annotated with a bare subclass of pydantic's ``BaseModel``
(:func:`payload_model_of`). ``Optional[Model]``, ``Model | None``, ``Annotated[Model, ...]``,
``TypedDict``, ``dict``, ``BaseModel`` itself, no annotation and anything else leave the job
untyped: its handler receives the dict, exactly as before typed payloads.

**How an annotation is read.** Only the payload parameter's annotation is evaluated, so a
``ctx: JobContext`` imported under ``TYPE_CHECKING`` costs nothing. A string annotation
(``from __future__ import annotations``, a forward reference) that names a class (``Order``,
``models.Order``) is evaluated with ``typing.get_type_hints`` in the handler's module globals,
plus the names its closure holds and, when the job is declared inside a function (a test),
that function's local names; any other string (``dict[str, Any]``, ``Order | None``) cannot
be a bare model and is not evaluated.
A string that does not resolve when the job is declared (a model defined below its handler)
is tried again when the ``Registry`` is built; one that still does not resolve leaves the job
untyped and logs one WARNING naming the job and the error (:func:`settle_payload_model`).
Untyped, not a ``JobConfigError``: an app whose payload annotation names a ``TypedDict``
imported under ``TYPE_CHECKING`` ran before typed payloads and must keep running.

**Producer side** (:func:`payload_to_enqueue`): ``dispatch``, ``dispatch_many``,
``handle_event``, the cron tick, the boot-once job, a per-tenant wrapper's children and
``testing.run_job`` accept a dict or an instance of the job's model. A dict is validated
(``Model.model_validate``); then ``model.model_dump(mode="json")`` is what is enqueued, after
kumiko's own payload limits (:func:`~kumiko_dramatiq.limits.check_payload`) and one last
check that the model accepts that JSON as the worker will read it
(``Model.model_validate_json``; skipped for a plain model, :func:`is_plain_model`, which
accepts its own dump by construction), so nothing is enqueued that the worker would refuse
(a model whose aliases do not survive its own ``model_dump`` is refused at the dispatch,
naming why).

**Worker side** (:func:`load_payload`): the handler receives the model validated from the
queued payload, as JSON (``Model.model_validate_json``; for a plain model,
:func:`is_plain_model`, the same from the decoded dict, at half the cost). One that no
longer validates (the model changed under queued work) raises
:class:`~kumiko_dramatiq.errors.PayloadError`; the actor marks the attempt ``no_retry``
(:class:`~kumiko_dramatiq.context.JobMeta`), so it is dead-lettered at once with that error
in its run record and dead letter, spending no retry.

**Declaration** (:func:`check_empty_payload`): a cron job, a ``run_on_boot`` job or a boot
gate runs with the empty payload ``{}``; a model that rejects it is a ``JobConfigError``.

Errors are one line: the job, the field path (``payload.items[2].sku``, ``payloads[3].amount``
in a bulk dispatch), pydantic's message for the first error (shortened), the bad value
(at most 80 characters, never for a missing field or a whole-model error, so never the whole
payload; at run time only with ``record_payloads``, as run records and dead letters hold no
payload otherwise) and how many more errors there were.
"""

from __future__ import annotations

import inspect
import json
import logging
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Final

from pydantic import BaseModel, ValidationError
from pydantic_core import to_json

from kumiko_dramatiq.cron import Cron
from kumiko_dramatiq.errors import JobConfigError, PayloadError
from kumiko_dramatiq.limits import DEFAULT_MAX_PAYLOAD_BYTES, check_payload

if TYPE_CHECKING:
    from kumiko_dramatiq.registry import JobDefinition

logger = logging.getLogger("kumiko_dramatiq")

#: pydantic's message of an error is cut to this many characters.
MAX_MESSAGE_CHARS: Final = 160
#: The note of a run-time refusal.
STALE_NOTE: Final = "the queued payload no longer validates: dead-lettered without retry"

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class UnresolvedHint(Exception):
    """The payload parameter's annotation is a string that does not evaluate (yet)."""


# -- which jobs are typed --------------------------------------------------------------------
def payload_model_of(
    handler: Callable[..., Any], scope: Mapping[str, Any] | None = None
) -> type[BaseModel] | None:
    """The model a handler's payload parameter is annotated with, or ``None`` (untyped).

    ``scope``: more names a string annotation may use (the locals of the function that
    declared the job). Raises :class:`UnresolvedHint` when that annotation is a string that
    does not evaluate in the handler's namespace (see the module docstring).
    """
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):  # a builtin, or a callable without a signature
        return None
    parameters = list(signature.parameters.values())
    if not parameters or parameters[0].kind not in _POSITIONAL:
        return None
    parameter = parameters[0]
    annotation = parameter.annotation
    if annotation is inspect.Parameter.empty:
        return None
    if isinstance(annotation, str):
        text = _unquoted(annotation)
        if not all(part.isidentifier() for part in text.split(".")):
            return None  # `dict[str, Any]`, `Order | None`: never a bare model, not evaluated
        annotation = _evaluate(handler, parameter.name, text, scope or {})
    return annotation if is_payload_model(annotation) else None


def result_model_of(
    handler: Callable[..., Any], scope: Mapping[str, Any] | None = None
) -> type[BaseModel] | None:
    """The model a handler's return annotation names (a bare ``BaseModel`` subclass), or
    ``None``: its kept results are then plain JSON values. An annotation that does not
    evaluate is ``None`` too (its values are kept as JSON)."""
    try:
        annotation = inspect.signature(handler).return_annotation
    except (TypeError, ValueError):
        return None
    if isinstance(annotation, str):
        text = _unquoted(annotation)
        if not all(part.isidentifier() for part in text.split(".")):
            return None
        try:
            annotation = _evaluate(handler, "return", text, scope or {})
        except UnresolvedHint:
            return None
    return annotation if is_payload_model(annotation) else None


def _unquoted(text: str) -> str:
    """``"'Order'"`` (a quoted forward reference under ``from __future__ import
    annotations``) -> ``"Order"``."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1].strip()
    return text


def is_payload_model(annotation: Any) -> bool:
    """Whether ``annotation`` makes a job typed: a class, a strict subclass of ``BaseModel``."""
    return (
        isinstance(annotation, type)
        and issubclass(annotation, BaseModel)
        and annotation is not BaseModel
    )


def _evaluate(handler: Callable[..., Any], name: str, text: str, scope: Mapping[str, Any]) -> Any:
    holder = SimpleNamespace(__annotations__={name: text})
    try:
        globalns, closure = _namespaces(handler)
        localns = {**scope, **closure}
        return typing.get_type_hints(holder, globalns, localns, include_extras=True)[name]
    except Exception as exc:
        raise UnresolvedHint(f"{text!r}: {type(exc).__name__}: {exc}") from None


def _namespaces(handler: Callable[..., Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The globals of the module that defines ``handler``, and the names its closure holds."""
    target: Any = handler
    while isinstance(target, partial):
        target = target.func
    target = inspect.unwrap(target)
    module_name = getattr(target, "__module__", None)
    if not inspect.isclass(target) and not inspect.isroutine(target):
        module_name = type(target).__module__
        target = type(target).__call__  # a callable object: its method
    target = getattr(target, "__func__", target)  # a bound method
    globalns = getattr(target, "__globals__", None)
    if not isinstance(globalns, dict):
        module = sys.modules.get(module_name) if isinstance(module_name, str) else None
        globalns = dict(vars(module)) if module is not None else {}
    localns: dict[str, Any] = {}
    if inspect.isfunction(target):
        for free, cell in zip(target.__code__.co_freevars, target.__closure__ or (), strict=False):
            try:
                localns[free] = cell.cell_contents
            except ValueError:  # a name the enclosing function has not bound yet
                continue
    return globalns, localns


def settle_payload_model(job: JobDefinition) -> None:
    """Finish a job's payload model once the app's modules are loaded (``Registry`` calls
    this for every job):

    - an annotation left unresolved at declaration is resolved again; still unresolved:
      the job is untyped, one WARNING;
    - a model that is not fully defined yet (a nested model defined below it) is rebuilt;
      one that cannot be is a ``JobConfigError``;
    - :func:`is_plain_model` decides, once, how its dumps and payloads are validated;
    - :func:`check_empty_payload`.
    """
    if job.payload_hint_problem is not None:
        job.resolve_payload_model()
        if job.payload_hint_problem is not None:
            logger.warning(
                "%s: the payload annotation does not resolve (%s), so the job is untyped (its "
                "handler receives a dict); define or import the model at module level",
                job.qualified_name,
                job.payload_hint_problem,
            )
    model = job.payload_model
    if model is None:
        return
    if not model.__pydantic_complete__:
        try:
            model.model_rebuild(raise_errors=True)
        except Exception as exc:
            raise JobConfigError(
                job.qualified_name,
                "payload model",
                f"{model.__name__} is not fully defined: {_one_line(str(exc))}",
            ) from None
    job.set_payload_model_plain(is_plain_model(model))
    check_empty_payload(job)


#: Core schema keys (with a truthy value) that make a model not plain: aliases, custom
#: serializers, excluded or computed fields, strictness, a custom ``__init__``.
_NOT_PLAIN_KEYS: Final = frozenset(
    {
        "validation_alias",
        "serialization_alias",
        "serialization",
        "serialization_exclude",
        "serialization_exclude_if",
        "computed_fields",
        "strict",
        "custom_init",
    }
)
#: Core schema types that make a model not plain: validators that see the raw input, and
#: schemas that validate Python input differently from JSON.
_NOT_PLAIN_TYPES: Final = frozenset(
    {
        "function-before",
        "function-wrap",
        "function-plain",
        "json-or-python",
        "lax-or-strict",
        "is-instance",
        "is-subclass",
        "callable",
    }
)


def is_plain_model(model: type[BaseModel]) -> bool:
    """Whether ``model`` is plain: built from fields, nested models, containers, defaults and
    after-validators over pydantic's own types (``int``, ``str``, ``datetime``, ``Decimal``,
    ``UUID``, enums, literals, unions, ...).

    A plain model accepts its own ``model_dump(mode="json")`` by construction, and validates
    a decoded JSON payload in Python mode exactly as ``model_validate_json`` would: so
    dispatch does not re-validate its dump, and a worker validates the decoded dict directly
    (half the cost). Anything in its pydantic core schema that can break either
    (:data:`_NOT_PLAIN_KEYS`, :data:`_NOT_PLAIN_TYPES`, ``ser_json_*``/``val_json_*``
    settings) or a schema that cannot be read makes it not plain: every dump is re-validated
    as JSON, and a worker validates JSON (``Model.model_validate_json``).
    """
    try:
        schema: Any = model.__pydantic_core_schema__
        stack: list[Any] = [schema]
    except Exception:
        return False
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key in _NOT_PLAIN_KEYS and value:
                return False
            if key == "type" and value in _NOT_PLAIN_TYPES:
                return False
            if (
                key == "config"
                and isinstance(value, dict)
                and any(k.startswith(("ser_json", "val_json")) for k in value)
            ):
                return False
            if isinstance(value, dict | list):
                stack.append(value)
    return True


def check_empty_payload(job: JobDefinition) -> None:
    """A typed cron job, ``run_on_boot`` job or boot gate runs with ``{}``: its model must
    accept it (``JobConfigError`` naming the job, the model and the field)."""
    model = job.payload_model
    if model is None:
        return
    options = job.options
    if options.boot_gate:
        what = "a boot gate"
    elif options.run_on_boot:
        what = "a run_on_boot job"
    elif isinstance(options.trigger, Cron):
        what = "a cron job"
    else:
        return
    try:
        empty_payload(job)
    except PayloadError as exc:
        detail = f"{exc.path} {exc.problem}" + ("" if exc.note is None else f"; {exc.note}")
        raise JobConfigError(
            job.qualified_name,
            "payload model",
            f"{model.__name__} must accept the empty payload {{}}: {what} runs with it ({detail})",
        ) from None


# -- producer side -----------------------------------------------------------------------------
def payload_to_enqueue(
    job: JobDefinition, payload: Any, *, max_bytes: int, path: str = "payload"
) -> dict[str, Any]:
    """What an enqueue path enqueues for ``payload``: an untyped job's payload within the
    limits, a typed job's ``model_dump(mode="json")``; else :class:`PayloadError`."""
    model = job.payload_model
    if model is None:
        return check_payload(job.qualified_name, payload, max_bytes=max_bytes, path=path)
    return model_to_enqueue(
        job.qualified_name,
        model,
        payload,
        max_bytes=max_bytes,
        path=path,
        check_dump=not job.payload_model_plain,
    )


def model_to_enqueue(
    job_name: str,
    model: type[BaseModel],
    payload: Any,
    *,
    max_bytes: int,
    path: str,
    check_dump: bool = True,
) -> dict[str, Any]:
    """:func:`payload_to_enqueue` for a job typed with ``model``. ``check_dump``: re-validate
    the dump as a worker will read it (unless :func:`is_plain_model`; always for an
    instance, which may have been built without validation)."""
    given_instance = isinstance(payload, BaseModel)
    if isinstance(payload, BaseModel):
        if not isinstance(payload, model):
            raise PayloadError(
                job_name,
                path,
                f"must be a dict or an instance of {model.__name__}, not {type(payload).__name__}",
            )
        instance: BaseModel = payload
    else:
        if payload is None:
            payload = {}
        if not isinstance(payload, dict):
            raise PayloadError(
                job_name,
                path,
                f"must be a JSON object (dict) or an instance of {model.__name__}",
                payload,
            )
        try:
            instance = model.model_validate(payload)
        except ValidationError as exc:
            raise validation_error(job_name, model, exc, path) from None
    body = check_payload(job_name, _dump(job_name, instance, path), max_bytes=max_bytes, path=path)
    if not (check_dump or given_instance):
        return body
    try:
        model.model_validate_json(to_json(body))  # pydantic's encoder: 5x json.dumps's speed
    except ValidationError as exc:
        note = (
            None
            if given_instance
            else f"{model.__name__} does not accept its own model_dump(mode='json')"
        )
        raise validation_error(job_name, model, exc, path, note=note) from None
    return body


def event_payload(event_name: str, payload: Any, *, max_bytes: int) -> dict[str, Any]:
    """An event's payload as the dict its untyped jobs enqueue and its ``dedup_key``
    functions receive: the dict within the limits, or an instance's
    ``model_dump(mode="json")``."""
    subject = f"event {event_name}"
    if isinstance(payload, BaseModel):
        payload = _dump(subject, payload, "payload")
    return check_payload(subject, payload, max_bytes=max_bytes)


def empty_payload(
    job: JobDefinition, *, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> dict[str, Any]:
    """What a cron tick, a boot-once job or a boot gate runs ``job`` with: ``{}``, or for a
    typed job its model's ``model_dump(mode="json")`` of ``{}`` (its defaults)."""
    return payload_to_enqueue(job, {}, max_bytes=max_bytes)


def _dump(subject: str, instance: BaseModel, path: str) -> dict[str, Any]:
    try:
        # warnings=False: a model_construct()ed instance with a bad value is refused by the
        # validation that follows, naming the field, instead of warning here
        return instance.model_dump(mode="json", warnings=False)
    except Exception as exc:  # pydantic's PydanticSerializationError, a failing serializer
        raise PayloadError(
            subject, path, f"does not serialise to JSON: {_one_line(str(exc))}"
        ) from None


# -- worker side -------------------------------------------------------------------------------
def load_payload(
    job: JobDefinition,
    payload: dict[str, Any],
    *,
    note: str | None = None,
    show_value: bool = True,
) -> Any:
    """What ``job``'s handler receives for the queued ``payload``: the dict (untyped), or
    the model validated from it (:func:`is_plain_model`: ``Model.model_validate`` of the
    decoded dict; else ``Model.model_validate_json`` of its JSON); :class:`PayloadError`
    when it does not validate. ``show_value=False`` leaves the bad value out of the error: a
    worker's error goes to the run record and the dead letter, which hold no payload unless
    ``record_payloads``."""
    model = job.payload_model
    if model is None:
        return payload
    try:
        if job.payload_model_plain:
            return model.model_validate(payload)
        return model.model_validate_json(to_json(payload))
    except ValidationError as exc:
        raise validation_error(
            job.qualified_name, model, exc, "payload", note=note, show_value=show_value
        ) from None


# -- errors ------------------------------------------------------------------------------------
def validation_error(
    job_name: str,
    model: type[BaseModel],
    error: ValidationError,
    root: str,
    *,
    note: str | None = None,
    show_value: bool = True,
) -> PayloadError:
    """One line for pydantic's ``error``: the first error's field path under ``root``, its
    message (shortened) and bad value (unless ``show_value`` is false); how many more errors
    there were."""
    errors = error.errors(include_url=False, include_context=False)
    if not errors:  # pydantic always has one; a custom error type might not
        return PayloadError(job_name, root, f"is invalid for {model.__name__}", note=note)
    first = errors[0]
    loc: Sequence[Any] = first.get("loc", ())
    shown = show_value and loc and first.get("type") != "missing"
    value = first.get("input", ...) if shown else ...
    notes = [note] if note is not None else []
    if len(errors) > 1:
        more = len(errors) - 1
        notes.insert(0, f"and {more} more error{'s' if more > 1 else ''}")
    return PayloadError(
        job_name,
        root + field_path(loc),
        f"is invalid for {model.__name__}: {_one_line(str(first.get('msg', '')))}",
        value,
        note="; ".join(notes) or None,
    )


def field_path(loc: Sequence[Any]) -> str:
    """pydantic's error location as a path: ``("items", 2, "sku")`` -> ``.items[2].sku``."""
    parts = []
    for part in loc:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif isinstance(part, str) and part.isidentifier():
            parts.append(f".{part}")
        else:
            parts.append(f"[{part!r}]")
    return "".join(parts)


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


# -- the schema that `kumiko jobs` and the dashboard show --------------------------------------
@dataclass(frozen=True)
class PayloadField:
    """One field of a typed job's payload, from its model's JSON schema."""

    name: str
    type: str
    required: bool

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "required": self.required}


def schema_fields(model: type[BaseModel]) -> list[PayloadField]:
    """The top-level fields of ``model``'s JSON schema (validation mode: the names a payload
    carries), in declaration order; ``[]`` when pydantic cannot build its schema."""
    try:
        schema = model.model_json_schema()
    except Exception as exc:  # a field type without a JSON schema
        logger.debug("no JSON schema for %s: %s", model.__name__, exc)
        return []
    properties = schema.get("properties", {})
    required = set(schema.get("required", ()))
    return [
        PayloadField(name, schema_type(spec), name in required) for name, spec in properties.items()
    ]


def schema_type(spec: Mapping[str, Any]) -> str:
    """A short type for one JSON schema: ``integer``, ``string | null``, ``array[Address]``,
    ``string (date-time)``, ``'a' | 'b'``."""
    if "$ref" in spec:
        return str(spec["$ref"]).rsplit("/", 1)[-1]
    for key in ("anyOf", "oneOf"):
        if key in spec:
            return " | ".join(schema_type(each) for each in spec[key])
    if "allOf" in spec and len(spec["allOf"]) == 1:
        return schema_type(spec["allOf"][0])
    if "const" in spec:
        return json.dumps(spec["const"])
    if "enum" in spec:
        return " | ".join(json.dumps(each) for each in spec["enum"])
    kind = spec.get("type")
    if isinstance(kind, list):
        return " | ".join(str(each) for each in kind)
    if kind == "array" and isinstance(spec.get("items"), Mapping):
        return f"array[{schema_type(spec['items'])}]"
    if kind == "object" and isinstance(spec.get("additionalProperties"), Mapping):
        return f"object[{schema_type(spec['additionalProperties'])}]"
    if kind is None:
        return "any"
    fmt = spec.get("format")
    return f"{kind} ({fmt})" if fmt else str(kind)
