"""The fixtures Dramatiq's tests ask for, built on the broker under test (a pytest plugin).

Loaded with ``-p tests.compat.plugin`` by :mod:`tests.compat.run`, which sets
``KUMIKO_COMPAT_BROKER`` (``plain``: Dramatiq's ``RedisBroker``; ``kumiko``: the broker of
``JobRunner(Registry([]))``) and ``KUMIKO_COMPAT_REDIS_URL`` (a private redis-server, flushed
around every test as Dramatiq's own fixtures flush theirs). ``stub_broker`` and
``redis_broker`` are the same broker: the generic tests (actors, messages, results,
composition, worker, callbacks, middleware) run on Redis too. Result and rate-limit backends
are the Redis one (on the private server) and the stub one.

``test_broker.py`` imports ``RabbitmqBroker`` at module level; without ``pika`` (not a
dependency of kumiko) that import fails and takes the file's middleware tests with it, so
a stand-in module whose ``RabbitmqBroker`` raises ``ImportError`` when built (as the real one
would without ``pika``) lets the file load; its RabbitMQ tests fail on both brokers alike.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq import Broker, Worker
from dramatiq.brokers.redis import RedisBroker
from dramatiq.rate_limits import backends as rate_limit_backends
from dramatiq.results import backends as result_backends

from kumiko_dramatiq import JobRunner, Registry

BROKER = os.environ.get("KUMIKO_COMPAT_BROKER", "kumiko")
REDIS_URL = os.environ.get("KUMIKO_COMPAT_REDIS_URL", "")
_numbers = itertools.count()


class _NoRabbitmqBroker:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ImportError("pika is not installed: no RabbitMQ in the compatibility suite")


if importlib.util.find_spec("pika") is None:
    _stand_in = types.ModuleType("dramatiq.brokers.rabbitmq")
    _stand_in.RabbitmqBroker = _NoRabbitmqBroker  # type: ignore[attr-defined]
    sys.modules.setdefault("dramatiq.brokers.rabbitmq", _stand_in)


def _client() -> redis.Redis:
    if not REDIS_URL:
        raise RuntimeError("KUMIKO_COMPAT_REDIS_URL is not set: run python -m tests.compat.run")
    return redis.Redis.from_url(REDIS_URL)


@pytest.fixture
def _broker() -> Iterator[Broker]:
    client = _client()
    client.flushdb()
    runner: JobRunner | None = None
    broker: Broker
    if BROKER == "plain":
        broker = RedisBroker(url=REDIS_URL)  # type: ignore[no-untyped-call]
    else:
        runner = JobRunner(
            Registry([]), redis_url=REDIS_URL, queue_prefix=f"compat{next(_numbers)}"
        )
        broker = runner.broker
    broker.emit_after("process_boot")
    dramatiq.set_broker(broker)
    yield broker
    client.flushdb()
    if runner is not None:
        runner.stop()
    else:
        broker.close()
    client.close()


@pytest.fixture
def stub_broker(_broker: Broker) -> Broker:
    return _broker


@pytest.fixture
def redis_broker(_broker: Broker) -> Broker:
    return _broker


def _worker(broker: Broker, **options: Any) -> Iterator[Worker]:
    worker = Worker(broker, **options)
    worker.start()
    yield worker
    worker.stop()


@pytest.fixture
def stub_worker(stub_broker: Broker) -> Iterator[Worker]:
    yield from _worker(stub_broker, worker_timeout=100, worker_threads=32)


@pytest.fixture
def redis_worker(redis_broker: Broker) -> Iterator[Worker]:
    yield from _worker(redis_broker, worker_threads=32)


@pytest.fixture
def redis_result_backend() -> Any:
    return result_backends.RedisBackend(client=_client())


@pytest.fixture(params=["redis", "stub"])
def result_backend(request: pytest.FixtureRequest) -> Any:
    if request.param == "redis":
        return result_backends.RedisBackend(client=_client())
    return result_backends.StubBackend()


@pytest.fixture(params=["redis", "stub"])
def rate_limiter_backend(request: pytest.FixtureRequest) -> Any:
    if request.param == "redis":
        return rate_limit_backends.RedisBackend(client=_client())
    return rate_limit_backends.StubBackend()  # type: ignore[no-untyped-call]


@pytest.fixture
def pickle_encoder() -> Iterator[dramatiq.Encoder]:
    old = dramatiq.get_encoder()
    new = dramatiq.PickleEncoder()
    dramatiq.set_encoder(new)
    yield new
    dramatiq.set_encoder(old)
