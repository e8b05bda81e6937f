"""Loading the app ``KUMIKO_APP`` names (the worker CLI, the scheduler and ``kumiko``).

``KUMIKO_APP`` is ``"package.module:attribute"``: a ``Registry``, which gets a runner built
from the ``KUMIKO_*`` variables, or a ``JobRunner``, which keeps its own settings; then every
``KUMIKO_*`` variable that is set must agree with them, or loading fails naming both values
(never silently ignored). Every problem is an :class:`~kumiko_dramatiq.errors.AppLoadError`
with a one-line message that says what to set.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from .environment import app_target, raw_value, variable_for, variable_values
from .errors import AppLoadError, KumikoError
from .registry import Registry
from .runner import JobRunner


def check_runner_agrees(runner: JobRunner, environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`AppLoadError` if a set ``KUMIKO_*`` variable disagrees with ``runner``."""
    for setting, value in variable_values(environ).items():
        own = getattr(runner.settings, setting)
        if own != value:
            variable = variable_for(setting)
            assert variable is not None
            raise AppLoadError(
                f"{variable}={raw_value(variable, environ)} disagrees with the JobRunner's "
                f"{setting}={own!r} (KUMIKO_APP={app_target(environ)}): unset {variable} "
                "or make them equal"
            )


def load_runner(environ: Mapping[str, str] | None = None) -> JobRunner:
    """The runner ``KUMIKO_APP`` names (it opens no connection)."""
    target = app_target(environ)
    if not target:
        raise AppLoadError(
            "KUMIKO_APP is not set: set it to 'package.module:attribute', "
            "naming a kumiko_dramatiq Registry or JobRunner"
        )
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise AppLoadError(
            f"KUMIKO_APP={target!r} must look like 'package.module:attribute' "
            "(a Registry or a JobRunner)"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AppLoadError(
            f"KUMIKO_APP={target!r}: cannot import module {module_name!r} ({exc}); "
            "check the name and that it is on PYTHONPATH"
        ) from None
    except Exception as exc:  # the app's own module failed: a syntax error, a raise, ...
        where = f" ({exc.filename}, line {exc.lineno})" if isinstance(exc, SyntaxError) else ""
        detail = " ".join(str(exc).split())
        raise AppLoadError(
            f"KUMIKO_APP={target!r}: importing module {module_name!r} raised "
            f"{type(exc).__name__}: {detail}{where}"
        ) from None
    try:
        app = getattr(module, attribute)
    except AttributeError:
        raise AppLoadError(
            f"KUMIKO_APP={target!r}: module {module_name!r} has no attribute {attribute!r}"
        ) from None
    if isinstance(app, JobRunner):
        check_runner_agrees(app, environ)
        return app
    if not isinstance(app, Registry):
        raise AppLoadError(
            f"KUMIKO_APP={target!r} is a {type(app).__name__}, not a Registry or a JobRunner"
        )
    try:
        return JobRunner(app, **variable_values(environ))
    except KumikoError as exc:
        raise AppLoadError(f"KUMIKO_APP={target!r}: {exc}") from None
