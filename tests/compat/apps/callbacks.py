"""``on_success`` and ``on_failure`` callbacks (Dramatiq's ``Callbacks`` middleware)."""

from __future__ import annotations

from typing import Any

import dramatiq

from tests.compat.apps.common import Context, of, record


@dramatiq.actor
def on_ok(message: dict[str, Any], result: Any) -> None:
    record("ok", args=message["args"], result=result)


@dramatiq.actor
def on_error(message: dict[str, Any], error: dict[str, Any]) -> None:
    record("error", args=message["args"], type=error["type"], text=error["message"])


@dramatiq.actor(max_retries=0, on_success="on_ok", on_failure="on_error")
def divide(a: int, b: int) -> float:
    return a / b


def drive(ctx: Context) -> dict[str, Any]:
    with ctx.worker(threads=2):
        divide.send(6, 3)
        divide.send(1, 0)
        divide.send_with_options(args=(9, 3), on_success=None)
        seen = ctx.wait(
            lambda s: len(of(s, "ok")) == 2 and len(of(s, "error")) == 1,
            "the three callbacks (on_success=None in the message keeps the actor's)",
        )
    return {
        "ok": sorted((e["args"], e["result"]) for e in of(seen, "ok")),
        "error": [(e["args"], e["type"], e["text"]) for e in of(seen, "error")],
    }
