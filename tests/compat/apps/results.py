"""Results stored by the ``Results`` middleware and read by the producer (Dramatiq's
``results`` example)."""

from __future__ import annotations

import time
from typing import Any

import dramatiq
from dramatiq.results import ResultFailure

from tests.compat.apps.common import Context


@dramatiq.actor(store_results=True)
def sleep_then_add(t: float, x: int, y: int) -> int:
    time.sleep(t)
    return x + y


@dramatiq.actor(store_results=True, max_retries=0)
def refuses(x: int) -> int:
    raise ValueError(f"refused {x}")


def drive(ctx: Context) -> dict[str, Any]:
    with ctx.worker(threads=4):
        sent = [sleep_then_add.send(0.05 * (i % 3), i, 10 * i) for i in range(8)]
        results = [m.get_result(block=True, timeout=30_000) for m in sent]
        failed = refuses.send(7)
        try:
            failed.get_result(block=True, timeout=30_000)
            failure = None
        except ResultFailure as exc:
            failure = [exc.orig_exc_type, exc.orig_exc_msg]
    return {"results": results, "failure": failure}
