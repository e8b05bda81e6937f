"""pytest fixtures for end-to-end tests of an app's jobs: a real Redis, a dataset per test.

Opt in from the project's root ``conftest.py`` (or with ``-p kumiko_dramatiq.pytest_plugin``)::

    pytest_plugins = ["kumiko_dramatiq.pytest_plugin"]

    def test_invoice_is_sent_after_two_gateway_errors(kumiko_runner):
        runner = kumiko_runner(registry)
        runner.dispatch("billing:job:send_invoice", {"invoice": "INV-7", "gateway_failures": 2})
        assert [run.status for run in runner.drain()] == ["failed", "failed", "completed"]

Fixtures (all named ``kumiko_*``, so they sit beside a project's own):

``kumiko_redis_url`` (session)
    ``KUMIKO_TEST_REDIS_URL`` when set (it must answer); else a private ``redis-server``
    started once for the session on a Unix socket, when one is on ``PATH``
    (:func:`~kumiko_dramatiq.testing.private_redis_server`); else the test errors with one line
    saying to set the one or install the other. Nothing starts unless a test asks for it.
``kumiko_queue_prefix``
    A queue prefix of this test's own (:func:`~kumiko_dramatiq.testing.new_queue_prefix`);
    every key of it is deleted before and after the test
    (:func:`~kumiko_dramatiq.testing.delete_dataset`).
``kumiko_runner``
    ``kumiko_runner(registry, **options) -> JobRunner``: a STARTED runner on that Redis and
    prefix; options are ``JobRunner``'s, with test-friendly defaults (:data:`RUNNER_DEFAULTS`)
    for those not given. Call it again for a second runner (say ``lane="api"``) on the same
    dataset. Every runner is stopped after the test, before its keys are deleted.

Why opt-in rather than a ``pytest11`` entry point: pytest imports every such entry point in
every session of the environment, and this module cannot be imported without the package
(Dramatiq, redis, pydantic, APScheduler: about 0.3 s), which a session that tests something
else should not pay.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from kumiko_dramatiq.broker.connection import client as redis_client
from kumiko_dramatiq.environment import TEST_REDIS_URL, redis_url_for_tests
from kumiko_dramatiq.errors import redact_url
from kumiko_dramatiq.registry import Registry
from kumiko_dramatiq.runner import JobRunner
from kumiko_dramatiq.testing import (
    RUNNER_DEFAULTS,
    RunnerFactory,
    delete_dataset,
    new_queue_prefix,
    private_redis_server,
)


@pytest.fixture(scope="session")
def kumiko_redis_url() -> Iterator[str]:
    """The Redis of this session's kumiko tests (see the module docstring)."""
    url = redis_url_for_tests()
    if url is not None:
        client = redis_client(url, timeout_s=2)
        try:
            client.ping()
        except redis.RedisError as exc:
            pytest.fail(f"{TEST_REDIS_URL}={redact_url(url)} does not answer: {exc}", pytrace=False)
        finally:
            client.close()
        yield url
        return
    if shutil.which("redis-server") is None:
        pytest.fail(
            f"kumiko_dramatiq's fixtures need a Redis: set {TEST_REDIS_URL} "
            "(e.g. redis://127.0.0.1:6379/15), or put redis-server on PATH "
            "(apt-get install redis-server) and they start a private one",
            pytrace=False,
        )
    with private_redis_server() as private_url:
        yield private_url


@pytest.fixture
def kumiko_queue_prefix(request: pytest.FixtureRequest, kumiko_redis_url: str) -> Iterator[str]:
    """A queue prefix of this test's own; its keys are deleted before and after the test."""
    prefix = new_queue_prefix(request.node.name)
    client = redis_client(kumiko_redis_url, timeout_s=10)
    try:
        delete_dataset(client, prefix)
        yield prefix
        delete_dataset(client, prefix)
    finally:
        client.close()


@pytest.fixture
def kumiko_runner(kumiko_redis_url: str, kumiko_queue_prefix: str) -> Iterator[RunnerFactory]:
    """``kumiko_runner(registry, **options)``: a started runner on this test's dataset."""
    runners: list[JobRunner] = []

    def start(registry: Registry, **options: Any) -> JobRunner:
        settings = {
            **RUNNER_DEFAULTS,
            "redis_url": kumiko_redis_url,
            "queue_prefix": kumiko_queue_prefix,
            **options,
        }
        runner = JobRunner(registry, **settings)
        runners.append(runner)
        runner.start()
        return runner

    yield start
    for runner in reversed(runners):
        runner.stop(timeout_s=10)
