"""Groups, pipelines, ``pipe_ignore`` and group completion callbacks (Dramatiq's
``composition`` example, with pages of our own instead of web requests)."""

from __future__ import annotations

from typing import Any

import dramatiq
from dramatiq import group, pipeline

from tests.compat.apps.common import Context, of, record

PAGES = {
    "a": "one two three",
    "b": "four five",
    "c": "six",
    "d": "seven eight nine ten",
}


@dramatiq.actor
def request(uri: str) -> str:
    return PAGES[uri]


@dramatiq.actor(store_results=True)
def count_words(text: str) -> int:
    return len(text.split(" "))


@dramatiq.actor(store_results=True)
def add(x: int, y: int) -> int:
    return x + y


@dramatiq.actor
def marker(name: str) -> None:
    record("marker", name=name)


@dramatiq.actor
def all_done(name: str) -> None:
    record("all_done", name=name)


def drive(ctx: Context) -> dict[str, Any]:
    with ctx.worker(threads=4):
        # A group of pipelines, whose results come back in the group's order
        # (a step's last argument comes from the previous step: typed Actor.message cannot
        # say so, hence message_with_options)
        jobs = group(
            request.message(uri) | count_words.message_with_options() for uri in PAGES
        ).run()
        counts = list(jobs.get_results(block=True, timeout=30_000))
        # A pipeline whose steps get the previous result as their last argument
        steps = [add.message(1, 2), *(add.message_with_options(args=(n,)) for n in (3, 4))]
        pipe = pipeline(steps).run()
        piped = pipe.get_result(block=True, timeout=30_000)
        every = list(pipe.get_results(block=True, timeout=30_000))
        # pipe_ignore: the next step does not get the result
        (add.message(5, 5) | marker.message_with_options(args=("ignored",), pipe_ignore=True)).run()
        # A group completion callback, once every member is done
        members = group([add.message(i, i) for i in range(5)])
        members.add_completion_callback(all_done.message("five adds"))
        members.run()
        seen = ctx.wait(lambda s: len(of(s, "all_done")) == 1, "the completion callback")
        seen = ctx.wait(lambda s: len(of(s, "marker")) == 1, "the pipe_ignore step")
    adds_before_callback = [
        e for e in seen[: seen.index(of(seen, "all_done")[0])] if e.get("actor") == "add"
    ]
    return {
        "counts": counts,
        "piped": piped,
        "every_step": every,
        "pipe_ignore": [e["name"] for e in of(seen, "marker")],
        "callback": [e["name"] for e in of(seen, "all_done")],
        "adds_before_callback": len(adds_before_callback) >= 5,
    }
