"""Dramatiq's retry options on plain actors: ``max_retries``, ``min_backoff``/``max_backoff``,
``retry_when``, ``throws``, ``on_retry_exhausted`` and ``Retry(delay=...)``; an actor failing
with a large local (Dramatiq's ``issue_351`` example) is dead-lettered without retries."""

from __future__ import annotations

from typing import Any

import dramatiq
from dramatiq.middleware import CurrentMessage

from tests.compat.apps.common import Context, of, record

FAST: dict[str, Any] = {"min_backoff": 20, "max_backoff": 50}


def attempt() -> int:
    message = CurrentMessage.get_current_message()
    assert message is not None
    return int(message.options.get("retries", 0)) + 1


@dramatiq.actor(max_retries=3, **FAST)
def flaky(succeed_on: int) -> None:
    if attempt() < succeed_on:
        raise RuntimeError(f"attempt {attempt()}")
    record("flaky_done", attempt=attempt())


@dramatiq.actor(max_retries=2, on_retry_exhausted="exhausted", **FAST)
def always_fails() -> None:
    raise RuntimeError("always")


@dramatiq.actor
def exhausted(message: dict[str, Any], retry_info: dict[str, Any]) -> None:
    record("exhausted", actor=message["actor_name"], retries=retry_info["retries"])


@dramatiq.actor(throws=(ValueError,), **FAST)
def expected_error() -> None:
    raise ValueError("not retried")


@dramatiq.actor(max_retries=5, retry_when=lambda retries, exc: retries < 1, **FAST)
def retried_once() -> None:
    raise RuntimeError("retry_when says once")


@dramatiq.actor(max_retries=2, **FAST)
def asks_for_retry() -> None:
    if attempt() == 1:
        raise dramatiq.Retry(delay=100)
    record("retry_done", attempt=attempt())


@dramatiq.actor(max_retries=0)
def big_failure() -> None:
    big = tuple(range(1_000_000))
    raise RuntimeError(f"failed holding {len(big)} items")


def drive(ctx: Context) -> dict[str, Any]:
    with ctx.worker(threads=4):
        flaky.send(3)
        always_fails.send()
        expected_error.send()
        retried_once.send()
        asks_for_retry.send()
        big_failure.send()
        # each last attempt's "processed" event: recorded after the actor's own record (and
        # a dead letter's after its "processed" one), so the worker may stop once they are in
        seen = ctx.wait(
            lambda s: (
                len(of(s, "processed", actor="flaky", error=None)) == 1
                and len(of(s, "processed", actor="exhausted")) == 1
                and len(of(s, "processed", actor="asks_for_retry", error=None)) == 1
                and len(of(s, "dead")) == 4
            ),
            "every actor's last attempt",
        )
    attempts = {
        actor: [(e["retries"], e["error"]) for e in of(seen, "processed", actor=actor)]
        for actor in sorted({e["actor"] for e in of(seen, "processed")})
    }
    return {
        "attempts": attempts,
        "dead": sorted(e["actor"] for e in of(seen, "dead")),
        "exhausted": [(e["actor"], e["retries"]) for e in of(seen, "exhausted")],
    }
