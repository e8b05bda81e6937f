"""``Dedup``: the life of dedup keys on the worker side (lands with its own change)."""

from __future__ import annotations

from dramatiq.middleware import Middleware

from ..runtime import Runtime


class Dedup(Middleware):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
