"""``Sequential``: the lease of ``concurrency="sequential"`` jobs (lands with its own change)."""

from __future__ import annotations

from dramatiq.middleware import Middleware

from ..runtime import Runtime


class Sequential(Middleware):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
