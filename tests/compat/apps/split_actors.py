"""Actors in several modules of a package, on queues of their own, imported after the broker
is set up (Dramatiq's ``use_actors_from_different_files`` example)."""

from __future__ import annotations

from typing import Any

from tests.compat.apps.common import Context, of
from tests.compat.apps.split import bar, foo


def drive(ctx: Context) -> dict[str, Any]:
    with ctx.worker(threads=2):
        for n in range(3):
            foo.foo_task.send(n)
        bar.bar_task.send(99)
        seen = ctx.wait(lambda s: len(of(s, "processed")) == 7, "seven messages")
    return {
        "foo": sorted(e["n"] for e in of(seen, "foo")),
        "bar": sorted(e["n"] for e in of(seen, "bar")),
        "queues": sorted({foo.foo_task.queue_name, bar.bar_task.queue_name}),
    }
