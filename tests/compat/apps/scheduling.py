"""Messages sent on a schedule by a separate APScheduler process (Dramatiq's ``scheduling``
example, every second instead of every minute): :mod:`.clock` is that process."""

from __future__ import annotations

import sys
from datetime import datetime
from typing import Any

import dramatiq

from tests.compat.apps.common import Context, of, record

TICKS = 3


@dramatiq.actor
def print_current_date(scheduled: str) -> None:
    record("tick", scheduled=scheduled, at=datetime.now().isoformat())


def drive(ctx: Context) -> dict[str, Any]:
    with ctx.worker(threads=2), ctx.process([sys.executable, "-m", "tests.compat.apps.clock"]):
        seen = ctx.wait(lambda s: len(of(s, "tick")) >= TICKS, f"{TICKS} ticks", timeout_s=30)
    ticks = [e["scheduled"] for e in of(seen, "tick")][:TICKS]
    return {"ticks": len(ticks), "each_second_once": len(set(ticks)) == len(ticks)}
