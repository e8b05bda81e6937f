"""Dramatiq's ``Prometheus`` middleware under the CLI: its exposition server (forked by the
CLI) counts messages, errors, retries and dead letters per actor."""

from __future__ import annotations

import socket
import time
import urllib.request
from typing import Any

import dramatiq

from tests.compat.apps.common import Context, of

METRICS = (
    "dramatiq_messages_total",
    "dramatiq_message_errors_total",
    "dramatiq_message_retries_total",
    "dramatiq_message_rejects_total",
)


@dramatiq.actor
def count(n: int) -> None:
    return None


@dramatiq.actor(max_retries=1, min_backoff=20, max_backoff=50)
def broken() -> None:
    raise RuntimeError("broken")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """The samples of :data:`METRICS`, by ``metric{actor}``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name in METRICS and 'actor_name="' in rest:
            actor = rest.split('actor_name="', 1)[1].split('"', 1)[0]
            samples[f"{name}{{{actor}}}"] = float(line.rsplit(" ", 1)[1])
    return samples


def drive(ctx: Context) -> dict[str, Any]:
    port = free_port()
    env = {"dramatiq_prom_host": "127.0.0.1", "dramatiq_prom_port": str(port)}
    with ctx.worker(threads=2, env=env):
        for n in range(5):
            count.send(n)
        broken.send()
        ctx.wait(
            lambda s: len(of(s, "processed", actor="count")) == 5 and len(of(s, "dead")) == 1,
            "five counts and a dead letter",
        )
        # the counters follow the events by a hook or two: wait for the last ones to move
        # (messages_total moves last in Prometheus' after_process_message)
        wanted = {
            "dramatiq_messages_total{count}": 5.0,
            "dramatiq_messages_total{broken}": 2.0,
            "dramatiq_message_rejects_total{broken}": 1.0,
        }
        deadline = time.monotonic() + 30
        while True:
            try:
                samples = scrape(port)
            except OSError:
                samples = {}
            settled = all(samples.get(name) == value for name, value in wanted.items())
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    return {"samples": samples}
