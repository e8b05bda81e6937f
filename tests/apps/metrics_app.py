"""Jobs for the metrics tests that run workers in other processes.

``KUMIKO_APP=tests.apps.metrics_app:registry``:

- ``metered:job:meet``: adds its process id to ``kumiko:{prefix}:test:meet`` and waits (at
  most 30 s) until ``payload["processes"]`` different processes are there: run by workers of
  one thread each, N such messages run in N processes at once;
- ``metered:job:tick``: a cron job every second, for the scheduler;
- ``metered:job:poison``: ends its worker process.

:func:`run_one_and_die` is the body of a process that starts a runner with metrics, waits
for one run of ``metered:job:ok`` and dies without stopping (as a killed worker would).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

from kumiko_dramatiq import Cron, Feature, JobContext, JobRunner, Registry

feature = Feature("metered")


def meet_key(prefix: str) -> str:
    return f"kumiko:{prefix}:test:meet"


@feature.job("meet")
def meet(payload: dict[str, Any], ctx: JobContext) -> None:
    client = redis.Redis.from_url(os.environ["KUMIKO_REDIS_URL"])
    key = meet_key(os.environ["KUMIKO_QUEUE_PREFIX"])
    client.sadd(key, os.getpid())
    deadline = time.monotonic() + 30
    while client.scard(key) < payload["processes"] and time.monotonic() < deadline:
        time.sleep(0.02)  # a barrier between processes, inside the job


@feature.job("tick", trigger=Cron("* * * * * *"))
def tick(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


@feature.job("poison")
def poison(payload: dict[str, Any], ctx: JobContext) -> None:
    os._exit(1)


@feature.job("ok")
def ok(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


registry = Registry([feature])


def run_one_and_die(redis_url: str, prefix: str, port: int, completed: int) -> None:
    """Run ``metered:job:ok`` with metrics on ``port`` until ``completed`` runs of it are
    recorded, then die without stopping (the ack writes the record after every after-hook,
    the counting ones included)."""
    runner = JobRunner(
        registry, redis_url=redis_url, queue_prefix=prefix, worker_threads=1, metrics_port=port
    )
    runner.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if len(runner.runs("metered:job:ok", status="completed")) >= completed:
            break
        time.sleep(0.02)
    os._exit(0)
