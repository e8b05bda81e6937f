"""The one module that reads the environment: ``KUMIKO_*`` variables and ``KUMIKO_APP``.

:func:`resolve_settings` turns ``JobRunner`` arguments into
:class:`~kumiko_dramatiq.settings.Settings` (see there for the table): an argument not
given takes its ``KUMIKO_*`` variable when that is set, else its default. A variable that
does not parse is a :class:`~kumiko_dramatiq.errors.JobConfigError` naming the variable.
:mod:`kumiko_dramatiq.loader` loads ``KUMIKO_APP`` with what :func:`app_target` and
:func:`variable_values` read here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Final

from kumiko_dramatiq.errors import JobConfigError
from kumiko_dramatiq.settings import UNSET, Settings

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
    "KUMIKO_MAX_RESULT_BYTES": ("max_result_bytes", int),
    "KUMIKO_HISTORY_CAP": ("history_cap", int),
    "KUMIKO_IDEMPOTENCY_TTL_S": ("idempotency_ttl_s", int),
    "KUMIKO_METRICS_PORT": ("metrics_port", int),
    "KUMIKO_SHARDS": ("shards", int),
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


#: The dashboard's token: not a runner setting (so not in :data:`VARIABLES`, which feed
#: ``Settings`` and must agree with a ``KUMIKO_APP`` runner's own), read by the dashboard.
DASHBOARD_TOKEN: Final = "KUMIKO_DASHBOARD_TOKEN"


#: The shortest dashboard token accepted.
MIN_DASHBOARD_TOKEN_CHARS: Final = 16


def dashboard_token(environ: Mapping[str, str] | None = None) -> str | None:
    """``KUMIKO_DASHBOARD_TOKEN``, stripped; ``None`` when unset or empty; a
    ``JobConfigError`` naming the variable when it is too short (:func:`check_dashboard_token`).
    """
    return check_dashboard_token(raw_value(DASHBOARD_TOKEN, environ), DASHBOARD_TOKEN)


def check_dashboard_token(token: object, source: str = "token") -> str | None:
    """``token`` if it can guard the dashboard, ``None`` for none (``None`` or ""); else a
    ``JobConfigError`` naming ``source`` that never shows the token itself."""
    if token is None or token == "":
        return None
    if not isinstance(token, str):
        raise JobConfigError(None, source, "must be a string", type(token).__name__)
    if len(token) < MIN_DASHBOARD_TOKEN_CHARS:
        raise JobConfigError(
            None,
            source,
            f"must be at least {MIN_DASHBOARD_TOKEN_CHARS} characters (make one with: python -c "
            "'import secrets; print(secrets.token_urlsafe(24))')",
            f"{len(token)} characters",
        )
    return token


#: prometheus_client's multiprocess directory (see :mod:`kumiko_dramatiq.ops.exposition`).
PROMETHEUS_MULTIPROC_DIR: Final = "PROMETHEUS_MULTIPROC_DIR"


def multiproc_dir() -> str:
    """``PROMETHEUS_MULTIPROC_DIR`` as set in this process, stripped ("" when unset)."""
    return os.environ.get(PROMETHEUS_MULTIPROC_DIR, "").strip()


def set_multiproc_dir(path: str) -> None:
    """Set ``PROMETHEUS_MULTIPROC_DIR`` in this process, where prometheus_client reads it."""
    os.environ[PROMETHEUS_MULTIPROC_DIR] = path


#: The Redis that the fixtures of :mod:`kumiko_dramatiq.pytest_plugin` use: not a runner
#: setting (tests name it; runners get it from the fixture).
TEST_REDIS_URL: Final = "KUMIKO_TEST_REDIS_URL"


def redis_url_for_tests(environ: Mapping[str, str] | None = None) -> str | None:
    """``KUMIKO_TEST_REDIS_URL``, stripped; ``None`` when unset or empty."""
    return raw_value(TEST_REDIS_URL, environ) or None
