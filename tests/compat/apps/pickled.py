"""Dramatiq's ``PickleEncoder`` as the global encoder (as Dramatiq's ``composition`` and
``results`` examples set it): arguments and results that JSON cannot carry pass between the
steps of a pipeline and come back through the results backend."""

from __future__ import annotations

from datetime import date, timedelta
from fractions import Fraction
from typing import Any

import dramatiq
from dramatiq.encoder import PickleEncoder

from tests.compat.apps.common import Context

dramatiq.set_encoder(PickleEncoder())


@dramatiq.actor
def halve(x: Fraction) -> Fraction:
    return x / 2


@dramatiq.actor(store_results=True)
def add_days(start: date, x: Fraction) -> date:
    return start + timedelta(days=int(x * 4))


def drive(ctx: Context) -> dict[str, Any]:
    with ctx.worker(threads=2):
        pipe = (
            halve.message(Fraction(3, 2)) | add_days.message_with_options(args=(date(2026, 1, 1),))
        ).run()
        result = pipe.get_result(block=True, timeout=30_000)
    return {"result": result.isoformat()}
