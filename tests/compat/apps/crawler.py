"""Actors that send more messages as they run, skipping pages seen before (Dramatiq's
``crawler`` example, on a link graph of our own instead of the web)."""

from __future__ import annotations

from typing import Any

import dramatiq

from tests.compat.apps.common import Context, client, of, record

LINKS: dict[str, list[str]] = {
    "home": ["about", "blog", "shop"],
    "about": ["home", "team"],
    "blog": ["post-1", "post-2", "home"],
    "post-1": ["post-2", "blog"],
    "post-2": ["post-1", "shop"],
    "shop": ["cart", "home"],
    "cart": ["shop"],
    "team": ["about", "careers"],
    "careers": [],
    "orphan": ["home"],
}


@dramatiq.actor(max_retries=3, time_limit=10_000)
def crawl(url: str) -> None:
    if not client().set(f"compat-apps:visited:{url}", b"", nx=True, ex=3600):
        record("already_visited", url=url)
        return
    for link in LINKS[url]:
        crawl.send(link)
    record("crawled", url=url)


def reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        url = todo.pop()
        if url not in seen:
            seen.add(url)
            todo.extend(LINKS[url])
    return seen


def drive(ctx: Context) -> dict[str, Any]:
    pages = reachable("home")
    sends = 1 + sum(len(LINKS[url]) for url in pages)
    with ctx.worker(threads=4):
        crawl.send("home")
        seen = ctx.wait(lambda s: len(of(s, "processed")) == sends, f"{sends} crawl messages")
    return {
        "crawled": sorted(e["url"] for e in of(seen, "crawled")),
        "already_visited": len(of(seen, "already_visited")),
    }
