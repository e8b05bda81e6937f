"""Plain actors sent by a producer and run by CLI workers (Dramatiq's ``basic`` example)."""

from __future__ import annotations

from typing import Any

import dramatiq

from tests.compat.apps.common import Context, of, record

COUNT = 20


@dramatiq.actor
def add(x: int, y: int) -> None:
    record("add", total=x + y)


def drive(ctx: Context) -> dict[str, Any]:
    with ctx.worker(threads=4):
        for i in range(COUNT):
            add.send(i, 2 * i)
        seen = ctx.wait(lambda s: len(of(s, "processed")) == COUNT, f"{COUNT} adds")
    return {
        "totals": sorted(e["total"] for e in of(seen, "add")),
        "processed": sorted((e["actor"], e["error"]) for e in of(seen, "processed")),
    }
