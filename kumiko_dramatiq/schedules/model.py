"""A schedule as data (:class:`Schedule`) and the checks an upsert makes (:func:`spec_of`).

A runtime schedule is stored as its *spec*: the JSON object ``{"job", "cron" | "every_ms",
"timezone", "payload", "overlap", "paused", "anchor"}`` (a cron's also ``"misfire"`` and
``"grace_s"``, as its ``Cron`` says) (``anchor``: when an ``every_ms``
schedule's ticks are counted from, ms), in ``keys.schedules``. Its next tick is its score in
``keys.schedules_due`` (absent while paused), its last one a field of ``keys.schedules_last``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from kumiko_dramatiq.cron import OVERLAPS, Cron
from kumiko_dramatiq.errors import JobConfigError
from kumiko_dramatiq.limits import dedup_key_problem

#: The shortest ``every_ms``.
MIN_EVERY_MS: Final = 1_000


@dataclass(frozen=True)
class Schedule:
    """One schedule: ``owner`` ``"code"`` (a job declared with ``trigger=Cron(...)``, whose id
    is the job's qualified name) or ``"runtime"`` (``runner.schedules.upsert``). ``cron`` is
    the expression (``None`` for an ``every_ms`` schedule); ``next_fire`` is ``None`` while
    paused."""

    id: str
    job_name: str
    cron: str | None
    every_ms: int | None
    timezone: str
    payload: dict[str, Any]
    overlap: str
    paused: bool
    next_fire: datetime | None
    last_fire: datetime | None
    owner: str

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        for name in ("next_fire", "last_fire"):
            value = out[name]
            out[name] = None if value is None else value.isoformat()
        return out


def check_id(schedule_id: Any) -> str:
    """A schedule id: a dedup key's rules (a non-empty string, at most 512 bytes)."""
    problem = dedup_key_problem(schedule_id)
    if problem is not None:
        raise JobConfigError(None, "schedule id", problem, schedule_id)
    return str(schedule_id)


def spec_of(
    schedule_id: str,
    job_name: str,
    payload: dict[str, Any],
    *,
    cron: Cron | None,
    every_ms: Any,
    overlap: Any,
    paused: Any,
) -> dict[str, Any]:
    """The spec an upsert writes (no ``anchor`` yet); ``JobConfigError`` naming the bad
    field otherwise."""
    subject = f"schedule {schedule_id!r}"
    if (cron is None) == (every_ms is None):
        raise JobConfigError(None, subject, "needs cron or every_ms, not both or neither")
    if cron is not None and not isinstance(cron, Cron):
        raise JobConfigError(None, subject, "cron must be a Cron(expr, timezone=...)", cron)
    if every_ms is not None and (
        not isinstance(every_ms, int) or isinstance(every_ms, bool) or every_ms < MIN_EVERY_MS
    ):
        raise JobConfigError(
            None, subject, f"every_ms must be an integer >= {MIN_EVERY_MS}", every_ms
        )
    overlap = "allow" if overlap is None else overlap
    if overlap not in OVERLAPS:
        raise JobConfigError(None, subject, f"overlap must be one of {list(OVERLAPS)}", overlap)
    if not isinstance(paused, bool):
        raise JobConfigError(None, subject, "paused must be a bool", paused)
    spec: dict[str, Any] = {"job": job_name, "payload": payload, "overlap": overlap}
    if cron is not None:
        spec.update(
            cron=cron.expr, timezone=cron.timezone, misfire=cron.misfire, grace_s=cron.grace_s
        )
    else:
        spec.update(every_ms=every_ms, timezone="UTC")
    spec["paused"] = paused
    return spec


def same_schedule(stored: dict[str, Any], spec: dict[str, Any]) -> bool:
    """Whether ``spec`` asks for what ``stored`` is (its anchor aside)."""
    return {k: v for k, v in stored.items() if k != "anchor"} == spec


def encode_spec(spec: dict[str, Any]) -> str:
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def cron_of(spec: dict[str, Any]) -> Cron | None:
    return None if spec.get("cron") is None else _cron(spec["cron"], spec["timezone"])


@functools.lru_cache(maxsize=4096)
def _cron(expr: str, timezone: str) -> Cron:
    """A parsed cron, once per expression and zone (a scheduler computes every tick's next)."""
    return Cron(expr, timezone)


def misfire_of(spec: dict[str, Any]) -> tuple[str, int]:
    """The misfire policy and grace (ms) of ``spec``: its ``Cron``'s, or ``Cron``'s defaults
    (``"coalesce"``, 60 s) for an ``every_ms`` schedule."""
    return spec.get("misfire", "coalesce"), int(spec.get("grace_s", 60)) * 1000


def next_fire_ms(spec: dict[str, Any], after_ms: int) -> int:
    """The first tick of ``spec`` strictly after ``after_ms`` (ms since the epoch)."""
    cron = cron_of(spec)
    if cron is not None:
        after = datetime.fromtimestamp(after_ms / 1000, UTC)
        return int(cron.next_fire_time(after).timestamp() * 1000)
    every, anchor = int(spec["every_ms"]), int(spec.get("anchor", after_ms))
    if after_ms < anchor:
        return anchor
    return anchor + ((after_ms - anchor) // every + 1) * every


def instant(ms: float | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(float(ms) / 1000, UTC)
