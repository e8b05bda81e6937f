"""A long task that saves its state when the worker shuts down and resumes from it on the
next run (Dramatiq's ``persistent`` example: ``notify_shutdown`` and ``Shutdown``), its state
in Redis instead of files."""

from __future__ import annotations

import json
import time
from typing import Any

import dramatiq
from dramatiq.middleware import Shutdown

from tests.compat.apps.common import Context, client, of, record

N = 60


def state_key(n: int) -> str:
    return f"compat-apps:fib-state:{n}"


@dramatiq.actor(time_limit=float("inf"), notify_shutdown=True, max_retries=0)
def fib(n: int) -> None:
    saved = client().get(state_key(n))
    first, x2, x1 = (1, 1, 0) if saved is None else json.loads(saved)
    record("resumed" if saved is not None else "started", i=first)
    state = [first, x2, x1]
    try:
        for i in range(first, n + 1):
            state = [i, x2, x1]
            x2, x1 = x1, x2 + x1
            record("step", i=i)
            time.sleep(0.05)
        client().delete(state_key(n))
        record("done", result=x1)
    except Shutdown:
        client().set(state_key(n), json.dumps(state))
        record("saved")


def drive(ctx: Context) -> dict[str, Any]:
    with ctx.worker(threads=1):
        fib.send(N)
        ctx.wait(lambda s: len(of(s, "step")) >= 5, "a few steps")
    # the worker stopped (SIGTERM): the actor was told to shut down and saved its state
    with ctx.worker(threads=1):
        fib.send(N)
        seen = ctx.wait(lambda s: len(of(s, "done")) == 1, "the resumed run to finish")
    steps = [e["i"] for e in of(seen, "step")]
    return {
        "saved": len(of(seen, "saved")),
        "resumed": len(of(seen, "resumed")),
        "result": of(seen, "done")[0]["result"],
        "every_step_once_or_twice": sorted(set(steps)) == list(range(1, N + 1))
        and len(steps) <= N + 1,
    }
