"""The middleware each app had added to its broker, given to both set-ups alike.

An app that added ``Results`` or ``Prometheus`` to its ``RedisBroker`` adds them to
``runner.broker`` once moved onto kumiko (docs/dramatiq.md); :func:`user_middleware` builds
them for either. :class:`~tests.compat.apps.common.Observed` comes last on both.
"""

from __future__ import annotations

from collections.abc import Callable

from dramatiq.encoder import PickleEncoder
from dramatiq.middleware import CurrentMessage, GroupCallbacks, Middleware
from dramatiq.middleware.prometheus import Prometheus
from dramatiq.rate_limits.backends import RedisBackend as RateLimitBackend
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend
from periodiq import PeriodiqMiddleware

from tests.compat.apps.common import URL


def _results() -> list[Middleware]:
    return [Results(backend=RedisBackend(url=URL))]


def _composition() -> list[Middleware]:
    return [
        Results(backend=RedisBackend(url=URL)),
        GroupCallbacks(RateLimitBackend(url=URL)),
    ]


def _pickled() -> list[Middleware]:
    return [Results(backend=RedisBackend(url=URL, encoder=PickleEncoder()))]


#: Per app (a module of this package), the middleware its broker carries besides Dramatiq's
#: defaults, built fresh for each broker.
MIDDLEWARE: dict[str, Callable[[], list[Middleware]]] = {
    "results": _results,
    "composition": _composition,
    "pickled": _pickled,
    "prometheus": lambda: [Prometheus()],
    "retries": lambda: [CurrentMessage()],
    "periodic": lambda: [PeriodiqMiddleware(skip_delay=30)],
}


def user_middleware(app: str) -> list[Middleware]:
    """The middleware ``app`` adds to its broker (none for most)."""
    build = MIDDLEWARE.get(app)
    return [] if build is None else build()
