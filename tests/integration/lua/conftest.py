"""The ``env`` fixture of the state tables: one test's scripts, client and key names."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from kumiko_dramatiq.broker.lua import LuaScripts
from tests.integration.lua.tables import HEARTBEATS, Env


@pytest.fixture
def env(redis_client: redis.Redis, prefix: str) -> Iterator[Env]:
    names = {
        "p": prefix,
        "q": f"{prefix}-worker",
        "w0": f"{prefix}-w0",  # the dead worker of the maintenance rows
        "w1": f"{prefix}-w1",  # the worker running the command
        "w2": f"{prefix}-w2",  # another (live) worker
    }
    environment = Env(redis_client, LuaScripts.register(redis_client), prefix, names)
    yield environment
    redis_client.zrem(HEARTBEATS, *environment.workers)
