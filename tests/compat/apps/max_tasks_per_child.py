"""A middleware that makes the CLI restart its worker processes after N tasks (Dramatiq's
``max_tasks_per_child`` example): the module keeps ``dramatiq.get_broker()`` from its import
and adds the middleware through that reference."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import dramatiq
from dramatiq.broker import Broker
from dramatiq.middleware import Middleware

from tests.compat.apps.common import Context, of, record

MAX_TASKS = 4
COUNT = 10


class MaxTasksPerChild(Middleware):
    """Asks the CLI's main process to restart the workers (SIGHUP) after ``max_tasks``."""

    def __init__(self, max_tasks: int) -> None:
        self.lock = threading.Lock()
        self.left = max_tasks
        self.signalled = False

    def after_process_message(
        self, broker: Broker, message: Any, *, result: Any = None, exception: Any = None
    ) -> None:
        with self.lock:
            self.left -= 1
            if self.left <= 0 and not self.signalled:
                self.signalled = True
                os.kill(os.getppid(), signal.SIGHUP)


broker = dramatiq.get_broker()
broker.add_middleware(MaxTasksPerChild(MAX_TASKS))


@dramatiq.actor
def example(n: int) -> None:
    time.sleep(0.2)
    record("example", n=n, pid=os.getpid())


def drive(ctx: Context) -> dict[str, Any]:
    with ctx.worker(processes=1, threads=1):
        for n in range(COUNT):
            example.send(n)
        seen = ctx.wait(
            lambda s: {e["n"] for e in of(s, "example")} == set(range(COUNT)), "every task"
        )
    pids = {e["pid"] for e in of(seen, "example")}
    return {
        "ran": sorted({e["n"] for e in of(seen, "example")}),
        "worker_processes": len(pids) >= COUNT // MAX_TASKS,
    }
