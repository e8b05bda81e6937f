"""``async def`` actors under Dramatiq's ``AsyncIO`` middleware (Dramatiq's ``asyncio``
example): the module adds the middleware to the global broker at import, as the example does.
"""

from __future__ import annotations

import asyncio
from typing import Any

import dramatiq
from dramatiq.middleware.asyncio import AsyncIO

from tests.compat.apps.common import Context, of, record

COUNT = 20

dramatiq.get_broker().add_middleware(AsyncIO())


@dramatiq.actor
async def add(x: int, y: int) -> None:
    await asyncio.sleep(0.05)
    record("add", total=x + y)


@dramatiq.actor(max_retries=0)
async def fails() -> None:
    await asyncio.sleep(0)
    raise ValueError("async failure")


def drive(ctx: Context) -> dict[str, Any]:
    with ctx.worker(threads=4):
        for i in range(COUNT):
            add.send(i, i)
        fails.send()
        seen = ctx.wait(lambda s: len(of(s, "processed")) == COUNT + 1, f"{COUNT + 1} messages")
    return {
        "totals": sorted(e["total"] for e in of(seen, "add")),
        "failed": [(e["actor"], e["error"]) for e in of(seen, "processed", actor="fails")],
    }
