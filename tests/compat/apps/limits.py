"""Time limits and age limits (Dramatiq's ``time_limit`` and ``long_running`` examples, and
``AgeLimit``): an actor interrupted at its ``time_limit`` and retried, one that catches
``TimeLimitExceeded`` and ends well, one whose long ``time_limit`` lets it finish, and a
message older than its actor's ``max_age`` when it comes due, which is skipped."""

from __future__ import annotations

import time
from typing import Any

import dramatiq
from dramatiq.middleware.time_limit import TimeLimitExceeded

from tests.compat.apps.common import Context, of, record


@dramatiq.actor(time_limit=500, max_retries=1, min_backoff=20, max_backoff=50)
def long_running() -> None:
    while True:
        time.sleep(0.05)


@dramatiq.actor(time_limit=500, max_retries=0)
def long_running_with_catch() -> None:
    try:
        while True:
            time.sleep(0.05)
    except TimeLimitExceeded:
        record("caught")


@dramatiq.actor(time_limit=86_400_000, max_retries=0)
def takes_its_time(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    record("finished", seconds=seconds)


@dramatiq.actor(max_age=1_000)
def fresh_only(n: int) -> None:
    record("fresh", n=n)


def drive(ctx: Context) -> dict[str, Any]:
    with ctx.worker(threads=4):
        long_running.send()
        long_running_with_catch.send()
        takes_its_time.send(1.5)
        fresh_only.send(1)
        fresh_only.send_with_options(args=(2,), delay=1_500)
        seen = ctx.wait(
            lambda s: (
                len(of(s, "dead", actor="long_running")) == 1
                and len(of(s, "processed", actor="long_running_with_catch")) == 1
                and len(of(s, "finished")) == 1
                and len(of(s, "skipped")) == 1
                and len(of(s, "fresh")) == 1
                and len(of(s, "dead")) == 2
            ),
            "every limit to act",
        )
    return {
        "long_running": [
            (e["retries"], e["error"]) for e in of(seen, "processed", actor="long_running")
        ],
        "dead": sorted(e["actor"] for e in of(seen, "dead")),
        "with_catch": [e["error"] for e in of(seen, "processed", actor="long_running_with_catch")],
        "finished": [e["seconds"] for e in of(seen, "finished")],
        "fresh": [e["n"] for e in of(seen, "fresh")],
        "skipped": [(e["actor"], e["args"]) for e in of(seen, "skipped")],
    }
