"""One module of actors; ``foo_task`` sends to an actor of another module."""

from __future__ import annotations

import dramatiq

from tests.compat.apps.common import record
from tests.compat.apps.split.bar import bar_task


@dramatiq.actor(queue_name="foo")
def foo_task(n: int) -> None:
    record("foo", n=n)
    bar_task.send(n * 10)
