"""Delayed messages (``send_with_options(delay=...)``) run in due order, none early; and
those that came due while the only worker thread was busy all run."""

from __future__ import annotations

import time
from typing import Any

import dramatiq

from tests.compat.apps.common import Context, of, record


@dramatiq.actor
def due(name: str, due_at: float) -> None:
    record("due", name=name, early=time.time() < due_at)


@dramatiq.actor
def busy(seconds: float) -> None:
    time.sleep(seconds)
    record("busy_done")


def drive(ctx: Context) -> dict[str, Any]:
    with ctx.worker(threads=1):
        now = time.time()
        for name, delay_ms in (("third", 1_500), ("second", 1_000), ("first", 500)):
            due.send_with_options(args=(name, now + delay_ms / 1000), delay=delay_ms)
        due.send("now", now)
        seen = ctx.wait(lambda s: len(of(s, "due")) == 4, "four messages")
        busy.send(1.5)
        now = time.time()
        for name, delay_ms in (("c", 900), ("b", 600), ("a", 300)):
            due.send_with_options(args=(name, now + delay_ms / 1000), delay=delay_ms)
        seen = ctx.wait(lambda s: len(of(s, "due")) == 7, "three more")
    ran = of(seen, "due")
    return {
        "order": [e["name"] for e in ran[:4]],
        # Dramatiq defines no order among messages that came due together while the worker
        # was busy (RedisBroker ran them b, a, c once): the set only
        "due_while_busy": sorted(e["name"] for e in ran[4:]),
        "early": [e["name"] for e in ran if e["early"]],
    }
