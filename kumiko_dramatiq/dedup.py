"""Dedup keys on the producer side (lands with its own change)."""

from __future__ import annotations

from typing import Any

from .context import Trigger
from .registry import JobDefinition
from .runtime import Runtime


def dispatch_with_key(
    runtime: Runtime,
    job: JobDefinition,
    payload: dict[str, Any],
    dedup_key: str,
    *,
    trigger: Trigger,
    delay_ms: int | None,
) -> str:
    """Enqueue ``job`` under ``dedup_key`` unless a live job holds the key; return the id."""
    raise NotImplementedError("dedup keys land with their own change")
