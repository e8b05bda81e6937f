"""Per-tenant fan-out (lands with its own change)."""

from __future__ import annotations

from typing import Any

from .runtime import Execution, Runtime


def fan_out(runtime: Runtime, execution: Execution, payload: dict[str, Any]) -> None:
    raise NotImplementedError("per-tenant fan-out lands with its own change")
