"""Periodic actors scheduled by periodiq (``@dramatiq.actor(periodic=cron(...))``, its
``PeriodiqMiddleware`` on the broker and its ``periodiq`` scheduler process): the scheduler
sends an every-minute actor when it starts; a message scheduled long ago is skipped by the
middleware, and one sent by hand runs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import dramatiq
import pendulum
from periodiq import cron

from tests.compat.apps.common import BROKER, Context, of, record


@dramatiq.actor(periodic=cron("* * * * *"))
def every_minute() -> None:
    record("every_minute")


def drive(ctx: Context) -> dict[str, Any]:
    broker_module = "tests.compat.apps.plain" if BROKER == "plain" else "kumiko_dramatiq.app"
    scheduler = [str(Path(sys.executable).parent / "periodiq"), broker_module]
    with ctx.worker(threads=2):
        every_minute.send_with_options(
            scheduled_at=str(pendulum.now().subtract(minutes=5).replace(microsecond=0))
        )
        every_minute.send()
        seen = ctx.wait(lambda s: len(of(s, "processed")) == 1, "the message sent by hand")
        with ctx.process(scheduler):
            seen = ctx.wait(
                lambda s: len(of(s, "processed")) == 2 and len(of(s, "skipped")) == 1,
                "the scheduled run and the skipped stale message",
                timeout_s=30,
            )
    return {
        "ran": len(of(seen, "every_minute")),
        "skipped": [e["actor"] for e in of(seen, "skipped")],
    }
