"""Schedules as data: ``runner.schedules`` (:class:`Schedules`), :class:`Schedule`, and the
schedulers' :class:`ScheduleLoop`. See docs/jobs.md, "Schedules"."""

from kumiko_dramatiq.schedules.loop import ScheduleLoop
from kumiko_dramatiq.schedules.model import Schedule
from kumiko_dramatiq.schedules.store import Fired, Schedules

__all__ = ["Fired", "Schedule", "ScheduleLoop", "Schedules"]
