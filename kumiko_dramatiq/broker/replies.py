"""Decoding what Redis answers (redis-py hands back ``bytes`` unless told otherwise)."""

from __future__ import annotations

from typing import Any


def text(reply: Any) -> str:
    """A reply item as text."""
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def as_list(reply: Any) -> list[Any]:
    """A reply as a list (a single item becomes one), its ``bytes`` items decoded."""
    items = reply if isinstance(reply, list) else [reply]
    return [item.decode() if isinstance(item, bytes) else item for item in items]
