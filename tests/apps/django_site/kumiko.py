"""The project's kumiko runner, and the factory ``DRAMATIQ_BROKER["BROKER"]`` names."""

from __future__ import annotations

from django.conf import settings
from dramatiq.broker import Broker
from dramatiq.middleware import Middleware

from kumiko_dramatiq import JobRunner
from tests.apps.django_site.shop.jobs import registry

runner = JobRunner(
    registry,
    redis_url=settings.KUMIKO_REDIS_URL,
    queue_prefix=settings.KUMIKO_QUEUE_PREFIX,
)


def broker(middleware: list[Middleware]) -> Broker:
    """django_dramatiq calls this with the middleware it built from ``MIDDLEWARE``."""
    for each in middleware:
        runner.broker.add_middleware(each)
    return runner.broker
