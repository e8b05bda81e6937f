"""Another module of actors."""

from __future__ import annotations

import dramatiq

from tests.compat.apps.common import record


@dramatiq.actor(queue_name="bar")
def bar_task(n: int) -> None:
    record("bar", n=n)
