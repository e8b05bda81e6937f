"""Pure cron tick planning: which due ticks to enqueue, coalesce or skip.

No clock and no I/O: every function takes the instants it reasons about (``after``, ``now``),
so a test asserts a schedule without waiting (see docs/testing.md). The
scheduler (:mod:`kumiko_dramatiq.scheduler`) calls :func:`plan_ticks` on every wake-up.

Misfires (documented default: ``Cron(..., misfire="coalesce", grace_s=60)``)
    A tick is *on time* when the running scheduler handles it as the only due tick and less
    than ``grace_s`` seconds after its time; it is enqueued. Every other due tick is
    *missed*: those due when a scheduler starts (every tick after the last tick enqueued in
    the dataset), and those due together after the scheduler fell behind (a stall, or Redis
    errors that made enqueues fail). For missed ticks:

    * ``misfire="coalesce"``: the latest missed tick less than ``grace_s`` old is enqueued,
      under its own tick id, standing for all missed ticks of the grace window; older ones
      are skipped.
    * ``misfire="skip"``: every missed tick is skipped; the next tick runs.

    A backlog is never replayed: only the grace window is ever enumerated. ``grace_s`` is
    capped at ``Retention.completed_age_s`` (:func:`effective_grace_s`) so that no tick can
    outlive its guard. A dataset without a last-tick record (the first start, or idle longer
    than its TTL) has missed nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from kumiko_dramatiq.cron import Cron

__all__ = ["TickPlan", "effective_grace_s", "plan_ticks"]


@dataclass(frozen=True)
class TickPlan:
    """What to do with the ticks of one cron job that are due now.

    ``enqueue``: the one tick to enqueue, or ``None``. ``coalesced``: missed ticks within
    the grace window that ``enqueue`` stands for (not enqueued themselves). Skipped ticks:
    every one lies in ``[skipped_first, skipped_through]`` (both ``None`` when none was
    skipped; ``skipped_through`` is an instant, not necessarily a tick).
    """

    enqueue: datetime | None = None
    coalesced: tuple[datetime, ...] = ()
    skipped_first: datetime | None = None
    skipped_through: datetime | None = None


def plan_ticks(
    cron: Cron,
    after: datetime | None,
    now: datetime,
    *,
    catching_up: bool,
    grace_s: int | None = None,
) -> TickPlan:
    """Decide which of the ticks in ``(after, now]`` of ``cron`` to enqueue (pure).

    ``after`` is the last instant already accounted for: the last tick enqueued in the
    dataset when ``catching_up`` (a scheduler start), else the previous wake-up of this
    scheduler; ``None`` means nothing was ever enqueued, so nothing was missed.
    ``grace_s`` defaults to ``cron.grace_s``. A tick is within the grace window when it is
    less than ``grace_s`` seconds before ``now``. See the module docstring for the rules;
    only the grace window is enumerated, whatever the gap.
    """
    if after is None:
        return TickPlan()
    grace = cron.grace_s if grace_s is None else grace_s
    after_utc = after.astimezone(UTC)
    now_utc = now.astimezone(UTC)
    first_due = cron.next_fire_time(after_utc)
    if first_due.astimezone(UTC) > now_utc:
        return TickPlan()
    window_start = max(after_utc, now_utc - timedelta(seconds=grace))
    recent = list(cron.fire_times(window_start, now_utc))
    older = first_due.astimezone(UTC) <= window_start
    zone = first_due.tzinfo
    if not catching_up and not older and len(recent) == 1:
        return TickPlan(enqueue=recent[0])
    if cron.misfire == "coalesce" and recent:
        return TickPlan(
            enqueue=recent[-1],
            coalesced=tuple(recent[:-1]),
            skipped_first=first_due if older else None,
            skipped_through=window_start.astimezone(zone) if older else None,
        )
    return TickPlan(
        skipped_first=first_due,
        skipped_through=recent[-1] if recent else window_start.astimezone(zone),
    )


def effective_grace_s(cron: Cron, completed_age_s: int) -> int:
    """``cron.grace_s`` capped at the guards' lifetime, so no tick outlives its guard."""
    return min(cron.grace_s, completed_age_s)
