"""The one module that reads the environment: ``KUMIKO_*`` variables and ``KUMIKO_APP``.

:func:`resolve_settings` turns ``JobRunner`` arguments into
:class:`~kumiko_dramatiq.settings.Settings` (see there for the table): an argument not
given takes its ``KUMIKO_*`` variable when that is set, else its default. A variable that
does not parse is a :class:`~kumiko_dramatiq.errors.JobConfigError` naming the variable.
:mod:`kumiko_dramatiq.apps` loads ``KUMIKO_APP`` with what :func:`app_target` and
:func:`variable_values` read here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Final

from .errors import JobConfigError
from .settings import UNSET, Settings

#: ``KUMIKO_*`` variable -> (setting, parser).
VARIABLES: Final[dict[str, tuple[str, Callable[[str], Any]]]] = {
    "KUMIKO_REDIS_URL": ("redis_url", str),
    "KUMIKO_QUEUE_PREFIX": ("queue_prefix", str),
    "KUMIKO_LANE": ("lane", str),
    "KUMIKO_HEARTBEAT_TIMEOUT_MS": ("heartbeat_timeout_ms", int),
    "KUMIKO_MAINTENANCE_CHANCE": ("maintenance_chance", int),
    "KUMIKO_LOCK_TTL_MS": ("lock_ttl_ms", int),
    "KUMIKO_IDLE_WAIT_MS": ("idle_wait_ms", int),
    "KUMIKO_MAX_DELIVERIES": ("max_deliveries", int),
    "KUMIKO_MAX_PAYLOAD_BYTES": ("max_payload_bytes", int),
    "KUMIKO_HISTORY_CAP": ("history_cap", int),
}


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def variable_values(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings that set ``KUMIKO_*`` variables give, parsed (empty values are unset)."""
    env = _environ(environ)
    values: dict[str, Any] = {}
    for variable, (setting, parse) in VARIABLES.items():
        raw = env.get(variable, "").strip()
        if not raw:
            continue
        try:
            values[setting] = parse(raw)
        except ValueError:
            raise JobConfigError(None, variable, "must be an integer", raw) from None
    return values


def resolve_settings(
    explicit: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> Settings:
    """Settings from ``explicit`` arguments (``UNSET`` = not given), then variables, then
    defaults. Raises ``JobConfigError`` for a bad value, naming the variable it came from."""
    given = {name: value for name, value in explicit.items() if value is not UNSET}
    from_env = {k: v for k, v in variable_values(environ).items() if k not in given}
    try:
        return Settings(**from_env, **given)
    except JobConfigError as exc:
        variable = variable_for(exc.field)
        if exc.field in from_env and variable is not None:
            raise JobConfigError(None, variable, exc.problem, exc.value) from None
        raise


def app_target(environ: Mapping[str, str] | None = None) -> str:
    """``KUMIKO_APP``, stripped ("" when unset)."""
    return _environ(environ).get("KUMIKO_APP", "").strip()


def variable_for(setting: str) -> str | None:
    """The ``KUMIKO_*`` variable of ``setting``, if it has one."""
    return next((v for v, (s, _) in VARIABLES.items() if s == setting), None)


def raw_value(variable: str, environ: Mapping[str, str] | None = None) -> str:
    """The text of ``variable`` as set, stripped."""
    return _environ(environ).get(variable, "").strip()
