"""Building the app's ``JobRunner`` from the environment (worker CLI and scheduler).

``KUMIKO_APP``          ``"package.module:attribute"``: a ``Registry``, or a
                        ``JobRunner`` whose own settings then win (required)
``KUMIKO_REDIS_URL``    default ``redis://127.0.0.1:6379/0``
``KUMIKO_QUEUE_PREFIX`` default ``kumiko``
``KUMIKO_LANE``         default ``worker``

Every problem is an :class:`AppLoadError` with a one-line message that says
what to set; the entry points print it and exit with status 2.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping

from .errors import KumikoError
from .registry import Registry
from .runner import JobRunner

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class AppLoadError(KumikoError):
    """``KUMIKO_APP`` (or another variable) does not name a loadable app."""


def runner_from_environment(environ: Mapping[str, str] | None = None) -> JobRunner:
    """The runner the environment describes (it opens no connection)."""
    env = os.environ if environ is None else environ
    target = env.get("KUMIKO_APP", "").strip()
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
    try:
        app = getattr(module, attribute)
    except AttributeError:
        raise AppLoadError(
            f"KUMIKO_APP={target!r}: module {module_name!r} has no attribute {attribute!r}"
        ) from None
    if isinstance(app, JobRunner):
        return app
    if not isinstance(app, Registry):
        raise AppLoadError(
            f"KUMIKO_APP={target!r} is a {type(app).__name__}, not a Registry or a JobRunner"
        )
    try:
        return JobRunner(
            app,
            redis_url=env.get("KUMIKO_REDIS_URL") or DEFAULT_REDIS_URL,
            queue_prefix=env.get("KUMIKO_QUEUE_PREFIX") or "kumiko",
            lane=env.get("KUMIKO_LANE") or "worker",
        )
    except KumikoError as exc:
        raise AppLoadError(f"KUMIKO_APP={target!r}: {exc}") from None
