"""The helpers Dramatiq's tests import from their package's ``common`` module.

Dramatiq's sdist ships its ``tests/test_*.py`` without the ``common.py`` (nor the
``conftest.py``) they import from, so the harness (:mod:`tests.compat.run`) copies this
module into the unpacked suite as ``dramatiq_tests/common.py``. Written for kumiko from the
names the tests use; nothing here is Dramatiq's.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from dramatiq import Broker, Worker


@contextmanager
def worker(broker: Broker, **options: Any) -> Iterator[Worker]:
    """A started :class:`dramatiq.Worker` on ``broker``, stopped on the way out."""
    started = Worker(broker, **options)
    try:
        started.start()
        yield started
    finally:
        started.stop()


#: The suite runs against a private redis-server only: no RabbitMQ.
RABBITMQ_USERNAME = os.environ.get("RABBITMQ_USERNAME", "guest")
RABBITMQ_PASSWORD = os.environ.get("RABBITMQ_PASSWORD", "guest")
RABBITMQ_CREDENTIALS: Any = None

skip_in_ci = pytest.mark.skipif(bool(os.environ.get("CI")), reason="skipped in CI")
skip_on_windows = pytest.mark.skipif(platform.system() == "Windows", reason="not on Windows")
skip_on_pypy = pytest.mark.skipif(platform.python_implementation() == "PyPy", reason="not on PyPy")
skip_unless_rabbit_mq = pytest.mark.skip(reason="no RabbitMQ in the compatibility suite")
